"""Every private torch API funcshard uses, in one place (``tests/test_compat.py`` keeps it so).

funcshard supports torch 2.11 to 2.13. A private name may move or go in any release: here each is looked up once,
at import, and bound as a module attribute (the runtime's hot path calls them directly, with no wrapper of ours
in between). A name every supported torch has is looked up with :func:`require`, which fails at import with an
ImportError naming the API and the torch version; a name that some versions lack has its fallback next to it.

Verified against torch 2.13 (installed) and the sources and ``torch/_C`` stubs of torch 2.11: every name below
is present in both.
"""

from __future__ import annotations

import collections
import importlib
import operator

import torch
import torch.distributed as dist
import torch.utils._pytree as _torch_pytree
from torch.distributed.tensor import DTensor

SUPPORTED = "2.11 to 2.13"


def require(path: str):
    """The object at the dotted ``path`` (``"torch._C._current_graph_task_id"``), or an ImportError that names
    it and this torch's version."""
    first, *parts = path.split(".")
    if first != "torch":
        raise ValueError(f"require: {path!r} is not a torch name")
    obj, seen = torch, first
    for part in parts:
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(
                f"funcshard needs {path} (a private torch API), and torch {torch.__version__} has no {part!r} in "
                f"{seen}; funcshard supports torch {SUPPORTED}") from None
        seen = f"{seen}.{part}"
    return obj


# ---- functorch (torch.func transforms and their wrapped tensors) -----------------------------------------
get_unwrapped = require("torch._C._functorch.get_unwrapped")  # the tensor under one functorch wrapper
is_functorch_wrapped_tensor = require("torch._C._functorch.is_functorch_wrapped_tensor")
is_batchedtensor = require("torch._C._functorch.is_batchedtensor")  # a vmap-batched tensor
unwrap_if_dead = require("torch._C._functorch.unwrap_if_dead")  # unwrap a tensor left by an exited transform
get_interpreter_stack = require("torch._C._functorch.get_interpreter_stack")  # the active transforms (or None)
maybe_current_level = require("torch._C._functorch.maybe_current_level")  # the innermost level, or None
get_dynamic_layer_stack_depth = require("torch._C._functorch.get_dynamic_layer_stack_depth")  # the active transforms
# (how many: dynamo reads it while tracing, a constant with a guard)
TransformType = require("torch._C._functorch.TransformType")  # Grad, Jvp, Vmap, ... (an interpreter's key())
# whether an autograd.Function may be applied by the C++ apply while torch.func transforms are active (on plain
# tensors, functorch disabled: what torch.func's own custom_function_call does)
single_level_function_allowed = require("torch._C._functorch.get_single_level_autograd_function_allowed")
allow_single_level_function = require("torch._C._functorch.set_single_level_autograd_function_allowed")
GradInterpreter = require("torch._C._functorch.CGradInterpreterPtr")  # a Grad level's interpreter:
# ``GradInterpreter(stack[i]).prevGradMode()``, the grad mode of the level below it (plain autograd's for stack[0])
DisableFuncTorch = require("torch._C._DisableFuncTorch")  # context manager: functorch off inside
DisableTorchFunctionSubclass = require("torch._C.DisableTorchFunctionSubclass")  # context manager
dispatch_keys = require("torch._C._dispatch_keys")  # a tensor's DispatchKeySet

# ---- the autograd engine and Functions ----------------------------------------------------------------
current_graph_task_id = require("torch._C._current_graph_task_id")  # the running backward's id, -1 outside
will_engine_execute_node = require("torch._C._will_engine_execute_node")  # (inside backward) node runs?
queue_callback = require("torch.autograd.Variable._execution_engine").queue_callback  # at the end of backward
unsafe_preserve_version_counter = require("torch.autograd._unsafe_preserve_version_counter")  # context manager
set_version_counters = require("torch._C._autograd._unsafe_set_version_counter")  # (tensors, versions)


def version_counters(tensors) -> list[int]:
    """Autograd's version counters of ``tensors`` (``Tensor._version``: moved on by every in-place change)."""
    return [t._version for t in tensors]


make_subclass = require("torch.Tensor._make_subclass")  # a tensor subclass instance sharing a tensor's data
# The C++ ``Function.apply`` (without torch.autograd.Function.apply's per-call Python); None: use fn.apply.
function_base_apply = getattr(getattr(torch._C, "_FunctionBase", None), "__dict__", {}).get("apply")
# The innermost saved-tensor hooks in effect (arg: ignore_is_tracing); None where torch lacks it.
top_saved_tensors_default_hooks = getattr(require("torch._C._autograd"), "_top_saved_tensors_default_hooks", None)


def storage_key(t: torch.Tensor) -> int:
    """An id of ``t``'s storage (its StorageImpl), the same for every view of it and across ``resize_``."""
    return t.untyped_storage()._cdata


def checkpoint_saved_hooks(hooks: tuple | None) -> bool:
    """Whether the saved-tensor hooks ``hooks`` (``top_saved_tensors_default_hooks``' pair) are non-reentrant
    ``torch.utils.checkpoint``'s (its forward's or its recomputation's: closures defined in that module)."""
    return hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


# whether saved-tensor hooks may be pushed (False inside torch.autograd.graph.disable_saved_tensors_hooks: aot_autograd's
# runtime wrappers and dynamo's distributed backend use it too)
saved_tensors_hooks_enabled = require("torch._C._autograd._saved_tensors_hooks_is_enabled")


# ---- kernels --------------------------------------------------------------------------------------------
chunk_cat = require("torch._chunk_cat")  # the padded rank-major concatenation of chunks, in one op
unflatten_dense_tensors = require("torch._C._nn.unflatten_dense_tensors")  # views of a flat tensor
foreach_add = require("torch._foreach_add")
foreach_add_ = require("torch._foreach_add_")
foreach_addcdiv = require("torch._foreach_addcdiv")
foreach_addcdiv_ = require("torch._foreach_addcdiv_")
foreach_addcmul_ = require("torch._foreach_addcmul_")
foreach_copy_ = require("torch._foreach_copy_")
foreach_div = require("torch._foreach_div")
foreach_div_ = require("torch._foreach_div_")
foreach_lerp = require("torch._foreach_lerp")
foreach_lerp_ = require("torch._foreach_lerp_")
foreach_mul = require("torch._foreach_mul")
foreach_mul_ = require("torch._foreach_mul_")
foreach_norm = require("torch._foreach_norm")
foreach_sqrt = require("torch._foreach_sqrt")

# ---- torch's pytree (what modules' inputs and outputs are flattened with: it knows the node types libraries
# register with torch, e.g. transformers' ModelOutput; funcshard's own pytrees use optree, see _tree.py) ---------
apply_to_tensors = require("torch.distributed.utils._apply_to_tensors")  # FSDP2's walk for input/output casts
torch_tree_leaves = _torch_pytree.tree_leaves
torch_tree_map_only = _torch_pytree.tree_map_only

# ---- nn.Module, Parameter and DTensor internals -----------------------------------------------------------
# A module's own parameter slots (name -> Parameter or None) and buffer slots, as the dicts to read and write:
# ``param_slots(m)[name] = t`` registers ``t`` without setattr's checks (the runtime swaps plain tensors in).
param_slots = operator.attrgetter("_parameters")
buffer_slots = operator.attrgetter("_buffers")
# A tensor's post-accumulate-grad hooks (dict of hooks, or None): what autograd runs after accumulating .grad.
post_accumulate_grad_hooks = operator.attrgetter("_post_accumulate_grad_hooks")
dtensor_local = operator.attrgetter("_local_tensor")  # a DTensor's local tensor (to_local without autograd)
dtensor_spec = operator.attrgetter("_spec")  # a DTensor's DTensorSpec (mesh, placements, shape, stride)
root_mesh = operator.methodcaller("_get_root_mesh")  # the mesh a DeviceMesh was sliced from (or itself)
# FSDP over tensor parallel: the (dp, tp) mesh a sharded TP parameter lives on (meshes sliced from one root), and the
# placement of a dim the data-parallel axis shards inside the model's own shards of it (FSDP2's, for DCP's offsets)
concatenate_meshes = require("torch.distributed.device_mesh.DeviceMesh._concatenate")
StridedShard = require("torch.distributed.tensor.placement_types._StridedShard")
# ``new_dtensor(DTensor, local, spec, requires_grad=...)``: DTensor's constructor is torch.Tensor._dtensor__new__
# (C++) plus an ``__init__`` that does nothing but pass through two decorators (dynamo-disable, export marking):
# ~1.5 us of the ~2.3 per gradient. Call it directly where it is; otherwise the constructor.
new_dtensor = DTensor.__new__ if getattr(torch.Tensor, "_dtensor__new__", None) is DTensor.__new__ else (
    lambda cls, *args, **kwargs: cls(*args, **kwargs))
_DTensorSpec = require("torch.distributed.tensor._dtensor_spec.DTensorSpec")
_TensorMeta = require("torch.distributed.tensor._dtensor_spec.TensorMeta")


def dtensor_over(local: torch.Tensor, mesh, placements, shape: torch.Size, stride: tuple) -> DTensor:
    """A DTensor over ``local`` as it is: no copy and no move. ``DTensor.from_local`` moves a local tensor to the
    mesh's device type, so a CPU-offloaded shard under a CUDA mesh would become a CUDA copy the optimizer then updates
    instead of the shard (FSDP2 builds its offloaded parameters the same way: the spec, then the constructor)."""
    spec = _DTensorSpec(mesh, tuple(placements), tensor_meta=_TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return new_dtensor(DTensor, local, spec, requires_grad=False)

# ---- torch's composable-API registry (torch.distributed._composable.contract) ----------------------------------
# Each of torch's composable APIs (replicate, fully_shard, checkpoint) records its name in a registry on the module it
# was applied to, and the others read it to stay off each other's modules: replicate refuses a module marked
# "fully_shard" and leaves the parameters of such submodules to it; FSDP2 manages no module marked "replicate".
# funcshard's fully_shard reads and writes the same registry (funcshard/fsdp/_api.py).
# (the package torch.distributed._composable binds the name ``contract`` to the decorator, which hides the
# submodule from ``require``'s attribute walk: the submodule is imported by name)
_contract = importlib.import_module("torch.distributed._composable.contract")
try:
    composable_registry = _contract._get_registry  # module -> {name: item}, or None
    _COMPOSABLE_KEY, _ComposableItem = _contract.REGISTRY_KEY, _contract.RegistryItem
except AttributeError as e:
    raise ImportError(f"funcshard needs torch.distributed._composable.contract's registry (_get_registry, REGISTRY_KEY, "
                      f"RegistryItem; private torch APIs), and torch {torch.__version__} lacks {e.name!r}; funcshard "
                      f"supports torch {SUPPORTED}") from None


def composable_apis(module) -> tuple[str, ...]:
    """The names of torch's composable APIs applied to ``module`` (``("replicate",)``...), in the order applied."""
    return tuple(composable_registry(module) or ())


def mark_composable(module, api: str) -> None:
    """Record ``api`` (``"fully_shard"``) as applied to ``module``, as torch's ``contract`` decorator does."""
    module.__dict__.setdefault(_COMPOSABLE_KEY, collections.OrderedDict()).setdefault(api, _ComposableItem())


def is_compiled_backward(node) -> bool:
    """Whether the autograd ``node`` is a torch.compile'd graph's backward (AOTAutograd's ``CompiledFunction``'s node,
    by its class name, as torch 2.13 names it), whose inside a walk of the graph cannot see."""
    return type(node).__name__ == "CompiledFunctionBackward"


# ---- dynamo's marks, set without importing torch._dynamo (``import funcshard`` must not: issue 36's start-up) ------
def never_inlined(fn, reason: str):
    """Mark ``fn`` as ``torch.compiler.disable`` marks it, without importing torch._dynamo: dynamo, tracing a call
    to it, breaks the graph there naming ``reason`` (the attributes torch 2.11 to 2.13 read) instead of inlining it."""
    fn._torchdynamo_disable = True
    fn._torchdynamo_disable_msg = reason
    return fn


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing torch._dynamo: the mark dynamo reads (torch
    2.11 to 2.13 set exactly this attribute; tests/test_compile.py's traced-mode tests would see a difference)."""
    fn._dynamo_marked_constant = True
    return fn


# ---- torch.distributed: renamed collectives (public names; chosen here with the other version differences) ---
# torch 2.13 renamed the tensor collectives (all_gather_into_tensor -> all_gather_single, reduce_scatter_tensor
# -> reduce_scatter_single); older releases have only the old names.
all_gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
reduce_scatter_name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"

# ---- the cost model's one-process trace (funcshard/_cost_trace.py): fake tensors and a dispatch mode -------------
FakeTensorMode = require("torch._subclasses.fake_tensor.FakeTensorMode")  # tensors with shapes, devices, no data
FakeTensor = require("torch._subclasses.fake_tensor.FakeTensor")  # (the class of its tensors)
TorchDispatchMode = require("torch.utils._python_dispatch.TorchDispatchMode")  # sees every op below autograd
# torch.utils.flop_counter's per-op FLOP formulas (FlopCounterMode's table; the module's __all__ has only the mode):
# ``flop_registry``, looked up when first read (module ``__getattr__`` below): torch.utils.flop_counter imports triton
# where it is installed, which ``import funcshard`` should not pay (issue 36); the cost model reads it.
_LAZY = {"flop_registry": ("torch.utils.flop_counter", "torch.utils.flop_counter.flop_registry")}


def op_is_mutable(func) -> bool:
    """Whether an aten op (an OpOverload, as a dispatch mode sees it) writes to one of its arguments (its schema)."""
    return func._schema.is_mutable


process_group_store = require("torch.distributed.distributed_c10d._get_process_group_store")  # a group's store
_c10d_helper = require("torch.distributed.distributed_c10d._new_process_group_helper")


def new_named_group(ranks: list[int], name: str, backend: str | None = None, timeout=None):
    """``dist.new_group(ranks, backend, timeout, use_local_synchronization=True)`` (only the group's ranks call it)
    named ``name`` (the same on every rank of it). torch names such a group by a hash of its ranks and of how many
    process groups this process holds, which differs between ranks whose processes made other groups (a group over a
    part of the ranks, a respawned rank): gloo then meets under different store prefixes and hangs (torch 2.11-2.13;
    torch's fix, pytorch/pytorch#189073, is not in them). As torch's ``new_group`` does without a name of its own:
    the group made with the default group's store under ``name`` and its ranks mapped. A default group that makes its
    groups itself (a Python process group with a ``new_group`` method, which torch 2.13's ``new_group`` hands the
    call to) makes this one too, as torch would, under torch's name."""
    import torch.distributed.distributed_c10d as c10d

    default = c10d._get_default_group()
    if callable(getattr(default, "new_group", None)):
        return dist.new_group(ranks, timeout=timeout, backend=backend, use_local_synchronization=True)
    ranks, (default_backend, store) = sorted(ranks), c10d._world.pg_map[default]
    backend = c10d.Backend(backend or default_backend)
    pg, _ = _c10d_helper(len(ranks), ranks.index(default.rank()), ranks, backend, store, name,
                         timeout=timeout if timeout is not None else c10d._get_default_timeout(backend),
                         device_id=default.bound_device_id)
    c10d._world.pg_group_ranks[pg] = {g: r for r, g in enumerate(ranks)}
    return pg


def fake_store():
    """The store of torch's fake process group (``backend="fake"``: collectives do nothing), for ``cost.fake_mesh``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


# ---- traceable functional collectives (torch.distributed._functional_collectives), for the fully traced mode -----
# torch 2.13 renamed all_gather_tensor_autograd -> all_gather_single_autograd (the old name warns outside compile);
# 2.11 has only the old name. Differentiable: the all-gather's backward is a reduce-scatter (sum), and dynamo and
# inductor put them in the graph as c10d_functional ops.
import torch.distributed._functional_collectives as _funcol  # noqa: E402

all_gather_autograd = getattr(_funcol, "all_gather_single_autograd", None) or _funcol.all_gather_tensor_autograd
# The functional collectives' ops themselves (group given by name; each result waited on with ``wait_tensor``): what
# ``_traced._Gather`` runs in forward (all_gather_into_tensor) and backward (reduce_scatter_tensor, all_reduce), the
# same schema in torch 2.11 and 2.13.
c10d_functional = require("torch.ops._c10d_functional")

# ---- torch.distributed.checkpoint's object protocol (``_Checkpointable``; DTensor implements it) ---------------
# DCP asks each state-dict value ``hasattr(obj, name)`` for these names, then calls them: funcshard sets them per
# object (funcshard/_checkpoint_dcp.py), never on a torch class. The last is what DCP does with any other object:
# pickle it whole (one write item of bytes).
DCP_WRITE_ITEMS, DCP_CHUNK_LIST, DCP_TENSOR_SHARD = (
    "__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__")


# ---- process-group allocation and FSDP2's comm classes (fully_shard's comm-tuning setters) -------------------------
def group_allocator(group, device: torch.device):
    """The backend of ``group`` for ``device`` (with its index: ``cuda:0``) when it allocates communication tensors
    itself (NCCL's, where its allocator is available: FSDP2's ``ProcessGroupAllocMixin`` asks the same), else None
    (gloo, the fake group)."""
    get = getattr(group, "_get_backend", None)
    if get is None:
        return None
    try:
        backend = get(device)
    except (RuntimeError, ValueError):  # no backend for that device
        return None
    supports = getattr(backend, "supports_tensor_alloc", None)
    if supports is None or not hasattr(backend, "allocate_tensor") or not supports(device):
        return None
    return backend


def is_symm_mem_reduce_scatter(comm) -> bool:
    """Whether ``comm`` is FSDP2's symmetric-memory reduce-scatter (torch 2.11 may lack the class: then False)."""
    if comm is None:
        return False
    mod = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_collectives")
    cls = getattr(mod, "SymmMemReduceScatter", None)
    return cls is not None and isinstance(comm, cls)


def dcp_bytes_write_items(fqn: str, obj) -> list:
    """DCP's write items for ``obj`` pickled whole (what it does for a value without the protocol)."""
    from torch.distributed.checkpoint.planner_helpers import _create_write_item_for_bytesio

    return [_create_write_item_for_bytesio(fqn, obj)]


def __getattr__(name: str):
    """The names of ``_LAZY``: their torch module imported on first read, then bound here like the others."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, path = _LAZY[name]
    importlib.import_module(module)
    value = globals()[name] = require(path)
    return value


__all__ = [
    "new_named_group",
    "all_gather_autograd", "c10d_functional",
    "apply_to_tensors",
    "SUPPORTED", "require",
    "get_unwrapped", "is_functorch_wrapped_tensor", "is_batchedtensor", "unwrap_if_dead", "get_interpreter_stack",
    "maybe_current_level", "get_dynamic_layer_stack_depth", "never_inlined", "TransformType", "GradInterpreter",
    "single_level_function_allowed", "allow_single_level_function",
    "DisableFuncTorch",
    "is_compiled_backward",
    "DisableTorchFunctionSubclass", "dispatch_keys",
    "current_graph_task_id", "will_engine_execute_node", "queue_callback", "unsafe_preserve_version_counter",
    "set_version_counters", "version_counters",
    "make_subclass", "function_base_apply", "top_saved_tensors_default_hooks", "storage_key",
    "checkpoint_saved_hooks", "saved_tensors_hooks_enabled",
    "chunk_cat", "unflatten_dense_tensors", "foreach_add", "foreach_add_", "foreach_addcdiv", "foreach_addcdiv_",
    "foreach_addcmul_", "foreach_copy_",
    "foreach_div", "foreach_div_", "foreach_lerp", "foreach_lerp_", "foreach_mul", "foreach_mul_", "foreach_norm",
    "foreach_sqrt",
    "torch_tree_leaves", "torch_tree_map_only",
    "param_slots", "buffer_slots", "post_accumulate_grad_hooks", "dtensor_local", "dtensor_spec", "root_mesh", "new_dtensor", "dtensor_over",
    "concatenate_meshes", "StridedShard",
    "all_gather_name", "reduce_scatter_name", "FakeTensorMode", "TorchDispatchMode", "flop_registry", "op_is_mutable",
    "FakeTensor",
    "fake_store", "process_group_store", "DCP_WRITE_ITEMS", "DCP_CHUNK_LIST", "DCP_TENSOR_SHARD",
    "dcp_bytes_write_items", "group_allocator", "is_symm_mem_reduce_scatter", "composable_registry", "composable_apis", "mark_composable", "assume_constant_result",
]
