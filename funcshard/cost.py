"""What a plan costs per rank, predicted on one CPU process: memory by category, collectives, step time.

    mesh = funcshard.cost.fake_mesh(8)                           # a target world size, no ranks needed
    plan = funcshard.plan(model, mesh, groups=(Block,))          # the model may live on the meta device
    c = funcshard.cost.estimate(plan, x, loss=lambda out: F.cross_entropy(out.flatten(0, 1), y.flatten()),
                                optimizer=optim.adamw(1e-3), hardware=funcshard.cost.Hardware.cpu_default())
    print(c)                          # peak bytes by category, bytes and count per collective, step time
    fits = funcshard.cost.sweep(model, mesh, x, loss=..., budget=2 * 2**30, groups=[(Block,), None])

How. The collectives and their bytes are the plan's schedule (``_schedule``, what the runtime issues, exactly).
Activations, the unsharded gradients and each op's FLOPs and bytes come from one traced step of the unsharded
module on fake tensors (``_cost_trace.profile_step``: the real kernels' shapes, no data), marked where each
group's forward and backward start and end; the optimizer state and its update's transients from a traced update
on fake shards. :func:`estimate` then replays the schedule against those marks as the runtime executes it: a
group's all-gather buffer from its issue (on use or by a prefetch) to its copy-out, its unsharded parameters from
then to its free, its gradients until the reduce-scatter's copy-in, one reduce-scatter in flight (input and
output) until the next group's post-backward takes it. Memory is the sum at every point; the peak is the highest.
Time: a main thread running the traced ops (roofline per op: ``max(FLOPs / flops_per_s, bytes / memory_bytes_per_s)``
plus a fixed cost per op and per group) and one communication channel running the collectives in issue order
(``latency_s + bytes on the wire / link_bytes_per_s``, ring algorithms: ``(W - 1) / W`` of the buffer), the main
thread waiting where the runtime waits (a group's use, the next post-backward, the end of backward).

What it does not model: compute slowed down by communication sharing the cores (gloo on CPU) or memory bandwidth;
the allocator's caching and fragmentation (on CUDA, reserved memory is above these live bytes); a rank's
difference from rank 0 (padding sits on the last ranks; the prediction is rank 0's).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from funcshard._comm import wire_nbytes
from funcshard._compat import all_gather_name, fake_store, torch_tree_leaves
from funcshard._cost_trace import (
    BWD_END,
    BWD_START,
    FWD_END,
    FWD_START,
    INPUTS_DONE,
    StepProfile,
    Stretch,
    UpdateProfile,
    profile_step,
    profile_update,
)
from funcshard._plan import ROOT, UNIT, Plan
from funcshard._runtime.buffers import Status
from funcshard._schedule import (ALL_GATHER, ALL_REDUCE, BACKWARD, DEVICE_TO_HOST, END_OF_BACKWARD, FREE,
                                 HOST_TO_DEVICE, POST_BACKWARD, REDUCE_SCATTER, Collective, HostCopy, Op,
                                 backward_reaches, frees_listed, frozen_held, gradient_source, label, reduce_scatter_at,
                                 schedule)
from funcshard._spec import ShardingError, takes_grad

__all__ = ["CATEGORIES", "Cost", "Hardware", "OwnerCost", "calibrate", "estimate", "fake_mesh", "owner_costs",
           "sweep"]

CATEGORIES = ("sharded_params", "unsharded_params", "gradients", "optimizer_state", "comm_buffers", "activations")
"""The categories of a rank's memory the estimate reports (``Cost.peak``, ``Cost.max_by_category()``), in print
order."""


# ---- hardware figures ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The figures the step-time estimate uses, per rank.

    Attributes:
        flops_per_s: compute throughput of matrix products (FLOP/s).
        memory_bytes_per_s: memory traffic of element-wise ops and copies (bytes read + written per second).
        link_bytes_per_s: what one rank sends (and receives) per second in a collective.
        latency_s: fixed cost of one collective.
        op_overhead_s: fixed cost of one op (dispatch, kernel launch).
        group_overhead_s: the runtime's fixed cost per group and step (hooks, copies' setup, Python).
    """

    flops_per_s: float
    memory_bytes_per_s: float
    link_bytes_per_s: float
    latency_s: float = 0.0
    op_overhead_s: float = 0.0
    group_overhead_s: float = 0.0

    def collective_s(self, c: Collective, nbytes: int | None = None) -> float:
        """One collective over ``c.world`` ranks, ring algorithms: an all-gather or reduce-scatter sends
        ``(W - 1) / W`` of the unsharded buffer, an all-reduce (HSDP, over the replicate axis) twice that. ``nbytes``:
        the bytes a group's comm hook moves instead of the buffer's (``_comm.wire_nbytes``).

        Args:
            c: the collective (kind, ranks, bytes of its unsharded buffer), as the schedule lists it.
            nbytes: the bytes a comm hook moves instead of the buffer's; None: the buffer's.
        """
        sent = (c.nbytes if nbytes is None else nbytes) * (c.world - 1) / c.world * (2 if c.kind == ALL_REDUCE else 1)
        return self.latency_s + sent / self.link_bytes_per_s

    def stretch_s(self, s: Stretch) -> float:
        """Seconds of the ops between two marks of a traced step: a roofline per op (FLOPs at ``flops_per_s`` or bytes
        at ``memory_bytes_per_s``, the slower) plus ``op_overhead_s`` per op.

        Args:
            s: the ops of one stretch of the traced step (their FLOPs and bytes).
        """
        return s.seconds(self.flops_per_s, self.memory_bytes_per_s) + len(s.flops) * self.op_overhead_s


def _timed(fn: Callable[[], Any], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def calibrate(mesh: DeviceMesh | None = None, *, device: str | torch.device | None = None,
              quick: bool = False) -> Hardware:
    """Measure this process's figures in a few seconds: a 1024^3 fp32 matrix product (FLOP/s), a 64 MiB add
    (memory bytes/s), a loop of tiny adds (op overhead), and, when ``mesh`` has several ranks on a real process
    group, all-gathers of 4 KiB and 16 MiB per rank (latency, link bytes/s; every rank must call it then). Run it
    where the training runs (same device, same ``torch.set_num_threads``). ``group_overhead_s`` is left 0: pass
    a measured one with ``dataclasses.replace``. ``quick``: operands an eighth to a sixteenth as large, three
    repeats: rougher figures in a fraction of the time (the notebooks use it).

    Args:
        mesh: the mesh the training runs on: its device, and with several ranks on a real process group the link figures
            (every rank calls it then); None: this process only.
        device: the device to measure (default: the mesh's, or the CPU).
        quick: smaller operands, three repeats: rougher figures, faster.
    """
    dev = torch.device(device) if device is not None else (
        torch.device("cpu") if mesh is None or mesh.device_type == "cpu" else torch.device(mesh.device_type,
                                                                                         torch.cuda.current_device()))
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def run(fn):
        def call():
            fn()
            sync()
        return call

    n, numel, big, repeats = (512, 2**20, 2**18, 3) if quick else (1024, 2**24, 2**22, 5)
    a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    flops = 2 * n**3 / _timed(run(lambda: a @ b), repeats)
    x, y = torch.randn(numel, device=dev), torch.randn(numel, device=dev)
    out = torch.empty_like(x)
    mem = 3 * x.numel() * 4 / _timed(run(lambda: torch.add(x, y, out=out)), repeats)
    s = torch.ones(1, device=dev)
    op = _timed(run(lambda: [torch.add(s, s) for _ in range(200)]), repeats) / 200
    link, latency = float("inf"), 0.0
    if mesh is not None and mesh.size(mesh.ndim - 1) > 1 and dist.get_backend(mesh.get_group(mesh.ndim - 1)) != "fake":
        pg = mesh.get_group(mesh.ndim - 1)
        world = mesh.size(mesh.ndim - 1)

        def gather_s(numel: int) -> float:
            inp = torch.ones(numel, device=dev)
            full = torch.empty(numel * world, device=dev)

            def once():
                dist.barrier(group=pg)
                getattr(dist, all_gather_name)(full, inp, group=pg)
            return _timed(run(once), repeats + 2)

        small = 1024
        t_small, t_big = gather_s(small), gather_s(big)
        latency = t_small
        link = (big - small) * 4 * (world - 1) / max(t_big - t_small, 1e-9)
    return Hardware(flops, mem, link, latency, op)


def fake_mesh(world: int, device_type: str = "cpu") -> DeviceMesh:
    """A 1-D mesh of ``world`` ranks over torch's fake process group (``backend="fake"``: collectives do nothing),
    in this process: plan for a target world size without its ranks. Initializes the default process group if
    there is none; a fake one of another size is replaced; a real one raises.

    Args:
        world: the number of ranks to plan for.
        device_type: the mesh's device type (planning reads it; nothing runs there).
    """
    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError(
                f"fake_mesh({world}): this process already runs a real process group ({dist.get_backend()}); plan "
                f"for another world size in a process of its own (or call estimate on a plan over this group)")
        if dist.get_world_size() != world:
            dist.destroy_process_group()
    if not dist.is_initialized():
        dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world)
    return init_device_mesh(device_type, (world,))


# ---- the result ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Point:
    """One point of the predicted step: what just happened, the bytes live by category, the main thread's time."""

    what: str
    bytes: dict[str, int]
    t: float | None = None

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


@dataclasses.dataclass(frozen=True)
class Interval:
    """A stretch of the predicted step on one lane (``"compute"``, ``"wait"`` or ``"comm"``), in seconds."""

    lane: str
    what: str
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Cost:
    """A plan's predicted cost per rank (see the module docstring for how).

    Attributes:
        plan: the plan.
        peak_bytes: the step's peak of live bytes (forward, backward and the optimizer update).
        peak: the point of the peak, with its bytes by category (:data:`CATEGORIES`).
        points: the memory timeline, one :class:`Point` per event.
        collectives: every collective of the step, in issue order (the schedule's).
        step_s: the predicted step time (None without hardware figures).
        compute_s: the main thread's compute (ops, per-op and per-group overheads).
        comm_s: the collectives' time on the channel.
        exposed_s: the main thread's waits for collectives.
        intervals: the time timeline (compute, waits, collectives), for plotting.
        traced_on: the device type the step was traced on: the mesh's, or ``"cpu"`` where this process lacks it
            (e.g. planning for CUDA on a CPU-only machine: activations are then the CPU kernels', e.g. its
            attention's, which may differ from the target's).
        copies: CPU offload's copies between host and device in the step (``HostCopy``: the offloaded groups'
            shards in before each all-gather, their gradient shards out after the reduce-scatter, in issue order;
            then ``optim.offload``'s state of each group, in and out, when the optimizer is one). Counted in
            bytes only: the time estimate and the memory categories do not model them (an offloaded group's
            shards and ``optim.offload``'s state count as device memory).
        owners: one :class:`OwnerCost` per whole-matrix transformation of the optimizer (``optim.muon``,
            ``optim.owner_compute``, each labelled one of an ``optim.multi_transform``): its all-to-all bytes, the
            owners' extra memory and FLOPs (:func:`owner_costs`); empty without an optimizer or with none of these.
            Printed after the step's figures.
    """

    plan: Plan = dataclasses.field(repr=False)
    peak_bytes: int
    peak: Point
    points: tuple[Point, ...] = dataclasses.field(repr=False)
    collectives: tuple[Collective, ...] = dataclasses.field(repr=False)
    step_s: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    exposed_s: float | None = None
    intervals: tuple[Interval, ...] = dataclasses.field(default=(), repr=False)
    traced_on: str = "cpu"
    copies: tuple[HostCopy, ...] = dataclasses.field(default=(), repr=False)
    owners: tuple = dataclasses.field(default=(), repr=False)  # (OwnerCost per whole-matrix optimizer: see below)

    def counts(self) -> dict[str, int]:
        """Collectives per step by kind."""
        out = {ALL_GATHER: 0, REDUCE_SCATTER: 0}  # (and "all-reduce" when the step has them: HSDP)
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0) + 1
        return out

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes of the unsharded buffers per kind (what ``Schedule.totals`` and a counter at dispatch see)."""
        out = {ALL_GATHER: 0, REDUCE_SCATTER: 0}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0) + c.nbytes
        return out

    def wire_bytes_by_kind(self) -> dict[str, int]:
        """Bytes per kind as the groups' comm hooks move them (``CommHook.nbytes``; the buffers' without a hook):
        what the time estimate sends."""
        out = {ALL_GATHER: 0, REDUCE_SCATTER: 0}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0) + wire_nbytes(self.plan, c)
        return out

    def copy_bytes_by_kind(self) -> dict[str, int]:
        """Bytes copied between host and device per step (CPU offload), ``{"host-to-device": ..., "device-to-host":
        ...}``: what an accelerator's copy engine moves for the plan's offloaded groups (and an ``optim.offload``
        optimizer); zeros without offload."""
        out = {HOST_TO_DEVICE: 0, DEVICE_TO_HOST: 0}
        for c in self.copies:
            out[c.kind] += c.nbytes
        return out

    def max_by_category(self) -> dict[str, int]:
        """Each category's own highest value over the step (they need not peak together)."""
        return {k: max(p.bytes[k] for p in self.points) for k in CATEGORIES}

    def __str__(self) -> str:
        mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
        p = self.plan
        lines = [f"Cost per rank of a plan of {len(p.groups)} groups over {p.world} ranks (prefetch "
                 f"{p.forward_prefetch}/{p.backward_prefetch}, layout {p.layout}):",
                 f"  peak memory {mib(self.peak_bytes)} at {self.peak.what}:"]
        if self.traced_on != p.mesh.device_type:
            lines.insert(1, f"  (traced on {self.traced_on}: this process has no {p.mesh.device_type}; activations "
                            f"are the {self.traced_on} kernels')")
        lines += [f"    {k:17s} {mib(v)}" for k, v in self.peak.bytes.items()]
        counts, nbytes = self.counts(), self.bytes_by_kind()
        wire = self.wire_bytes_by_kind()
        lines += [f"  {k}: {counts[k]} per step, {mib(nbytes[k])} (unsharded buffers)" +
                  (f", {mib(wire[k])} moved by the comm hooks" if wire[k] != nbytes[k] else "") for k in counts]
        if self.copies:
            by = {}
            for c in self.copies:
                by.setdefault(c.kind, {}).setdefault(c.what, [0, 0])
                by[c.kind][c.what][0] += 1
                by[c.kind][c.what][1] += c.nbytes
            lines += [f"  {kind} copies (CPU offload): " + ", ".join(
                f"{what} {n} per step, {mib(b)}" for what, (n, b) in whats.items()) for kind, whats in by.items()]
        if self.step_s is not None:
            lines.append(f"  step {self.step_s * 1e3:.1f} ms: compute {self.compute_s * 1e3:.1f} ms, collectives "
                         f"{self.comm_s * 1e3:.1f} ms of which {self.exposed_s * 1e3:.1f} ms exposed")
        lines += [str(o) for o in self.owners]
        return "\n".join(lines)


# ---- the replay ------------------------------------------------------------------------------------------


class _Ops:
    """The schedule's ops not yet replayed; each is taken by the event that issues it."""

    def __init__(self, ops: Sequence[Op]):
        self.left = [op for op in ops if op.kind != BACKWARD]

    def take(self, kind: str, group: str) -> Op:
        for i, op in enumerate(self.left):
            if op.kind == kind and op.group == group:
                return self.left.pop(i)
        raise RuntimeError(f"funcshard.cost: the runtime would issue '{kind} {label(group)}' here, and the plan's "
                           f"schedule has no such op left: the cost model and the schedule disagree (a bug; please "
                           f"report it with the plan printed)")


class _Reduce:
    """The replay's reduce-scatter in flight (``PendingReduce``'s part in ``ReduceQueue``): ``finish`` waits for it,
    frees its input and, HSDP, all-reduces its output over the replicate axis (issued then) and waits for that."""

    __slots__ = ("replay", "name", "inp", "out", "end", "reduces", "replicate")

    def __init__(self, replay: _Replay, name: str, inp: int, out: int, end: float, reduces: tuple[Collective, ...]):
        self.replay, self.name, self.inp, self.out, self.end, self.reduces = replay, name, inp, out, end, reduces
        self.replicate = reduces or None  # (ReduceQueue.before_gather: an all-reduce follows, HSDP)

    def finish(self) -> None:
        r = self.replay
        r.wait_until(self.end, f"reduce-scatter {label(self.name)}")
        if r.rs_copy and self.inp:
            r.at(f"reduce-scatter {label(self.name)} wait (gloo's copy of its input)", {"comm_buffers": self.inp})
        if self.reduces:
            self.inp = 0
            r.wait_until(r.issue(self.reduces), f"all-reduce {label(self.name)}")
        r.reducing.remove(self)
        r.grad_shards += self.out


class _Replay:
    """The runtime's lifecycle along the traced marks (``_runtime.replay.ReplayStep``: the runtime's group runs,
    prefetcher, frozen release and reduce queue over stand-in buffers), with this as their ledger: what each group
    holds, the reduce-scatter in flight, time, and the schedule's ops each event takes."""

    def __init__(self, plan: Plan, prof: StepProfile, update: UpdateProfile | None, hw: Hardware | None):
        from funcshard._runtime.replay import ReplayStep  # (the runtime's modules import torch._dynamo: on use)

        self.plan, self.prof, self.update, self.hw = plan, prof, update, hw
        self.step = schedule(plan)
        self.ops = _Ops(self.step.ops)
        self.flat = plan.layout == "flat"
        self.sharded = sum(s.local_numel * s.dtype.itemsize for s in plan.specs.values())
        self.runtime = ReplayStep(plan, self, prof.frozen, prof.trainable)
        self.gb = self.runtime.groups  # the groups' stand-ins: status (Status), the bytes kept after forward
        self.ag_held: dict[str, int] = {}  # all-gather buffers in flight (per-parameter layout)
        self.ag_end: dict[str, float] = {}
        self.unsharded: dict[str, int] = {}
        self.reducing: list[_Reduce] = []  # the reduce-scatters in flight (each until its finish)
        # gloo (CPU) reduce-scatters by an all-reduce of a copy of the input, split in its wait: one more
        # input-sized buffer there (tests/test_cost.py's bf16 variants peak there); NCCL's works in place
        self.rs_copy = plan.mesh.device_type == "cpu"
        self.using: str | None = None  # the group whose use (or pre-backward) issues the all-gathers now
        self.used: set[str] = set()
        self.events: list[tuple[str, str]] = []  # the lifecycle, as the runtime's events name it (observe.emit)
        self.grad_shards = 0
        self.act = prof.input_bytes
        self.grads = 0
        self.points: list[Point] = []
        self.t = 0.0
        self.chan = 0.0  # when the communication channel is free
        self.compute = self.exposed = self.comm = 0.0
        self.intervals: list[Interval] = []
        self.collectives: list[Collective] = []

    # memory
    def at(self, what: str, extra: dict[str, int] | None = None) -> None:
        b = {"sharded_params": self.sharded + sum(gb.post or 0 for gb in self.gb.values()),
             "unsharded_params": sum(self.unsharded.values()),
             "gradients": self.grads + self.grad_shards,
             "optimizer_state": self.update.state_bytes if self.update else 0,
             "comm_buffers": sum(self.ag_held.values()) + sum(rs.inp + rs.out for rs in self.reducing),
             "activations": self.act}
        for k, v in (extra or {}).items():
            b[k] += v
        self.points.append(Point(what, b, self.t if self.hw else None))

    # time
    def run(self, seconds: float, what: str, lane: str = "compute") -> None:
        if seconds > 0:
            self.intervals.append(Interval(lane, what, self.t, self.t + seconds))
        self.t += seconds
        self.compute += seconds

    def wait_until(self, end: float, what: str) -> None:
        if end > self.t:
            self.intervals.append(Interval("wait", what, self.t, end))
            self.exposed += end - self.t
            self.t = end

    def issue(self, collectives: Sequence[Collective]) -> float:
        self.collectives.extend(collectives)
        if not self.hw:
            return 0.0
        for c in collectives:
            start = max(self.t, self.chan)
            self.chan = start + self.hw.collective_s(c, wire_nbytes(self.plan, c))
            self.comm += self.chan - start
            self.intervals.append(Interval("comm", f"{c.kind} {label(c.group)}", start, self.chan))
        return self.chan

    # the ledger of the runtime's stand-in buffers (_runtime.replay)
    def all_gather(self, name: str, post: int | None) -> None:
        """``GroupBuffers.issue``: the group's all-gather is issued."""
        op = self.ops.take(ALL_GATHER, name)
        nbytes = sum(c.nbytes for c in op.collectives)
        if self.flat and post is None:  # the all-gather writes into the parameters' own buffer
            self.unsharded[name] = nbytes
        else:  # (from a k-th kept after forward: into a buffer of its own, copied out, as per parameter)
            self.ag_held[name] = nbytes
        self.ag_end[name] = self.issue(op.collectives)
        self.events.append(("all-gather issued", name))
        backward = self.runtime.backward_started
        why = (("before its backward" if backward else "on use") if name == self.using
               else f"prefetch, while {label(self.using)} computes")
        self.at(f"all-gather {label(name)} ({why})")

    def copy_out(self, name: str) -> None:
        """``GroupBuffers.wait``: the copy-out into the unsharded buffers, then the all-gather buffer is freed."""
        self.wait_until(self.ag_end.pop(name), f"all-gather {label(name)}")
        if name in self.ag_held:
            self.unsharded[name] = self.step.unsharded_nbytes(name)
            self.at(f"copy-out {label(name)}")
            del self.ag_held[name]

    def freed(self, name: str) -> None:
        """``GroupBuffers.free``; in forward, the schedule's free when it lists one (``frees_listed``)."""
        if not self.runtime.backward_started and frees_listed(self.gb[name].group):
            self.ops.take(FREE, name)
        self.unsharded.pop(name, None)
        self.events.append(("freed", name))

    def kept(self, name: str, k: int) -> int:
        """The bytes a rank keeps of the group after forward, resharded to ``k`` ranks: a ``k``-th of its forward
        all-gather's (the schedule's first all-gather of it; none for a group without parameters), the backward
        all-gather's input over ``k`` ranks."""
        return sum(c.nbytes for c in next((op.collectives for op in self.step.ops
                                           if op.kind == ALL_GATHER and op.group == name), ())) // k

    def reduce_scatter(self, name: str) -> _Reduce | None:
        """``ReduceQueue.issue``: the copy-in (the group's gradients and the input, both live), then the
        reduce-scatter is issued."""
        g = self.plan.group(name)
        op = self.ops.take(REDUCE_SCATTER, name)
        if not op.collectives:
            return None
        self.events.append(("reduce-scatter issued", name))
        scatters = [c for c in op.collectives if c.kind == REDUCE_SCATTER]
        reduces = tuple(c for c in op.collectives if c.kind == ALL_REDUCE)
        if not scatters:  # (a shard axis of one rank: the input is the output, all-reduced over the replicas)
            rs = _Reduce(self, name, 0, sum(c.nbytes for c in reduces), self.t, reduces)
            self.reducing.append(rs)
            self.at(f"reduce-scatter {label(name)} (copy-in)")
            return rs
        rs = _Reduce(self, name, sum(c.nbytes for c in scatters), 0, 0.0, reduces)
        self.reducing.append(rs)
        self.at(f"reduce-scatter {label(name)} (copy-in)")  # (the output is allocated after the copy-in)
        rs.out = sum(c.numel * max(self.plan.specs[p].dtype.itemsize for p in g.params) for c in scatters)
        rs.end = self.issue(scatters)
        return rs

    # the traced marks
    def use(self, name: str, backward: bool) -> None:
        """The group's use in forward, or its pre-backward: ``GroupRun.gather_and_prefetch``."""
        if self.hw and self.hw.group_overhead_s and name != ROOT:
            self.run(self.hw.group_overhead_s, f"runtime {label(name)}")
        self.using = name
        self.runtime.runs[name].gather_and_prefetch(backward=backward)

    def freeing(self, name: str, fn: Callable[[], None], what: str) -> None:
        """Run ``fn`` (the runtime's free rule of the moment); a point if it freed the group."""
        was = self.gb[name].status
        fn()
        if was is not Status.SHARDED and self.gb[name].status is Status.SHARDED and frees_listed(self.gb[name].group):
            self.at(what)

    def mark(self, i: int) -> None:
        m, plan, rt = self.prof.marks[i], self.plan, self.runtime
        self.act, self.grads = self.prof.input_bytes + m.activations, m.grads
        name = m.group
        if m.kind == FWD_START:
            if name in self.prof.frozen and name not in self.used:
                rt.used(name, watched=name in self.prof.watched, unwatched=name in self.prof.unwatched)
            self.used.add(name)
            self.use(name, backward=False)
        elif m.kind == FWD_END:  # (GroupRun.post_forward)
            rt.prefetcher.closed(name)
            k = plan.post_forward_world(plan.group(name))
            self.freeing(name, rt.runs[name].reshard_after_forward,
                         f"free {label(name)}" + (f" (keep a {k}-rank shard)" if k is not None else ""))
        elif m.kind == BWD_START:
            rt.backward_started = True
            self.use(name, backward=True)
        elif m.kind == BWD_END:
            if reduce_scatter_at(self.plan, self.gb[name].group) == POST_BACKWARD:
                rt.post_backward(name)
        elif m.kind == INPUTS_DONE:
            self.freeing(name, lambda: rt.frozen.inputs_done(name),
                         f"free {label(name)} (its inputs' gradients are done)")
        st = self.prof.stretches[i]
        self.at(f"{m.kind} {label(name)}: highest point until the next event",
                {"activations": st.peak - m.activations - m.grads})
        if self.hw:
            self.run(self.hw.stretch_s(st), f"{m.kind.split()[0]} {label(name)}")

    def replay(self) -> None:
        marks = self.prof.marks
        rt = self.runtime
        for i, m in enumerate(marks):
            if m.kind == BWD_END and m.group == ROOT:
                continue  # (the end of backward: below)
            self.mark(i)
        rt.backward_started = True
        last = [name for name, gb in self.gb.items() if reduce_scatter_at(self.plan, gb.group) == END_OF_BACKWARD]
        if last:  # the reduce-scatters after every other group's (the root's), then end_of_backward
            done = [i for i, m in enumerate(marks) if m.kind == BWD_END and m.group == ROOT]
            if done:
                m = marks[done[0]]
                self.act, self.grads = self.prof.input_bytes + m.activations, m.grads
            for name in last:
                rt.post_backward(name)
            if done:
                st = self.prof.stretches[done[0]]
                self.at("after the root's reduce-scatter", {"activations": st.peak - m.activations - m.grads})
        rt.reduce_queue.finish()  # (Step.end_of_backward)
        for run in rt.runs.values():
            run.free_after_backward()
        self.act, self.grads = self.prof.input_bytes, 0
        self.at("end of backward")
        if self.update is not None:
            self.at("optimizer update", {"comm_buffers": 0, "activations": self.update.peak_extra})
            if self.hw:
                self.run(self.hw.stretch_s(self.update.cost), "optimizer update")
        left = [op.line() for op in self.ops.left]
        if left:
            raise RuntimeError(f"funcshard.cost: the replay did not issue {left} of the plan's schedule: the cost "
                               f"model and the schedule disagree (a bug; please report it with the plan printed)")


# ---- estimate and sweep ----------------------------------------------------------------------------------


def _device(plan: Plan) -> torch.device:
    """Where the step is traced: the mesh's device type when this process has it (the target's kernels); else the
    CPU (planning for CUDA on a CPU-only machine: fake tensors of a device torch was built without abort the
    process), which the result says (``Cost.traced_on``)."""
    kind = plan.mesh.device_type
    backend = getattr(torch, kind, None)
    if kind == "cpu" or not (callable(getattr(backend, "is_available", None)) and backend.is_available()):
        return torch.device("cpu")
    return torch.device(kind)


def _check_order(plan: Plan, prof: StepProfile) -> None:
    """The replay follows the plan's group order (the schedule's); a forward that runs the groups in another order
    makes the runtime prefetch differently (its forward prefetch follows the plan, its backward prefetch the order
    that ran): refused, with the plan that matches. So are a trained group whose gather no gradient reaches (the
    runtime reduce-scatters nothing for it) and a traced backward that reaches other groups than the schedule's
    (``_schedule.backward_reaches``: what the plan cannot know of where its parameters are used), named with the
    parameter the schedule starts the gradient at (:func:`_source_and_fix`). (A group's forward run twice in the step
    the trace refuses: ``profile_step``; so ``ran`` holds each group once.)"""
    ran = tuple(dict.fromkeys(m.group for m in prof.marks if m.kind == FWD_START and m.group != ROOT))
    if plan.order_differs(ran):
        raise ShardingError(
            f"funcshard.cost.estimate: the groups' forwards run in the order {ran}, not in the plan's order "
            f"{tuple(g.name for g in plan.groups[1:])}; the runtime would prefetch the wrong groups (some twice), "
            f"which the cost model does not replay. Estimate (and train) plan.with_order({ran!r}): then the "
            f"prefetches follow the order the module runs in")
    skipped = [g.name for g in plan.groups[1:] if g.params and g.name not in ran]
    if skipped:
        raise ShardingError(
            f"funcshard.cost.estimate: the forward never runs group(s) {skipped} of the plan, which the cost model "
            f"(as the plan's schedule) counts on; call their modules, or plan without them as groups (their "
            f"parameters then go to the root group)")
    unused = [g.name for g in plan.groups if g.name in prof.trainable and g.name not in prof.post_backward]
    if unused:
        raise ShardingError(
            f"funcshard.cost.estimate: group(s) {[label(n) for n in unused]} have parameters that take a gradient, "
            f"but no gradient reaches them in the traced step (the forward does not use them, or not on the loss's "
            f"path): the runtime then runs no post-backward for the group and issues no reduce-scatter, which the "
            f"plan's schedule (plan.collective_order()) lists and the cost model does not replay; freeze those "
            f"parameters (requires_grad_(False)) or use them, to estimate")
    reached = [m.group for m in prof.marks if m.kind == BWD_START and m.group != ROOT]
    planned = backward_reaches(plan)
    more = [n for n in ran if n in reached and n not in planned]
    fewer = [n for n in ran if n in planned and n not in reached]
    if more or fewer:
        raise ShardingError(
            f"funcshard.cost.estimate: in the traced step the gradient reaches " + " and ".join(
                [f"group(s) {more}, which the plan's schedule takes no gradient to reach"] * bool(more)
                + [f"not group(s) {fewer}, which the plan's schedule takes it to reach"] * bool(fewer))
            + f". The schedule (plan.collective_order(), _schedule.backward_reaches) has the gradient start at "
            f"{_source_and_fix(plan)}; the runtime then issues other backward collectives than the printed ones, "
            f"which the cost model does not replay")


def _source_and_fix(plan: Plan) -> str:
    """Where the schedule starts the gradient (``_schedule.gradient_source``), what it assumed of that parameter, and
    the way out of ``_check_order``'s refusal for it."""
    _, param, owner = gradient_source(plan)
    flow = ("; or the groups do not each feed the next (a skip connection, a detach, parallel branches), which the "
            "schedule assumes")
    if param is None:
        return "no parameter (none takes a gradient)" + flow
    if owner is None:
        return (f"{param!r}, taken to be used first in its group's pass (the plan's group order is not the module "
                f"tree's, so it cannot tell where). Register the modules in the order the forward uses them" + flow)
    if owner == "":
        return (f"{param!r}, the root module's own parameter, taken to be used before every group (the root module "
                f"encloses them); if the forward uses it after a group, move it into a submodule registered where "
                f"the forward uses it (after that group's modules)" + flow)
    group = next((g.name for g in plan.groups[1:] if owner in g.modules), None)
    if group is not None:
        return (f"{param!r}, a parameter of group {group!r}'s own module, taken to be used before the groups nested "
                f"in it; if the forward uses it after them, move it into a submodule of {owner!r} registered after "
                f"theirs, or plan {group!r} without groups nested in it" + flow)
    return (f"{param!r}, taken to be used where its module {owner!r} is registered among the groups' modules; if "
            f"the forward uses it elsewhere, register the modules in the order the forward uses them, or give "
            f"{owner!r} a group of its own (funcshard.plan(groups=...))" + flow)


def _check_module(plan: Plan) -> None:
    """A module under ``fully_shard`` runs its units' own hooks in forward (the units' runtime), which the trace
    does not replace (its trace saw no gradient reach the root group): refused, with the plan to estimate instead."""
    if not isinstance(plan.module, torch.nn.Module):
        return
    units = [path for path, m in plan.module.named_modules() if m.__dict__.get(UNIT) is not None]
    if units:
        raise ShardingError(
            f"funcshard.cost.estimate: the plan's module is under funcshard.fully_shard (module(s) "
            f"{[path or '<root>' for path in units]}): its forward runs fully_shard's own hooks (the units' runtime), "
            f"which the cost model's trace does not replace, so the traced step is not the plan's; "
            f"estimate a plan of the module before fully_shard (funcshard.plan(model, mesh, groups=...) on a copy not "
            f"wrapped, e.g. built on the meta device, with the units' modules as groups)")


def _check_inputs(plan: Plan, args: tuple, kwargs: dict) -> None:
    """The schedule takes the step's inputs to take no gradient (``_schedule.backward_reaches``, the trace as well);
    where one requires grad and that changes the step (plain autograd reaches a group the schedule leaves out of
    backward, or the inputs of a frozen group the schedule frees at the end of backward: ``_schedule.frozen_held``):
    refused."""
    needing = [i for i, t in enumerate(t for t in torch_tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
               if t.requires_grad]
    if not needing:
        return
    left_out = [g.name for g in plan.groups[1:] if g.name not in backward_reaches(plan)]
    held = [g.name for g in plan.groups[1:] if g.name in frozen_held(plan) and g.name not in left_out]
    if left_out or held:
        raise ShardingError(
            f"funcshard.cost.estimate: input(s) {needing} (of the inputs' tensors, in order) require grad, and the "
            f"plan's schedule takes no gradient to reach " + " nor ".join(
                [f"group(s) {left_out} (no parameter that takes one is used before them)"] * bool(left_out)
                + [f"the inputs of group(s) {held} (frozen parameters: freed at the end of backward)"] * bool(held))
            + "; _schedule.backward_reaches takes the step's inputs to take none. Under plain autograd the input's "
            f"gradient reaches them: the runtime " + " and ".join(
                ["issues the backward all-gathers of the groups left out"] * bool(left_out)
                + ["frees a frozen group once its inputs' gradients are done"] * bool(held))
            + ", which the schedule and the cost model leave out; under torch.func "
            f"transforms (funcshard.value_and_grad) only the state is differentiated and the schedule holds. Pass the "
            f"inputs detached (x.detach()) to estimate the step without input gradients")


def _shard_shapes(plan: Plan) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (s.local_shape if s.flat is None else (s.local_numel,), s.dtype) for k, s in plan.specs.items()
            if takes_grad(s.requires_grad, s.dtype)}


def estimate(plan: Plan, *args: Any, loss: Callable[[Any], torch.Tensor] | None = None, optimizer: Any = None,
             donate: bool = True, hardware: Hardware | None = None, profiles: dict | None = None,
             **kwargs: Any) -> Cost:
    """Predict one training step of ``plan`` per rank: ``loss(plan.module(*args, **kwargs))``, its backward, and
    ``optimizer``'s update (a ``funcshard.optim`` GradientTransformation; ``donate``: as ``update(...,
    donate=True)`` and ``apply_updates(..., donate=True)``; None: no optimizer). ``args``/``kwargs``: one rank's
    inputs, as real or meta tensors (only shapes and dtypes are read). ``loss``: default ``out.float().sum()``
    for a tensor output. ``hardware``: the figures of the time estimate (None: memory and collectives only).
    ``profiles``: a dict to keep the traced steps in, for calls on plans of the same module with the same inputs
    and loss: a plan of the same grouping, precision and frozen parameters reuses its trace (as :func:`sweep` does;
    prefetch, resharding and layout are the replay's alone). The step's backward is the schedule's: it reaches the
    groups ``_schedule.backward_reaches`` says (inputs that take no gradient: an input's own gradient is not costed);
    where the traced step differs, or an input requires grad and the schedule leaves a group out of backward or frees
    a frozen group at the end of backward, or a group's forward runs twice in the step, or a group runs under
    reentrant activation checkpointing, or the module is under ``fully_shard``, it raises a ``ShardingError`` naming
    the case.

    Args:
        plan: the plan to cost (a mesh of any world size: a real one, or :func:`fake_mesh`'s).
        *args: one rank's positional inputs to the module, real or meta tensors (only shapes and dtypes are read).
        loss: ``out -> scalar tensor``; default ``out.float().sum()`` for a tensor output.
        optimizer: a ``funcshard.optim`` GradientTransformation whose update is costed; None: no optimizer.
        donate: cost the update as ``update(..., donate=True)`` and ``apply_updates(..., donate=True)``.
        hardware: the time model's figures (:class:`Hardware`, :func:`calibrate`); None: memory and collectives only.
        profiles: a dict that keeps traced steps across calls on plans of the same module, inputs and loss.
        **kwargs: one rank's keyword inputs to the module.
    """
    if loss is None:
        def loss(out):
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"funcshard.cost.estimate: the module returns {type(out).__name__}, not a tensor; "
                                f"pass loss=lambda out: ... returning a scalar tensor")
            return out.float().sum()
    _check_module(plan)
    _check_inputs(plan, args, kwargs)
    cache = profiles if profiles is not None else {}
    key = ("step", tuple((g.modules, g.param_dtype, g.output_dtype, g.cast_forward_inputs) for g in plan.groups),
           tuple((k, s.shape, s.dtype, s.requires_grad) for k, s in plan.specs.items()),
           tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t)
                 for t in torch_tree_leaves((args, kwargs))))
    prof = cache.get(key)
    if prof is None:
        prof = cache[key] = profile_step(plan, args, kwargs, loss, _device(plan))
    _check_order(plan, prof)
    update = None
    if optimizer is not None:
        shapes = _shard_shapes(plan)
        ukey = ("update", id(optimizer), donate, tuple(sorted((k, v[0], v[1]) for k, v in shapes.items())))
        update = cache.get(ukey)
        if update is None:
            update = cache[ukey] = profile_update(optimizer, shapes, _device(plan), donate)
    r = _Replay(plan, prof, update, hardware)
    r.replay()
    peak = max(r.points, key=lambda p: p.total)
    timing = {}
    if hardware is not None:
        timing = dict(step_s=r.t, compute_s=r.compute, comm_s=r.comm, exposed_s=r.exposed)
    copies = r.step.copies + tuple(HostCopy(kind, name, "optimizer state", n) for name, n in
                                   (update.offloaded if update is not None else ()) for kind in (HOST_TO_DEVICE,
                                                                                                  DEVICE_TO_HOST))
    return Cost(plan, peak.total, peak, tuple(r.points), tuple(r.collectives), intervals=tuple(r.intervals),
                traced_on=prof.device, copies=copies,
                owners=owner_costs(plan, optimizer, hardware=hardware) if optimizer is not None else (), **timing)


def sweep(module: torch.nn.Module, mesh: DeviceMesh, *args: Any, budget: int | None = None,
          groups: Iterable[Any] = (None,), prefetch: Iterable[int] = (0, 1, 2),
          reshard_after_forward: Iterable[bool | None] = (None, False), mp_policy: Iterable[Any] = (None,),
          layout: Iterable[str] = ("per_param",), loss: Callable | None = None, optimizer: Any = None,
          donate: bool = True, hardware: Hardware | None = None, profiles: dict | None = None,
          **kwargs: Any) -> list[Cost]:
    """Every combination of the given plan choices (``funcshard.plan``'s arguments of those names), estimated;
    those whose peak fits ``budget`` bytes (None: all), fastest first (least memory first without ``hardware``).
    One traced step per grouping and precision serves all the prefetch and reshard choices (``profiles``: a dict
    keeping them for another sweep or estimate of the same module, inputs and loss, see :func:`estimate`).

    Args:
        module: the model (on the meta device is enough).
        mesh: the mesh to plan over (e.g. :func:`fake_mesh`).
        *args: one rank's positional inputs, as for :func:`estimate`.
        budget: the peak bytes per rank a plan must fit; None: keep every plan.
        groups: the ``groups`` choices of ``funcshard.plan`` to try.
        prefetch: the prefetch depths to try.
        reshard_after_forward: the ``reshard_after_forward`` choices to try.
        mp_policy: the mixed-precision policies to try (None: none).
        layout: the layouts to try.
        loss: as for :func:`estimate`.
        optimizer: as for :func:`estimate`.
        donate: as for :func:`estimate`.
        hardware: as for :func:`estimate`; with it the result is ordered by step time, else by peak memory.
        profiles: as for :func:`estimate`.
        **kwargs: one rank's keyword inputs to the module.
    """
    from funcshard._plan import plan as make_plan

    profiles = {} if profiles is None else profiles
    out = []
    for gr in groups:
        for mp in mp_policy:
            for lay in layout:
                for depth in prefetch:
                    for rsf in reshard_after_forward:
                        p = make_plan(module, mesh, groups=gr, prefetch=depth, reshard_after_forward=rsf,
                                      mp_policy=mp, layout=lay)
                        c = estimate(p, *args, loss=loss, optimizer=optimizer, donate=donate, hardware=hardware,
                                     profiles=profiles, **kwargs)
                        if budget is None or c.peak_bytes <= budget:
                            out.append(c)
    out.sort(key=lambda c: (c.step_s if c.step_s is not None else 0.0, c.peak_bytes))
    return out


# ---- whole-matrix optimizers: the owners' exchange and compute (optim.muon, optim.owner_compute) ------------------


@dataclasses.dataclass(frozen=True)
class OwnerCost:
    """What a whole-matrix optimizer's owners cost per step (``optim.muon``, ``optim.owner_compute``, each labelled
    one of an ``optim.multi_transform``), every rank's figure (the rank is the index).

    Attributes:
        label: the transformation's label in a ``multi_transform`` ("" alone).
        owners: the owner table (``optim.Owners``: printable).
        to_owners_sent: bytes each rank sends in the all-to-all to the owners (its pieces of the matrices other
            ranks own; padding does not travel, nor a rank's piece of its own matrix).
        to_owners_received: bytes each rank receives in it (the other ranks' pieces of the matrices it owns).
        back_sent: bytes each rank sends in the all-to-all back (the other ranks' pieces of its results).
        back_received: bytes each rank receives in it (its pieces of the results of the matrices others own).
        extra_bytes: each rank's memory beyond the sharded state while it updates, as the pipelined exchange holds
            it (``Exchange.map``: rounds of one matrix per owner): the result shards (and for Muon the bfloat16 copies
            of the update shards it sends), plus at the worst round its
            whole matrix in and out, for Newton-Schulz its Gram-matrix pair (``2 m^2``), and the packed send and
            receive buffers of the three all-to-alls in flight then (the next round's to the owners, this and the
            last round's back).
        flops: each rank's FLOPs on its owned matrices (the table's cost).
        exchange_s: the all-to-alls' time (``latency_s`` for each, two per round, plus the busiest rank's larger of
            sent and received bytes each way over ``link_bytes_per_s``), not overlapped with compute in this figure;
            None without hardware figures.
        compute_s: each rank's time on its owned matrices (``flops / flops_per_s``); the step waits for the
            busiest. None without hardware figures.
    """

    label: str
    owners: Any
    to_owners_sent: tuple[int, ...]
    to_owners_received: tuple[int, ...]
    back_sent: tuple[int, ...]
    back_received: tuple[int, ...]
    extra_bytes: tuple[int, ...]
    flops: tuple[int, ...]
    exchange_s: float | None = None
    compute_s: tuple[float, ...] | None = None

    def __str__(self) -> str:
        mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
        o, w = self.owners, self.owners.world
        busiest = max(range(w), key=lambda r: self.flops[r])
        head = f"  owners{f' ({self.label!r})' if self.label else ''}: {len(o.entries)} whole matrices over {w} ranks"
        lines = [head + f", busiest / mean FLOPs {o.imbalance():.2f} (rank {busiest})",
                 f"    all-to-all to the owners: up to {mib(max(self.to_owners_sent))} sent, "
                 f"{mib(max(self.to_owners_received))} received per rank; back: up to {mib(max(self.back_sent))} "
                 f"sent, {mib(max(self.back_received))} received",
                 f"    owners' extra memory: up to {mib(max(self.extra_bytes))} (rank "
                 f"{max(range(w), key=lambda r: self.extra_bytes[r])})"]
        if self.exchange_s is not None:
            mean = sum(self.compute_s) / w
            lines.append(f"    time: exchange {self.exchange_s * 1e3:.2f} ms, owners' compute busiest "
                         f"{max(self.compute_s) * 1e3:.2f} ms vs mean {mean * 1e3:.2f} ms")
        return "\n".join(lines)


def owner_costs(plan: Plan, optimizer: Any, *, hardware: Hardware | None = None,
                keys: Sequence[str] | None = None) -> tuple[OwnerCost, ...]:
    """The owner exchange and compute of ``optimizer`` per step on ``plan``: one :class:`OwnerCost` per
    whole-matrix transformation (``optim.muon`` / ``optim.owner_compute``, those inside an ``optim.multi_transform``,
    or one inside a ``chain``; none for other optimizers). :func:`estimate` includes these (``Cost.owners``); the
    bytes and memory are the plan's printout's (``Plan.with_optimizer``: the same ``OwnerStep``).

    Args:
        plan: the :class:`funcshard.Plan` the optimizer was built for (its specs give the pieces' sizes).
        optimizer: the transformation (``optim.muon``, ``optim.owner_compute``, an ``optim.multi_transform``, or a
            ``chain`` holding one); any other gives ``()``.
        hardware: figures for ``exchange_s`` and ``compute_s`` (None: those stay None).
        keys: the parameters given to ``optimizer`` (default: the plan's trained floating-point ones).

    Returns:
        One :class:`OwnerCost` per whole-matrix transformation that owns at least one matrix.
    """
    from funcshard._owner import owner_steps

    return tuple(_owner_cost(s, hardware) for s in owner_steps(plan, optimizer, keys, where="cost.owner_costs"))


def _owner_cost(step: Any, hw: Hardware | None) -> OwnerCost:
    w = step.owners.world
    out_s, out_r, back_s, back_r = step.to_owners_sent, step.to_owners_received, step.back_sent, step.back_received
    flops = step.flops
    exchange = compute = None
    if hw is not None:  # (each all-to-all's latency, and the busiest rank's larger of sent and received each way)
        exchange = 0.0 if w == 1 else (len(step.collectives) * hw.latency_s + max(max(out_s[r], out_r[r])
                                       for r in range(w)) / hw.link_bytes_per_s + max(max(back_s[r], back_r[r])
                                       for r in range(w)) / hw.link_bytes_per_s)
        compute = tuple(f / hw.flops_per_s for f in flops)
    return OwnerCost(step.label, step.owners, out_s, out_r, back_s, back_r, step.extra_bytes, flops, exchange, compute)
