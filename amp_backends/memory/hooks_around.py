"""Others' hooks around a layer, and a lever standing aside for them.

A lever that changes what a layer is handed or returns (a cast input, a tagged output) stands aside on a
layer where hooks other than the levers' run (its own forward, forward-pre and backward hooks, any
registered for every module, a forward set on the instance), so that they see and return what they would
without it: :func:`others_hooked` and :func:`foreign_forward` tell, :func:`stand_aside` notes the layer
(for :attr:`.substitutes.Hooked.stood_aside`) and warns once per lever and hook.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import PerformanceWarning
from ..precision.fp32_forward import Fp32Forward

__all__ = ["backward_hooked", "foreign_forward", "leaves_alone", "others_hooked", "stand_aside"]


#: Modules whose hooks only observe (the memory ledger's attribution by module): they change nothing a lever does.
_OBSERVERS = frozenset({"amp_backends.memory.ledger", "amp_backends.memory.substitutes", "amp_backends.memory.notices"})
#: The levers that put hooks on layers: each knows what the others do to a layer's input and output (they
#: compose: tested), so none stands aside for another's hook.
_LEVERS = frozenset({"amp_backends.memory.shared_casts", "amp_backends.memory.activation_outputs",
                     "amp_backends.memory.activation_inputs", "amp_backends.memory.dropout_masks"})
_OURS = _OBSERVERS | _LEVERS


def _global_table(name: str) -> dict[int, Any]:
    table = getattr(torch.nn.modules.module, name, None)
    return table if table is not None else {}  # (the table itself, empty or not: torch fills it in place)


#: torch's tables of hooks registered for every module (dictionaries it fills and empties in place)
_GLOBAL_TABLES = tuple(_global_table(name) for name in (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_hooks", "_global_backward_pre_hooks"))
#: torch's module trackers (FlopCounterMode and the memory and communication debuggers run on them): their
#: global forward hooks return nothing and edit nothing, they only note which module runs and put grad hooks
#: on its tensors. Anything else registered for every module makes the levers stand aside.
_TRACKERS = frozenset({"torch.utils.module_tracker.ModuleTracker", "torch.distributed._tools.mod_tracker.ModTracker"})


def _observes(hook: Callable[..., Any]) -> bool:
    """Whether a global module hook only observes: a method of one of torch's module trackers, or the package's."""
    owner = getattr(hook, "__self__", None)
    if owner is None:
        return getattr(hook, "__module__", None) in _OBSERVERS
    kind = type(owner)
    return f"{kind.__module__}.{kind.__qualname__}" in _TRACKERS


def others_hooked(module: nn.Module, own: Callable[..., Any]) -> bool:
    """Whether hooks other than the lever's ``own`` (and the package's observers) run around ``module``:
    its own forward, forward-pre and backward hooks, or any registered for every module. A lever that
    changes what a layer's hooks would be given (a cast input, a tagged output) stands aside there, so that
    they see and return what they would without it. (Called at every forward of a hooked layer: written
    for the fewest Python calls.)"""
    if module._backward_hooks or module._backward_pre_hooks:
        return True
    if any(_GLOBAL_TABLES[2:]) or (any(_GLOBAL_TABLES[:2]) and any(  # backward ones always count
            not _observes(hook) for table in _GLOBAL_TABLES[:2] for hook in table.values())):
        return True
    for table in (module._forward_pre_hooks, module._forward_hooks):
        for hook in table.values():
            if hook is not own and getattr(hook, "__module__", None) not in _OURS:
                return True
    return False


def backward_hooked(module: nn.Module) -> bool:
    """Whether backward hooks run around ``module``: its own (full backward or backward pre-hooks), or any
    registered for every module."""
    return bool(module._backward_hooks or module._backward_pre_hooks or any(_GLOBAL_TABLES[2:]))


#: layers where a lever stood aside for others' hooks (since it was turned on), weakly -> which hook
_ASIDE: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
#: (lever, hook) pairs warned of: once each per process
_WARNED: set[tuple[str, str]] = set()


def _name(hook: Callable[..., Any]) -> str:
    owner = getattr(hook, "__self__", None)
    if owner is not None:
        return f"{type(owner).__module__}.{type(owner).__qualname__}.{getattr(hook, '__name__', '?')}"
    fn = getattr(hook, "func", hook)  # a functools.partial: its function
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _foreign(module: nn.Module, own: Callable[..., Any]) -> str:
    """Which hook :func:`others_hooked` found around ``module``, in words."""
    kinds = (("a backward hook", module._backward_hooks, True), ("a backward pre-hook", module._backward_pre_hooks, True),
             ("a forward pre-hook", module._forward_pre_hooks, False), ("a forward hook", module._forward_hooks, False))
    for kind, table, any_counts in kinds:
        for hook in table.values():
            if any_counts or (hook is not own
                              and getattr(hook, "__module__", None) not in _OURS):
                return f"{kind} ({_name(hook)})"
    for i, (kind, table) in enumerate(zip(("a forward pre-hook for every module", "a forward hook for every module",
                                           "a backward hook for every module", "a backward pre-hook for every module"),
                                          _GLOBAL_TABLES)):
        for hook in table.values():
            if i >= 2 or not _observes(hook):
                return f"{kind} ({_name(hook)})"
    return "another's hook"


def foreign_forward(module: nn.Module) -> str | None:
    """A forward another's code set on ``module`` itself (accelerate's hooks wrap each layer's this way), in
    words; None where there is none, or it is a precision policy's float32 forward (a lever leaves that
    layer alone by design)."""
    forward = vars(module).get("forward")
    if forward is None or isinstance(forward, Fp32Forward):
        return None
    return f"its forward replaced on the instance ({_name(forward)})"


def stand_aside(module: nn.Module, own: Callable[..., Any], lever: str, hook: str | None = None) -> None:
    """Note that ``lever`` (its hook ``own``) stood aside on ``module`` for others' hooks
    (:func:`others_hooked`) or ``hook`` (another's code around the layer, in words), for
    :attr:`Hooked.stood_aside`; a :class:`PerformanceWarning` the first time for each lever and hook,
    since the memory it would save there is then kept."""
    if module in _ASIDE:
        return
    hook = _ASIDE[module] = hook or _foreign(module, own)
    if (lever, hook) in _WARNED:
        return
    _WARNED.add((lever, hook))
    warnings.warn(
        f"memory_lean's {lever} lever stands aside on a {type(module).__name__} with {hook}, so that the hook "
        "sees and returns what it would without the lever; the memory the lever saves there is kept (one "
        "warning per lever and hook; the layers are in Lean.stood_aside). To save it, take the hook off the "
        "layer, or keep the lever off (memory_lean(..., " + lever + "=False)) to silence this.",
        PerformanceWarning, stacklevel=2)


def leaves_alone(module: nn.Module, own: Callable[..., Any], lever: str) -> bool:
    """Whether ``lever`` (its hook ``own``) leaves the layer ``module`` as it is: a forward set on it (a
    precision policy's float32 one, by design; another's, standing aside) or others' hooks around it
    (standing aside); each stand-aside noted (:func:`stand_aside`)."""
    if "forward" in module.__dict__:
        foreign = foreign_forward(module)
        if foreign is not None:
            stand_aside(module, own, lever, foreign)
        return True
    if others_hooked(module, own):
        stand_aside(module, own, lever)
        return True
    return False
