"""An optimizer's gradients as the scaler's one backend op takes them: grouped by (device, dtype),
from its :func:`~amp_backends.flat_grads` arena when the gradients are in the buffers, else after one
walk over the parameters (torch's per-tensor path)."""

from __future__ import annotations

import torch

from .arena import FlatGrads, flat_grads_of
from .groups import GradGroup

__all__ = ["FP16_PARAMS", "collect", "walk"]

FP16_PARAMS = (
    "Attempting to unscale FP16 gradients: the parameters themselves are float16. Keep parameters "
    "in float32 and let autocast lower the compute, or use bf16 without a scaler."
)


def collect(optimizer: torch.optim.Optimizer, allow_fp16: bool, for_norm: bool) -> tuple[list[GradGroup], FlatGrads | None]:
    """The gradients of ``optimizer``, and the arena they came from (None: a walk found them)."""
    arena = flat_grads_of(optimizer)
    if arena is not None and arena.attached():
        if not arena.has_gradients():
            return [], arena  # torch's path finds no gradient either: its step raises, as torch's does
        if not allow_fp16 and any(g.dtype == torch.float16 for g in arena.groups):
            raise ValueError(FP16_PARAMS)  # before any buffer is touched: a refusal changes nothing
        return list(arena.groups), arena
    return walk(optimizer, allow_fp16, for_norm), None


def walk(optimizer: torch.optim.Optimizer, allow_fp16: bool, for_norm: bool) -> list[GradGroup]:
    """The one walk over the gradients, grouped by device then dtype in order of appearance."""
    groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            dtype = grad.dtype
            if dtype is torch.float16 and not allow_fp16:
                raise ValueError(FP16_PARAMS)
            if grad.is_sparse:
                # coalesce where duplicates matter: fp16 sums may overflow, norms count each index once
                if dtype is torch.float16 or for_norm:
                    param.grad = grad = grad.coalesce()
                grad = grad._values()
            by_dtype = groups.get(grad.device)
            if by_dtype is None:
                by_dtype = groups[grad.device] = {}
            bucket = by_dtype.get(dtype)
            if bucket is None:
                by_dtype[dtype] = bucket = []
            bucket.append(grad)
    return [(d, t, grads) for d, by_dtype in groups.items() for t, grads in by_dtype.items()]
