"""torch's private names the package uses, each resolved once here with the torch releases it was checked
on and its public fallback (or what is refused without it); modules import them from here, and
``tests/test_torch_private.py`` fails on a private torch name used anywhere else.

``checked_on`` lists the releases on which the name was resolved and the tests that use it passed: a CI
leg on another release (2.4.0, a middle minor, 2.14.1) runs the same test, which fails on an entry that
neither resolves nor has a fallback. A name missing from the running torch resolves to None; its user
then takes the fallback its entry describes. Names in heavy or optional modules (dynamo, functorch's
config, FSDP2) are resolved on first use (:func:`resolve`), so that importing the package stays cheap.

:data:`ATTRIBUTES` records the private attributes of torch's objects the package reads where it extends
them (the scaler subclasses ``torch.amp.GradScaler`` and keeps its per-optimizer state as torch's
``ShardedGradScaler`` does), with the modules that read them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._foreach_utils  # noqa: F401  # resolved below: imported so that the attribute exists
import torch.utils._python_dispatch  # noqa: F401  # resolved below
import torch.utils._pytree  # noqa: F401  # resolved below

#: The releases the entries below were resolved on, with the tests that use them passing (the CI legs:
#: torch 2.4.0 and 2.14.1, CUDA builds run on the CPU; 2.13.0, the CPU build); an entry a release lacks
#: names the others only (``checked_on``), and its fallback applies there.
CHECKED = ("2.4.0", "2.13.0", "2.14.1")
#: The releases after 2.4 checked: where an entry first appeared after torch 2.4.0.
AFTER_2_4 = ("2.13.0", "2.14.1")


@dataclass(frozen=True)
class Private:
    """One private torch name: where it lives, the releases it was checked on, and the public fallback."""

    path: str
    fallback: str
    checked_on: tuple[str, ...] = CHECKED
    lazy: bool = False
    #: an op of the ``torch`` namespace, looked up at each call (see :func:`_op`)
    per_call: bool = False

    def resolve(self) -> Any:
        """The object at :attr:`path` on the running torch, or None where it has none."""
        module, _, rest = self.path.partition(".")
        obj: Any = importlib.import_module(module)
        for part in rest.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                try:  # a submodule not imported yet
                    obj = importlib.import_module(f"{obj.__name__}.{part}")
                except (ImportError, AttributeError):
                    return None
        return obj


#: Every private name, by path.
NAMES: dict[str, Private] = {}
_RESOLVED: dict[str, Any] = {}


def _entry(path: str, fallback: str, *, lazy: bool = False, checked_on: tuple[str, ...] = CHECKED) -> Any:
    """Record ``path``; its object now (None where missing), or, ``lazy``, the path for :func:`resolve`."""
    NAMES[path] = Private(path, fallback, checked_on, lazy=lazy)
    return path if lazy else resolve(path)


def _op(path: str, fallback: str) -> Callable[..., Any]:
    """Record ``torch.<op>`` and return a function that looks it up at each call, as a direct
    ``torch.<op>(...)`` does: a test or a profiler that replaces the op on ``torch`` is seen."""
    NAMES[path] = Private(path, fallback, per_call=True)
    name = path.rpartition(".")[2]

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(torch, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``torch.{name}``, looked up at each call."
    return call


def resolve(path: str) -> Any:
    """The object at ``path`` (a key of :data:`NAMES`), resolved once; None where this torch lacks it."""
    if path not in _RESOLVED:
        _RESOLVED[path] = NAMES[path].resolve()
    return _RESOLVED[path]


# -- pytree and dispatch modes: torch's own utilities for nested outputs and tensor subclasses ----------
tree_map = _entry("torch.utils._pytree.tree_map", "none: present since torch 1.x (torch.utils._pytree is what torch.compile uses)")
tree_leaves = _entry("torch.utils._pytree.tree_leaves", "none: as tree_map")
TorchDispatchMode = _entry("torch.utils._python_dispatch.TorchDispatchMode",
                           "none: the op counter, the memory ledger and the collective counter are refused without it")
is_traceable_wrapper_subclass = _entry("torch.utils._python_dispatch.is_traceable_wrapper_subclass",
                                       "none: the inf/NaN watch needs it to see into DTensor and fp8 wrappers")
DisableTorchDispatch = _entry("torch._C._DisableTorchDispatch",
                              "none: the watches' own arithmetic would be counted as the model's")
DisableTorchFunction = _entry("torch._C.DisableTorchFunction",
                              "none: a probe of autocast would be seen by the function modes around it")
DisableTorchFunctionSubclass = _entry("torch._C.DisableTorchFunctionSubclass",
                                      "torch.Tensor.__torch_function__ handled by hand (not done: every supported torch has it)")
make_wrapper_subclass = _entry("torch.Tensor._make_wrapper_subclass",
                               "none: the lazy LM head (memory_lean(lazy_head=True)) is refused without it")
reparametrize_module = _entry("torch.nn.utils.stateless._reparametrize_module",
                              "torch.func.functional_call, which calls forward itself (not taken: the float32 wrapper "
                              "is the forward; low-precision parameters of a float32 module then are refused)")
current_autograd_node = _entry("torch._C._current_autograd_node", "none: backward ops are attributed to no module")
current_graph_task_id = _entry("torch._C._current_graph_task_id", "none: as _current_autograd_node")
DelayedError = _entry("torch._C._functions.DelayedError",
                      "none: the fused loss's double backward would fail without its message")
top_saved_tensors_hooks = _entry(
    "torch._C._autograd._top_saved_tensors_default_hooks",
    "none (torch 2.4 has none): activations' outputs are saved as before, not recomputed (which saved-tensor "
    "hooks are in force, a checkpoint's or the ledger's, cannot be told, so none are put over them)",
    checked_on=AFTER_2_4)
functorch_transforms_active = _entry("torch._C._are_functorch_transforms_active",
                                    "none: the shared casts hand each layer its own cast (nothing shared)")
function_mode_stack = _entry("torch.overrides._get_current_function_mode_stack",
                             "none: the activations' outputs are not recomputed on such a torch while any mode is on")
len_function_stack = _entry("torch._C._len_torch_function_stack", "none: as _get_current_function_mode_stack")


def function_modes_on() -> bool:
    """Whether a ``TorchFunctionMode`` other than the default device's (``torch.set_default_device``) is
    on: it may change what a function computes, and a recomputation in backward runs outside it."""
    count, stack = len_function_stack, function_mode_stack
    if count is not None and not count():
        return False
    if stack is None:  # (on, or unknown: taken as on)
        return True
    return any(type(m).__module__ != "torch.utils._device" for m in stack())


FORWARD_AD_LEVEL = _entry("torch.autograd.forward_ad._current_level", "none: forward-mode AD taken as off (the "
                          "low-precision saves then refuse a dual input, as a Function without jvp does)", lazy=True)


def forward_ad_active() -> bool:
    """Whether a forward-mode AD level is open (``torch.autograd.forward_ad.dual_level``), read now."""
    return getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0


push_saved_tensors_hooks = _entry("torch._C._autograd._push_saved_tensors_default_hooks",
                                  "torch.autograd.graph.saved_tensors_hooks, whose __enter__ calls it (not taken: "
                                  "every supported torch has it)")
pop_saved_tensors_hooks = _entry("torch._C._autograd._pop_saved_tensors_default_hooks",
                                 "as push_saved_tensors_hooks (its __exit__)")
saved_tensors_hooks_are_enabled = _entry("torch._C._autograd._saved_tensors_hooks_is_enabled",
                                         "none: activations' outputs are not recomputed where this is missing")
OpOverload = _entry("torch._ops.OpOverload", "none: selective recompute takes ops as OpOverloads (torch.ops.aten.x.default)")
OpOverloadPacket = _entry("torch._ops.OpOverloadPacket", "none: as OpOverload")
FakeTensor = _entry("torch._subclasses.fake_tensor.FakeTensor", "none: the memory ledger counts on fake tensors")
FakeTensorMode = _entry("torch._subclasses.fake_tensor.FakeTensorMode", "none: as FakeTensor")

# -- the compiler -------------------------------------------------------------------------------------
disable_dynamo = _entry("torch._compile._disable_dynamo",
                        "torch.compiler.disable (public since 2.1), taken where this is missing (amp_backends.eager); "
                        "it imports dynamo when applied, at the package's import, where this waits for the first call")
DYNAMO_SKIP = _entry("torch._dynamo.decorators.skip", "none: the function is left unmarked, and torch.compile traces it "
                     "(amp_backends.eager.untraced)", lazy=True)
FUNCTORCH_CONFIG = _entry("torch._functorch.config", "none: without its backward_pass_autocast setting, a compiled "
                          "region's backward is eager's already (nothing to switch)", lazy=True)

# -- the gradient op and optimizer steps: the ops torch's own GradScaler and optimizers call ------------
amp_foreach_non_finite_check_and_unscale_ = _op(
    "torch._amp_foreach_non_finite_check_and_unscale_", "none: torch.amp.GradScaler itself calls it; the package requires it")
foreach_mul_ = _op("torch._foreach_mul_", "a loop of Tensor.mul_ (not taken: every supported torch has it)")
foreach_mul = _op("torch._foreach_mul", "a list of Tensor.mul (not taken: as _foreach_mul_)")
foreach_norm = _op("torch._foreach_norm", "torch.linalg.vector_norm per tensor (not taken: as _foreach_mul_)")
foreach_zero_ = _op("torch._foreach_zero_", "a loop of Tensor.zero_ (not taken: as _foreach_mul_)")
foreach_copy_ = _op("torch._foreach_copy_", "a loop of Tensor.copy_ (not taken: as _foreach_mul_)")
device_has_foreach_support = _entry("torch.utils._foreach_utils._device_has_foreach_support",
                                    "none: clipping runs its per-tensor path where it answers False")
flatten_dense_tensors = _entry("torch._utils._flatten_dense_tensors", "torch.cat of the flattened tensors (not taken)")
unflatten_dense_tensors = _entry("torch._utils._unflatten_dense_tensors", "views of the flat tensor by their sizes (not taken)")
refresh_per_optimizer_state = _entry("torch.amp.grad_scaler._refresh_per_optimizer_state",
                                     "none: the scaler keeps torch.amp.GradScaler's per-optimizer state as torch makes it")

# -- memory: storages and references ------------------------------------------------------------------
storage_use_count = _entry("torch._C._storage_Use_Count",
                           "none: the arena's check='refcount' is refused and check='identity' is its default; a "
                           "gradient view dropped from .grad by hand is then taken as possibly held (that step runs on "
                           "the per-tensor path until optimizer.zero_grad())")
tensor_use_count = _entry("torch.Tensor._use_count",
                          "none: fp8 all-gather refuses to swap a weight in place without it (say why, nothing changed)")

# -- devices: PrivateUse1 and the dispatcher ----------------------------------------------------------
get_privateuse1_backend_name = _entry("torch._C._get_privateuse1_backend_name",
                                      "torch.utils.backend_registration's name (not taken: the same call)")
dispatch_has_kernel_for_dispatch_key = _entry("torch._C._dispatch_has_kernel_for_dispatch_key",
                                              "none: a vendor's fp8 matmul is taken as absent")
dispatch_get_all_op_names = _entry("torch._C._dispatch_get_all_op_names", "none: the simulated device's op list is refused")
DispatchKey = _entry("torch._C.DispatchKey", "none: the simulated autocast needs it")
DispatchKeySet = _entry("torch._C.DispatchKeySet", "none: as DispatchKey")
ExcludeDispatchKeyGuard = _entry("torch._C._ExcludeDispatchKeyGuard", "none: as DispatchKey")
setup_privateuseone_for_python_backend = _entry(
    "torch.utils.backend_registration._setup_privateuseone_for_python_backend",
    "none: the simulated device (amp_backends.testing) is refused on a torch without it", checked_on=AFTER_2_4)
accelerator_extension = _entry("torch._C._acc", "none: the simulated device is refused on a torch without it (2.8+)",
                               checked_on=AFTER_2_4)

# -- distributed: FSDP2 before its public path ---------------------------------------------------------
COMPOSABLE_FSDP = _entry("torch.distributed._composable.fsdp", "torch.distributed.fsdp, fully_shard's public home from "
                         "2.6 (taken first); FSDP2 refused where neither exists", lazy=True)
FSDP_REDUCE_SCATTER = _entry("torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter",
                             "none: dividing before a SUM reduce-scatter is not offered (fully_shard's own ops run)", lazy=True,
                             checked_on=AFTER_2_4)


@dataclass(frozen=True)
class Attribute:
    """A private attribute of a torch object that the package reads where it extends the object."""

    owner: str
    name: str
    why: str
    readers: tuple[str, ...]
    checked_on: tuple[str, ...] = CHECKED


#: Private attributes of torch's objects read by the package's subclasses and helpers.
ATTRIBUTES: tuple[Attribute, ...] = (
    Attribute("torch.amp.GradScaler", "_per_optimizer_states",
              "the scaler subclasses torch.amp.GradScaler and keeps its per-optimizer state (stage, found_inf per "
              "device) as torch's ShardedGradScaler does; also _scale and _growth_tracker, inherited",
              ("amp_backends/scaler/scaler.py", "amp_backends/scaler/steps.py")),
    Attribute("torch.UntypedStorage", "_cdata", "the storage's handle, what torch._C._storage_Use_Count takes",
              ("amp_backends/gradients/arena.py", "amp_backends/memory/chunked_loss.py", "amp_backends/testing/simdevice.py")),
    Attribute("torch.nn.modules.module", "_global_backward_hooks",
              "emptied while a model runs isolated (read by name, with _global_backward_pre_hooks); read with "
              "_global_forward_pre_hooks and _global_forward_hooks: a lever that substitutes saved tensors stands "
              "aside where any is registered",
              ("amp_backends/tracing/isolation.py", "amp_backends/memory/hooks_around.py")),
    Attribute("torch.nn.Module", "_backward_hooks", "emptied while a model runs isolated (with _backward_pre_hooks); "
              "a parameter's (Tensor._backward_hooks) carried onto its fp8 all-gather wrapper; read with "
              "_forward_pre_hooks and _forward_hooks: a lever that substitutes saved tensors stands aside where "
              "a module has hooks of its user",
              ("amp_backends/tracing/isolation.py", "amp_backends/precision/fp8/carry.py",
               "amp_backends/memory/hooks_around.py")),
    Attribute("torch.Tensor", "_post_accumulate_grad_hooks", "a parameter's hooks, emptied while a model runs isolated "
              "and carried onto its fp8 all-gather wrapper",
              ("amp_backends/tracing/isolation.py", "amp_backends/precision/fp8/carry.py")),
)
