"""Safe saves: a checkpoint directory is either the previous complete checkpoint or the new complete one, never a mix.

DCP writes into a staging directory beside the target, ``<path>.saving``; the coordinator (rank 0), which writes
DCP's ``.metadata`` only once every rank's files are written, then commits: it removes the staging directory's
``.funcshard-uncommitted`` marker, moves a previous ``<path>`` aside to ``<path>.old``, renames the staging directory
to ``<path>`` (one atomic rename on a POSIX file system) and deletes ``<path>.old``. DCP returns on every rank only
after the coordinator's ``finish``, so a returned save is committed everywhere. A rank killed mid-write leaves
``<path>`` as it was (the staging directory is cleared by the next save); a coordinator killed between its two
renames leaves ``<path>.old`` (the previous checkpoint) and ``<path>.saving`` (the new one), both complete, which
``check_committed`` names. ``Staged``: a DCP ``AsyncStager`` for a state dict funcshard has already copied.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import AsyncStager

from funcshard._spec import ShardingError

STAGING, OLD, MARKER, METADATA = ".saving", ".old", ".funcshard-uncommitted", ".metadata"


def _sibling(path: str | os.PathLike, suffix: str) -> Path:
    p = Path(path)
    return p.with_name(p.name + suffix)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CommittingWriter(FileSystemWriter):
    """A ``FileSystemWriter`` that writes into ``<path>.saving`` and commits it to ``<path>`` in ``finish``."""

    def __init__(self, path: str | os.PathLike, **kwargs):
        self.final = Path(path)
        super().__init__(_sibling(path, STAGING), **kwargs)

    def prepare_local_plan(self, plan):  # every rank: (FileSystemWriter's own also warns about an old .metadata)
        self.fs.mkdir(self.path)
        return plan

    def prepare_global_plan(self, plans):  # the coordinator, after every rank's plan and before any rank writes
        staging = Path(self.path)
        for entry in staging.iterdir():  # what an interrupted save left
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        (staging / MARKER).write_bytes(b"")
        return super().prepare_global_plan(plans)

    def finish(self, metadata, results) -> None:  # the coordinator, once every rank's files are written
        super().finish(metadata, results)
        staging, final, old = Path(self.path), self.final, _sibling(self.final, OLD)
        (staging / MARKER).unlink()
        _fsync_dir(staging)
        if old.exists():
            shutil.rmtree(old)
        if final.exists():
            final.rename(old)
        staging.rename(final)
        _fsync_dir(final.parent)
        if old.exists():
            shutil.rmtree(old)


def check_committed(path: str | os.PathLike) -> None:
    """Refuse what is not a complete, committed checkpoint directory, naming what to load instead."""
    p = Path(path)
    if p.name.endswith(STAGING) or (p / MARKER).exists():
        final = p.with_name(p.name.removesuffix(STAGING)) if p.name.endswith(STAGING) else p
        raise ShardingError(
            f"{path} is an uncommitted checkpoint: its save did not finish (a rank stopped mid-write, or the save is "
            f"still running); the last committed checkpoint is {final}, as it was before that save")
    if not p.exists():
        old, staging = _sibling(p, OLD), _sibling(p, STAGING)
        if old.exists():
            raise ShardingError(
                f"no checkpoint at {path}: a save replacing it stopped while committing; the previous checkpoint is "
                f"complete at {old}" + (f" and the new one at {staging}" if (staging / METADATA).exists() else "")
                + f": rename the one you want to {p.name}")
        raise FileNotFoundError(f"no checkpoint at {path}")
    if not (p / METADATA).exists():
        raise ShardingError(f"{path} has no {METADATA}: not a complete torch.distributed.checkpoint directory (a save "
                            f"that did not finish, or not a checkpoint)")


def checked_metadata(path: str | os.PathLike, reader) -> object:
    """DCP's metadata of the committed checkpoint at ``path`` (``reader``: its ``FileSystemReader``), once every file
    it names is there and holds the bytes it names: a damaged checkpoint (its metadata unreadable, a file deleted or
    truncated) is refused naming the file, on every rank (each looks at every file) and before anything is read."""
    p = Path(path)
    try:
        md = reader.read_metadata()
    except Exception as e:  # (a truncated pickle: EOFError, UnpicklingError, ...)
        raise ShardingError(
            f"checkpoint {path}: its metadata {p / METADATA} cannot be read ({type(e).__name__}: {e}): the file is "
            f"damaged (truncated or overwritten). Nothing was loaded; load another checkpoint (e.g. the previous "
            f"save's) or save this one again") from None
    need: dict[str, int] = {}  # file -> the bytes the metadata reads from it
    for info in (getattr(md, "storage_data", None) or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for rel, n in sorted(need.items()):
        try:
            size = (p / rel).stat().st_size
        except FileNotFoundError:
            problems.append(f"  {p / rel}: missing (the metadata reads {n} bytes from it)")
            continue
        if size < n:
            problems.append(f"  {p / rel}: {size} bytes, the metadata reads {n} (truncated)")
    if problems:
        raise ShardingError(f"checkpoint {path} is damaged: files its metadata names are missing or short:\n"
                            + "\n".join(problems) + "\nNothing was loaded; load another checkpoint (e.g. the "
                            "previous save's), or restore the files")
    return md


def load_error(path: str | os.PathLike, error: BaseException) -> ShardingError:
    """DCP's ``CheckpointException`` (a ``BaseException``: ``except Exception`` missed it, and its message was only
    "ranks: dict_keys([0, 1])") as a ShardingError naming each rank's failure."""
    failures = getattr(error, "failures", None) or {}
    told = "; ".join(f"rank {r}: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                     for r, e in sorted(failures.items())) or f"{type(error).__name__}: {error}"
    return ShardingError(f"checkpoint {path} could not be read ({told}); the checkpoint is damaged or not this "
                         f"model's. Nothing passed in was changed; load another checkpoint (e.g. the previous save's)")


class Staged(AsyncStager):
    """DCP's stager for a state dict that is already a copy (``funcshard.checkpoint.async_save`` copies the shards
    itself: DCP's default stager copies each DTensor without the checkpoint protocol the flat layout's pieces and
    0-dim parameters answer with)."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def close(self) -> None:
        pass
