"""A module's forward in float32 inside autocast: the wrapper a precision policy sets on a module."""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["Fp32Forward"]

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
    for leaf in (args if plain else tree_leaves((args, kwargs))):
        if isinstance(leaf, torch.Tensor):
            types.add(leaf.device.type)
    return [t for t in types if _has_autocast(t) and torch.is_autocast_enabled(t)]


def _low_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's own float16/bfloat16 parameters and buffers (a model loaded in bf16, FSDP2's
    param_dtype), as float32 copies through which gradients still reach them."""
    own = {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}
    return {k: v.float() for k, v in own.items() if isinstance(v, torch.Tensor) and v.dtype in _LOW}


class Fp32Forward:
    """A selected module's ``forward``, set on the instance: autocast off and float32 inputs (and
    float32 copies of its own low-precision weights) while autocast is on, the module's own forward
    otherwise. A picklable object, not a closure, that follows the module when it is copied
    (``copy.deepcopy``, as torch.compile's fake-tensor propagation copies modules), so a copy never
    runs the original's parameters.

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
        low = _low_params(self.module)
        if not low and len(active) == 1 and not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
            with torch.autocast(active[0], enabled=False):  # the common case: one tensor in
                return self._forward(_to_fp32(args[0]))
        with contextlib.ExitStack() as stack:
            for device_type in active:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            if low:
                from torch.nn.utils.stateless import _reparametrize_module

                stack.enter_context(_reparametrize_module(self.module, low))
            args, kwargs = tree_map(_to_fp32, (args, kwargs))
            return self._forward(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Fp32Forward:
        copied = Fp32Forward(copy.deepcopy(self.module, memo), copy.deepcopy(self.previous, memo))
        copied.holders = dict(self.holders)
        return copied

    @property
    def __globals__(self) -> dict[str, Any]:
        """What torch.jit.script looks for on a forward: it cannot compile a policy's wrapper."""
        raise AttributeError(
            "a precision policy wraps this module's forward, which torch.jit.script cannot compile: call "
            "policy.remove() before scripting, or use torch.compile or torch.export, which keep the policy"
        )
