"""What an fp8 layer carries over from the Linear it replaces, and gives back on ``remove()``: the
module's hooks, the user's own attributes set on it (a scale its parent's forward reads), and with fp8
all-gather the weight's parameter object itself.

torchao's ``from_float`` with ``enable_fsdp_float8_all_gather`` wraps the weight in a new parameter
(``WeightWithDynamicFloat8CastTensor``, holding the original in ``_tensor``). An optimizer built before
would then hold a parameter the model no longer uses, and one built after a parameter the model stops
using at ``remove()``: either way the weight silently stops training. Here the wrapper takes the place
of the original parameter object instead (``torch.utils.swap_tensors``: the same Python object, now
the wrapper, holding a plain parameter with the original storage), and ``remove()`` swaps it back, so
every reference to the parameter (optimizers, the user's own lists, tied modules, tensor hooks) stays
valid through conversion and removal.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ...torch_private import tensor_use_count

__all__ = ["CARRIED", "carry_attributes", "carry_hooks", "swap_in", "swap_out", "swap_reason"]

_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
#: The attributes torchao's wrapper keeps on itself (not the user's).
_WRAPPER_ATTRS = frozenset({"_tensor", "_linear_mm_config", "_dtype", "_precomputed_scale", "_is_param"})


def carry_hooks(source: nn.Module, target: nn.Module) -> None:
    """``target`` gets ``source``'s hook dictionaries themselves (a hook registered on either, before
    or after, runs on whichever module is in the model), whether its backward hooks are full ones
    (``register_full_backward_hook``: torch calls none of them without that flag), and its mode."""
    for attr in _HOOK_DICTS:
        if attr in source.__dict__:
            setattr(target, attr, source.__dict__[attr])
    if "_is_full_backward_hook" in source.__dict__:
        target._is_full_backward_hook = source.__dict__["_is_full_backward_hook"]
    target.train(source.training)


#: The fp8 layer's record of the user's attributes carried onto it (given back at ``remove()``).
CARRIED = "_amp_backends_carried"


def carry_attributes(source: nn.Module, target: nn.Module, names: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """``source``'s own attributes ``names`` (default: the public ones the user set on it, a scale its
    parent's forward reads, that ``target`` lacks; private ones are a library's, such as Accelerate's
    hook bound to ``source``), set on ``target`` as the same objects; returns the names, to carry back."""
    if names is None:
        names = tuple(k for k in source.__dict__
                      if not k.startswith("_") and k not in _MODULE_ATTRS and k not in target.__dict__)
    for name in names:
        if name in source.__dict__:
            target.__dict__[name] = source.__dict__[name]
    return names


#: What every module holds itself (torch's own attributes): never carried as the user's.
_MODULE_ATTRS = frozenset(nn.Module().__dict__) | {"forward", "training"}


def swap_reason(param: Any) -> str | None:
    """Why the fp8 all-gather wrapper cannot take ``param``'s place as the same object, or None."""
    if type(param) is not nn.Parameter:
        return (f"its weight is a {type(param).__name__}, not a plain nn.Parameter (is the model already wrapped, "
                "by FSDP2 or tensor parallelism?)")
    if weakref.getweakrefs(param):
        return "something holds a weak reference to its weight"
    count = tensor_use_count(param)
    if count > 2 or (count == 2 and not param.is_leaf):
        return "something else holds its weight's tensor (a view of it, or a wrapper such as DDP)"
    return None


def swap_in(param: nn.Parameter, wrapper: Any) -> Any:
    """Make ``param`` (the object) torchao's all-gather ``wrapper`` around a plain parameter holding
    ``param``'s storage; its own attributes, gradient and tensor hooks stay with it. Returns ``param``."""
    own = dict(param.__dict__)
    grad = param.grad
    torch.utils.swap_tensors(param, wrapper)
    inner = wrapper  # now the plain parameter, with the original storage
    param._tensor = inner
    for key, value in own.items():
        if key not in _WRAPPER_ATTRS:
            param.__dict__.setdefault(key, value)
    inner.grad = None
    param.grad = grad
    _rehook(param)
    return param


def swap_out(param: Any) -> nn.Parameter:
    """``param`` (swapped in by :func:`swap_in`) a plain parameter again, holding the trained values
    its wrapper holds, with its gradient, attributes and tensor hooks. Where something now keeps the
    swap from happening, a new parameter holding those values is returned instead."""
    inner = param._tensor
    if type(inner) is not nn.Parameter:
        inner = nn.Parameter(inner.detach(), requires_grad=param.requires_grad)
    own = {k: v for k, v in param.__dict__.items() if k not in _WRAPPER_ATTRS}
    grad = param.grad
    try:
        torch.utils.swap_tensors(param, inner)
    except RuntimeError:
        inner.grad = grad
        inner.__dict__.update(own)
        return inner
    param.__dict__.update(own)
    param.__dict__.pop("_is_param", None)
    param.grad = grad
    _rehook(param)
    return param


def _rehook(param: Any) -> None:
    """A tensor's hooks live with its C++ tensor, which the swap exchanged: register them on the new one."""
    if getattr(param, "_backward_hooks", None) is not None:
        param._backward_hooks = param._backward_hooks
    if getattr(param, "_post_accumulate_grad_hooks", None) is not None:
        param._post_accumulate_grad_hooks = param._post_accumulate_grad_hooks
