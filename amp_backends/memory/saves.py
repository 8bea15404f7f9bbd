"""Norms and softmax computed in float32 that keep what they save for backward in low precision.

Where a device's autocast runs ``layer_norm``, ``group_norm``, ``softmax`` or ``log_softmax`` in float32
(CUDA's lists, and the devices that reuse them), a low-precision input is upcast and the float32 copy
is what autograd saves: twice the bytes of the input it came from. :func:`low_precision_saves` makes
these modules save the low-precision input instead and upcast it again in backward. That is exact:
an upcast from bfloat16 or float16 to float32 is exact and the same every time, so the backward sees
the very float32 tensor autocast would have saved, and the gradients are bitwise the same. Under
``create_graph=True`` (a gradient penalty) the backward recomputes differentiably from the saved input,
so second-order terms reach the input and the norm's weight and bias as through autocast's own path. Only low-
precision inputs are affected (a float32 input is saved as it is: rounding it would change the
gradients), and only where autocast would run the op in float32 (on a CPU, autocast runs layer_norm
and softmax in the input's dtype already: nothing to gain, nothing changed). Asked of the device, once
per op: autocast is run on a small low-precision tensor and the output's dtype read.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import patches, torch_private
from ..eager import eager
from ..torch_private import DisableTorchDispatch

__all__ = ["LowPrecisionSaves", "autocast_runs_in_fp32", "low_precision_saves"]

_LOW = (torch.float16, torch.bfloat16)


@eager  # asked outside torch.compile: the answer is a fact of the device, not part of the graph
@functools.lru_cache(maxsize=None)
def autocast_runs_in_fp32(device_type: str, dtype: torch.dtype, op: str) -> bool:
    """Whether ``device_type``'s autocast in ``dtype`` runs ``op`` ("layer_norm", "group_norm",
    "softmax", "log_softmax") in float32 on a ``dtype`` input (asked of torch on a small tensor, unseen by
    the dispatch modes around the call: asked first inside a block under selective recomputation, whose
    cache of saved outputs is keyed by op and order, the probe's ops would be taken for the block's)."""
    with DisableTorchDispatch():
        return _runs_in_fp32(device_type, dtype, op)


def _runs_in_fp32(device_type: str, dtype: torch.dtype, op: str) -> bool:
    x = torch.ones(2, 4, dtype=dtype, device=device_type)
    with torch.autocast(device_type, dtype=dtype):
        if op == "layer_norm":
            out = F.layer_norm(x, (4,))
        elif op == "group_norm":
            out = F.group_norm(x.view(2, 4, 1), 2)
        elif op == "softmax":
            out = torch.softmax(x, -1)
        else:
            out = torch.log_softmax(x, -1)
    return out.dtype == torch.float32


class _Fp32SavingLow(torch.autograd.Function):
    """``fn(x.float(), *params)`` in float32, saving ``x`` (low precision) and ``params``; backward
    upcasts ``x`` again and differentiates ``fn`` there."""

    @staticmethod
    def forward(ctx: Any, fn: Any, x: torch.Tensor, *params: Any) -> torch.Tensor:
        ctx.fn = fn
        ctx.save_for_backward(x, *[p if isinstance(p, torch.Tensor) else None for p in params])
        ctx.plain = [None if isinstance(p, torch.Tensor) else p for p in params]
        with torch.no_grad():
            return fn(x.float(), *_upcast(params))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, *saved = ctx.saved_tensors
        params = [s if s is not None else p for s, p in zip(saved, ctx.plain)]
        needs = ctx.needs_input_grad[1:]
        higher = torch.is_grad_enabled()
        if higher:  # create_graph=True: differentiate the recomputation itself (second order kept)
            out = ctx.fn(x.float(), *_upcast(params))
            leaves = [x, *params]
        else:
            with torch.enable_grad():
                x32 = x.detach().float().requires_grad_(needs[0])
                leaves = [x32, *[p.detach().requires_grad_(need) if isinstance(p, torch.Tensor) else p
                                 for p, need in zip(params, needs[1:])]]
                out = ctx.fn(x32, *_upcast(leaves[1:]))
        wanted = [t for t, need in zip(leaves, needs) if need and isinstance(t, torch.Tensor)]
        with torch.enable_grad():
            got = torch.autograd.grad(out, wanted, grad, create_graph=higher,
                                      allow_unused=True) if wanted else ()
        grads = iter(got)
        result = [next(grads) if need and isinstance(t, torch.Tensor) else None for t, need in zip(leaves, needs)]
        if result[0] is not None:
            result[0] = result[0].to(x.dtype)
        return (None, *result)


def _upcast(params: Any) -> list[Any]:
    """The low-precision tensors among ``params`` in float32, as autocast casts every floating argument
    of an op it runs in float32 (a bfloat16 model's norm weights)."""
    return [p.float() if isinstance(p, torch.Tensor) and p.dtype in _LOW else p for p in params]


def _layer_norm(x: torch.Tensor, weight: Any, bias: Any, shape: Any, eps: float) -> torch.Tensor:
    return F.layer_norm(x, shape, weight, bias, eps)


def _group_norm(x: torch.Tensor, weight: Any, bias: Any, groups: int, eps: float) -> torch.Tensor:
    return F.group_norm(x, groups, weight, bias, eps)


def _softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.softmax(x, dim)


def _log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.log_softmax(x, dim)


class _SavesLow:
    """The forward of a norm or softmax module that saves its low-precision input (picklable)."""

    def __init__(self, module: nn.Module, previous: Any) -> None:
        self.module, self.previous = module, previous

    def _plain(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            return self._plain(*args, **kwargs)  # (called as ln(input=x): as the module's own forward takes it)
        m, x = self.module, args[0]
        device_type = x.device.type
        if (x.dtype not in _LOW or not torch.is_autocast_enabled(device_type)
                or torch.get_autocast_dtype(device_type) != x.dtype or _transformed()):
            return self._plain(x)
        if isinstance(m, nn.LayerNorm):
            op, fn, params = "layer_norm", _layer_norm, (m.weight, m.bias, tuple(m.normalized_shape), m.eps)
        elif isinstance(m, nn.GroupNorm):
            op, fn, params = "group_norm", _group_norm, (m.weight, m.bias, m.num_groups, m.eps)
        elif isinstance(m, nn.LogSoftmax):
            op, fn, params = "log_softmax", _log_softmax, (m.dim,)
        else:
            op, fn, params = "softmax", _softmax, (m.dim,)
        if not autocast_runs_in_fp32(device_type, x.dtype, op) or (op != "layer_norm" and op != "group_norm"
                                                                    and m.dim is None):  # (softmax's implicit dim)
            return self._plain(x)
        with torch.autocast(device_type, enabled=False):
            return _Fp32SavingLow.apply(fn, x, *params)


def _transformed() -> bool:
    """Inside ``torch.func``'s transforms or forward-mode AD, which an autograd Function needs rules of its
    own for (``setup_context``, ``vmap``, ``jvp``): there the op runs as autocast runs it."""
    active = torch_private.functorch_transforms_active
    return (active is not None and active()) or torch_private.forward_ad_active()


class LowPrecisionSaves(patches.Wrapped):
    """The modules :func:`low_precision_saves` changed; :meth:`remove` restores them."""

    kind = _SavesLow


#: The modules whose float32 computation keeps a low-precision input for backward.
TYPES = (nn.LayerNorm, nn.GroupNorm, nn.Softmax, nn.LogSoftmax)


def low_precision_saves(model: nn.Module) -> LowPrecisionSaves:
    """Make every LayerNorm, GroupNorm, Softmax and LogSoftmax of ``model`` save its low-precision
    input where autocast computes it in float32 (see the module docstring)."""
    changed = []
    for m in model.modules():
        if type(m) in TYPES and not isinstance(m.__dict__.get("forward"), _SavesLow):
            patches.wrap(m, "forward", _SavesLow(m, m.__dict__.get("forward")), scope="until LowPrecisionSaves.remove()",
                         cause="the float32 norm or softmax saves its low-precision input for backward")
            changed.append(m)
    return LowPrecisionSaves(changed)
