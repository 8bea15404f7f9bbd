"""Per-module precision: chosen modules run in float32 inside any backend's autocast.

    handle = amp_backends.precision_policy(model, fp32=[torch.nn.BatchNorm2d, "head", "*.norm*"])
    with be.autocast():
        loss = loss_fn(model(x), y)     # BatchNorm2d layers, "head" and the norms run in float32
    handle.remove()                     # the model is exactly as before

Inside autocast a selected module runs with autocast off for the device types that are active,
its floating inputs cast to float32; outside autocast nothing changes. Only compute precision
changes: weights stay in the model's dtype, and ``state_dict`` keys are untouched (the module's
``forward`` is wrapped on the instance, not the module replaced). What the recipes ask for is the
preset :data:`RECIPE`: normalisation layers and the final classifier / LM head in float32.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
import fnmatch
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["NORM_TYPES", "OP_MODULES", "RECIPE", "PrecisionPolicy", "Selector", "precision_policy"]

#: What selects a module: a module class, a qualified-name pattern ("head", "*.norm*", fnmatch
#: syntax, matched against ``model.named_modules()`` names), or a predicate ``(name, module) -> bool``.
Selector = Union[type, str, Callable[[str, nn.Module], bool]]

#: Normalisation layers, which the recipes keep in float32.
NORM_TYPES: tuple[type, ...] = tuple(
    t for t in (
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.GroupNorm, nn.LayerNorm,
        nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm, getattr(nn, "RMSNorm", None),
    ) if t is not None
)

#: The preset the recipes describe: normalisation layers and the final classifier / LM head.
RECIPE = "recipe"

#: The modules that run an op a backend may declare float32-only (``Backend.fp32_ops``).
OP_MODULES: dict[str, tuple[type, ...]] = {
    "binary_cross_entropy": (nn.BCELoss,),
    "batch_norm": (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm),
    "layer_norm": (nn.LayerNorm,),
    "group_norm": (nn.GroupNorm,),
    "instance_norm": (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d),
    "softmax": (nn.Softmax,),
    "log_softmax": (nn.LogSoftmax,),
    "cross_entropy": (nn.CrossEntropyLoss,),
    "nll_loss": (nn.NLLLoss,),
    "mse_loss": (nn.MSELoss,),
    "embedding": (nn.Embedding,),
}

#: Prefixes wrappers add to every qualified name (DDP, torch.compile): patterns match without them.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_LOW = (torch.float16, torch.bfloat16)


def _to_fp32(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype in _LOW:
        return x.float()
    return x


@functools.lru_cache(maxsize=None)
def _has_autocast(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type)


def _active(args: tuple[Any, ...], kwargs: dict[str, Any], extra: tuple[str, ...]) -> list[str]:
    """The device types of the inputs (and ``extra``) whose autocast is on now."""
    types = set(extra)
    plain = not kwargs and all(isinstance(a, torch.Tensor) for a in args)
    leaves = args if plain else torch.utils._pytree.tree_leaves((args, kwargs))
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            types.add(leaf.device.type)
    return [t for t in types if _has_autocast(t) and torch.is_autocast_enabled(t)]


class _Fp32Forward:
    """A selected module's ``forward``, set on the instance: autocast off and float32 inputs while
    autocast is on, the module's own forward otherwise. A picklable object, not a closure, that
    follows the module when it is copied (``copy.deepcopy``, as torch.compile's fake-tensor
    propagation copies modules), so a copy never runs the original's parameters.

    Every policy selecting the module holds the same wrapper (``holders``: policy id -> the device
    types it named); the wrapper works while anyone holds it, and passes straight through once no one
    does but something was wrapped on top of it since (an Accelerate hook, a user's own wrapper)."""

    def __init__(self, module: nn.Module, previous: Any = None) -> None:
        self.module = module
        #: the instance's own forward before the policy (another wrapper), or None: the class's
        self.previous = previous
        self.holders: dict[int, tuple[str, ...]] = {}

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.holders:
            return self._forward(*args, **kwargs)
        extra = tuple(t for types in self.holders.values() for t in types)
        active = _active(args, kwargs, extra)
        if not active:
            return self._forward(*args, **kwargs)  # outside autocast: exactly the module's own forward
        if len(active) == 1 and not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
            with torch.autocast(active[0], enabled=False):  # the common case: one tensor in
                return self._forward(_to_fp32(args[0]))
        with contextlib.ExitStack() as stack:
            for device_type in active:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            args, kwargs = tree_map(_to_fp32, (args, kwargs))
            return self._forward(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Fp32Forward:
        copied = _Fp32Forward(copy.deepcopy(self.module, memo), copy.deepcopy(self.previous, memo))
        copied.holders = dict(self.holders)
        return copied


def _strip(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
            elif name + "." == prefix:
                name, changed = "", True
    return name


def _head(model: nn.Module) -> str | None:
    """The final classifier / LM head: the last ``nn.Linear`` registered in the model."""
    last = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last = name
    return last


@dataclass
class PrecisionPolicy:
    """The modules a :func:`precision_policy` runs in float32; :meth:`remove` undoes it."""

    model: nn.Module
    #: qualified name -> why it was selected ("BatchNorm2d", "'head'", "the head", "backend 'mlu': ...")
    selected: dict[str, str] = field(default_factory=dict)
    _held: dict[str, tuple[nn.Module, _Fp32Forward]] = field(default_factory=dict, repr=False)

    def remove(self) -> None:
        """Undo this policy: each module it selected runs as it would without it. A module another
        policy still selects stays in float32; one that nothing selects any more gets its ``forward``
        back exactly as it was (or, where something wrapped it since, a wrapper that passes through)."""
        for module, wrapper in self._held.values():
            wrapper.holders.pop(id(self), None)
            if not wrapper.holders and module.__dict__.get("forward") is wrapper:
                if wrapper.previous is None:
                    del module.__dict__["forward"]
                else:
                    module.forward = wrapper.previous
        self._held.clear()

    @property
    def active(self) -> bool:
        return bool(self._held)

    def __enter__(self) -> PrecisionPolicy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        names = ", ".join(self.selected) or "none"
        return f"<PrecisionPolicy fp32: {names}{'' if self.active else ' (removed)'}>"


def _reason(name: str, module: nn.Module, selectors: Sequence[Selector], head: str | None) -> str | None:
    bare = _strip(name)
    for selector in selectors:
        if selector == RECIPE:
            if isinstance(module, NORM_TYPES):
                return f"recipe: {type(module).__name__}"
            if head is not None and name == head:
                return "recipe: the final classifier / head"
        elif isinstance(selector, str):
            if fnmatch.fnmatchcase(bare, selector):
                return f"pattern {selector!r}"
        elif isinstance(selector, type):
            if isinstance(module, selector):
                return selector.__name__
        elif callable(selector):
            if selector(bare, module):
                return f"predicate {getattr(selector, '__name__', 'callable')}"
    return None


def _check_selectors(fp32: Any) -> list[Selector]:
    if isinstance(fp32, (str, type)) or callable(fp32) and not isinstance(fp32, (list, tuple)):
        fp32 = [fp32]
    selectors = list(fp32)
    for s in selectors:
        if isinstance(s, type) and not issubclass(s, nn.Module):
            raise TypeError(f"precision_policy: {s.__name__} is not a torch.nn.Module class; pass module classes, "
                            "name patterns (str) or predicates (name, module) -> bool")
        if not isinstance(s, (str, type)) and not callable(s):
            raise TypeError(f"precision_policy: a selector must be a module class, a name pattern or a predicate, "
                            f"got {type(s).__name__} {s!r}")
    return selectors


def precision_policy(
    model: nn.Module,
    fp32: Selector | Sequence[Selector] = (RECIPE,),
    *,
    backend: Any = None,
    device_types: Sequence[str] = (),
) -> PrecisionPolicy:
    """Run the modules ``fp32`` selects in float32 inside autocast; returns a handle to remove it.

    ``fp32``: module classes, qualified-name patterns (fnmatch; wrapper prefixes such as DDP's
    ``module.`` and torch.compile's ``_orig_mod.`` are ignored), predicates ``(name, module)``, or
    :data:`RECIPE` (the default: normalisation layers and the last ``nn.Linear``, the head).
    ``backend`` (a name or Backend): its declared ``fp32_ops`` select the modules running them too.
    Autocast is switched off for the device types of a module's inputs that have it enabled, and
    for ``device_types`` (for modules without tensor inputs). A selector that matches nothing raises.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"precision_policy takes a torch.nn.Module, got {type(model).__name__}")
    selectors = _check_selectors(fp32)
    extra: list[tuple[str, tuple[type, ...]]] = []
    if backend is not None:
        from .registry import resolve_backend

        be = resolve_backend(backend)
        note = be.fp32_note()
        if note:
            warnings.warn(f"precision_policy: the modules it selects run with autocast off, but {note}",
                          RuntimeWarning, stacklevel=2)
        for op in getattr(be, "fp32_ops", ()):
            if op not in OP_MODULES:
                raise ValueError(f"backend {be.name!r} declares fp32 op {op!r}, which no module is known to run; "
                                 f"known: {', '.join(sorted(OP_MODULES))}")
            extra.append((f"backend {be.name!r}: {op} in float32", OP_MODULES[op]))
    head = _head(model) if RECIPE in selectors else None
    policy = PrecisionPolicy(model)
    matched: set[int] = set()
    for name, module in model.named_modules():
        if name in policy.selected:
            continue
        reason = _reason(name, module, selectors, head)
        if reason is None:
            reason = next((why for why, types in extra if isinstance(module, types)), None)
        if reason is None:
            continue
        for i, s in enumerate(selectors):
            if _reason(name, module, [s], head) is not None:
                matched.add(i)
        wrapper = module.__dict__.get("forward")
        if not isinstance(wrapper, _Fp32Forward):  # else another policy's: held by this one too
            wrapper = module.forward = _Fp32Forward(module, module.__dict__.get("forward"))
        wrapper.holders[id(policy)] = tuple(device_types)
        policy._held[name] = (module, wrapper)
        policy.selected[name] = reason
    unmatched = [s for i, s in enumerate(selectors) if i not in matched and s != RECIPE]
    if unmatched:
        policy.remove()
        shown = ", ".join(s.__name__ if isinstance(s, type) else repr(s) for s in unmatched)
        names = [_strip(n) for n, _ in model.named_modules() if n][:12]
        raise ValueError(f"precision_policy: {shown} selects no module of this model (nothing changed). "
                         f"Module names look like: {', '.join(names)}{' ...' if len(names) == 12 else ''}")
    return policy


def fp32_modules(model: nn.Module) -> list[str]:
    """The qualified names of the modules a policy runs in float32 (as installed now)."""
    return [name for name, m in model.named_modules()
            if isinstance(m.__dict__.get("forward"), _Fp32Forward) and m.__dict__["forward"].holders]
