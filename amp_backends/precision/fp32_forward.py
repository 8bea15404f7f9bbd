"""A module's forward in float32 inside autocast: the wrapper a precision policy sets on a module."""

from __future__ import annotations

import contextlib
import copy
import weakref
from typing import Any

import torch
from torch import nn

from .. import patches
from ..torch_private import FUNCTORCH_CONFIG, resolve, tree_leaves, tree_map

__all__ = ["Fp32Forward", "float32_copies"]

_LOW = (torch.float16, torch.bfloat16)


def _to_fp32(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype in _LOW:
        return x.float()
    return x


_AUTOCAST: dict[str, bool] = {}


def _has_autocast(device_type: str) -> bool:
    known = _AUTOCAST.get(device_type)
    if known is None:
        known = _AUTOCAST[device_type] = torch.amp.is_autocast_available(device_type)
    return known


def _active(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], extra: tuple[str, ...]) -> list[str]:
    """The device types of the inputs (and ``extra``; where no input is a tensor, of the module's own
    parameters and buffers: a rotary embedding called with a length) whose autocast is on now."""
    types = set(extra)
    plain = not kwargs and all(isinstance(a, torch.Tensor) for a in args)
    leaves = [leaf for leaf in (args if plain else tree_leaves((args, kwargs))) if isinstance(leaf, torch.Tensor)]
    if not leaves:
        leaves = [*module.parameters(), *module.buffers()]
    for leaf in leaves:  # (a loop: torch 2.4's dynamo cannot trace set.update of a generator)
        types.add(leaf.device.type)
    return [t for t in types if _has_autocast(t) and torch.is_autocast_enabled(t)]


def float32_copies(module: nn.Module) -> dict[str, torch.Tensor]:
    """The float16/bfloat16 parameters and buffers of the module and of everything inside it (a model
    loaded in bf16, FSDP2's param_dtype), by every name each has, as float32 copies through which
    gradients still reach them (one copy per tensor: tied weights stay tied)."""
    copies: dict[int, torch.Tensor] = {}
    low: dict[str, torch.Tensor] = {}
    for name, value in [*module.named_parameters(remove_duplicate=False),
                        *module.named_buffers(remove_duplicate=False)]:
        if isinstance(value, torch.Tensor) and value.dtype in _LOW:
            if id(value) not in copies:
                copies[id(value)] = value.float()
            low[name] = copies[id(value)]
    return low


def _write_back(module: nn.Module, low: dict[str, torch.Tensor]) -> None:
    """The buffers' float32 copies written back to the module's own, in their dtype: what the forward
    updated in them (BatchNorm's running statistics, which move no version counter) is kept; a copy
    left alone rounds back to the same value. Written through ``.data``, as torch's BatchNorm updates
    them, so no version counter moves (a buffer saved for another op's backward stays valid). Buffers
    sharing memory (a view of another, or one a copy of the model shares) each got a copy of their
    own: only one the forward changed is written back (a read, in that rare case). An inference tensor
    outside inference mode, which nothing may write, is left as it is."""
    writable = torch.is_inference_mode_enabled()
    buffers = [(b, low[name]) for name, b in module.named_buffers() if name in low
               and not (b.is_inference() and not writable)]  # (a buffer under two names is written once)
    storages: dict[int, int] = {}
    for buffer, _ in buffers:
        key = buffer.untyped_storage().data_ptr()
        storages[key] = storages.get(key, 0) + 1
    with torch.no_grad():
        changed = [(buffer, copy_) for buffer, copy_ in buffers  # (all compared before any is written)
                   if storages[buffer.untyped_storage().data_ptr()] == 1 or not torch.equal(copy_.to(buffer.dtype), buffer)]
        for buffer, copy_ in changed:
            buffer.data.copy_(copy_)


class Fp32Forward:
    """A selected module's ``forward``, set on the instance: autocast off and float32 inputs (and
    float32 copies of its low-precision weights and buffers, its children's included, the buffers the
    forward updates written back) while autocast is on, the module's own forward
    otherwise. A picklable object, not a closure, that follows the module when it is copied
    (``copy.deepcopy``, as torch.compile's fake-tensor propagation copies modules), so a copy never
    runs the original's parameters.

    Every policy selecting the module holds the same wrapper (``holders``: policy id -> the device
    types it named); the wrapper works while anyone holds it, and passes straight through once no one
    does but something was wrapped on top of it since (an Accelerate hook, a user's own wrapper).

    A wrapper with holders keeps torch.compile's backward as eager's (:func:`hold_eager_backward`)
    for as long as it lives, wherever it went: a deep copy, a model unpickled in another process."""

    def __init__(self, module: nn.Module, previous: Any = None) -> None:
        self.module = module
        #: the instance's own forward before the policy (another wrapper), or None: the class's
        self.previous = previous
        self.holders: dict[int, tuple[str, ...]] = {}

    def hold(self, policy: int, device_types: tuple[str, ...]) -> None:
        """``policy`` runs the module in float32 (autocast off also for ``device_types``)."""
        self.holders[policy] = device_types
        hold_eager_backward(self)

    def release(self, policy: int) -> None:
        """``policy`` no longer does; with no holder left the wrapper passes through."""
        self.holders.pop(policy, None)
        if not self.holders:
            release_eager_backward(self)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.holders:
            return self._forward(*args, **kwargs)
        extra = tuple(t for types in self.holders.values() for t in types)
        active = _active(self.module, args, kwargs, extra)
        if not active:
            return self._forward(*args, **kwargs)  # outside autocast: exactly the module's own forward
        low = float32_copies(self.module)
        if not low and len(active) == 1 and not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
            with torch.autocast(active[0], enabled=False):  # the common case: one tensor in
                return self._forward(_to_fp32(args[0]))
        with contextlib.ExitStack() as stack:
            for device_type in active:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            if low:
                from ..torch_private import reparametrize_module as _reparametrize_module

                stack.enter_context(_reparametrize_module(self.module, low))
            args, kwargs = tree_map(_to_fp32, (args, kwargs))
            output = self._forward(*args, **kwargs)
        if low:
            _write_back(self.module, low)
        return output

    def __deepcopy__(self, memo: dict[int, Any]) -> Fp32Forward:
        copied = Fp32Forward(copy.deepcopy(self.module, memo), copy.deepcopy(self.previous, memo))
        copied.holders = dict(self.holders)
        if copied.holders:
            hold_eager_backward(copied)
        return copied

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.holders:  # a model pickled with its policy: the float32 modules' backward stays eager's
            hold_eager_backward(self)

    @property
    def __globals__(self) -> dict[str, Any]:
        """What torch.jit.script looks for on a forward: it cannot compile a policy's wrapper."""
        raise AttributeError(
            "a precision policy wraps this module's forward, which torch.jit.script cannot compile: call "
            "policy.remove() before scripting, or use torch.compile or torch.export, which keep the policy"
        )


#: The wrappers with holders that are alive (id -> weak reference): while there is one, torch's
#: setting is "off" (where this module switched it; see :func:`hold_eager_backward`).
_HELD: dict[int, weakref.ReferenceType] = {}
#: "off", as an object of this module's own: the value it set is told from a user's "off" by identity.
_OFF = "".join(("of", "f"))  # noqa: FLY002 - a new object, not the interned literal
#: The patch that switched the setting to :data:`_OFF`, its undo putting torch's value back (empty: not switched).
_BEFORE: list[patches.Patch] = []
#: Why and for how long a policy's wrapper replaces a module's forward (:mod:`amp_backends.patches`).
FP32_CAUSE = "the module runs in float32 inside autocast (a precision policy selects it)"
FP32_SCOPE = "until every policy holding it is removed (policy.remove())"


def hold_eager_backward(wrapper: Fp32Forward) -> None:
    """Keep torch.compile's backward as eager's while ``wrapper`` (a float32 module's) is alive and held.

    AOTAutograd traces a compiled region's backward under the autocast active when its forward ran
    (``torch._functorch.config.backward_pass_autocast = "same_as_forward"``, torch's default through
    2.13, deprecated upstream): the backward of a module a policy runs in float32 (autocast off inside
    it) then runs its matmuls in float16/bfloat16, where eager runs them in float32 (pytorch#179804).
    While any held wrapper lives (the policy's, a deep copy's, an unpickled model's), the setting is
    ``"off"``, eager's semantics (backward outside autocast, as the AMP recipe writes it); a value the
    user chose is left alone. The hold ends with :func:`release_eager_backward` or when the wrapper
    is garbage collected."""
    key = id(wrapper)
    if key in _HELD:
        return
    _HELD[key] = weakref.ref(wrapper, lambda ref, key=key: _collected(key, ref))
    if len(_HELD) == 1:
        _switch_off()


def release_eager_backward(wrapper: Fp32Forward) -> None:
    """``wrapper``'s hold ends; torch's setting comes back when no wrapper holds it."""
    if _HELD.pop(id(wrapper), None) is not None and not _HELD:
        _switch_back()


def _collected(key: int, ref: weakref.ReferenceType) -> None:
    if _HELD.get(key) is ref:
        del _HELD[key]
        if not _HELD:
            _switch_back()


def _switch_off() -> None:
    config = _functorch_config()
    if config is None or _BEFORE:
        return
    value = config.backward_pass_autocast
    if isinstance(value, str) and value == "same_as_forward":  # else the user's own value: left alone
        _BEFORE.append(patches.replace(
            config, "backward_pass_autocast", _OFF, scope="process-wide, while a float32 module's wrapper is held",
            cause="AOTAutograd's backward under the forward's autocast runs a float32 module's matmuls in low precision"))


def _switch_back() -> None:
    """torch's value again, unless the setting changed since it was switched: then it is the user's."""
    if _BEFORE:
        _BEFORE.pop().remove()


def _functorch_config() -> Any:
    config = resolve(FUNCTORCH_CONFIG)
    return config if hasattr(config, "backward_pass_autocast") else None
