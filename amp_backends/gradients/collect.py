"""An optimizer's gradients as the op takes them: grouped by (device, dtype), from its
:func:`~amp_backends.flat_grads` arena when the gradients are in the buffers, else after one walk
over the parameters (torch's per-tensor path)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .groups import ARENA_ATTR, FP16_PARAMS, GradGroup, TensorGroup

if TYPE_CHECKING:
    from .arena import FlatGrads

__all__ = ["FP16_PARAMS", "collect", "groups_of", "walk"]


def collect(optimizer: torch.optim.Optimizer, allow_fp16: bool, for_norm: bool) -> tuple[list[GradGroup], FlatGrads | None]:
    """The gradients of ``optimizer``, and the arena they came from (None: a walk found them)."""
    arena: FlatGrads | None = getattr(optimizer, ARENA_ATTR, None)
    if arena is not None:
        groups = arena.groups_for_op(allow_fp16)
        if groups is not None:
            return list(groups), arena
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
    return [TensorGroup(d, t, grads) for d, by_dtype in groups.items() for t, grads in by_dtype.items()]


def groups_of(tensors: list[torch.Tensor]) -> list[GradGroup]:
    """``tensors`` grouped by device then dtype, in order of appearance, as the walk groups gradients."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return [TensorGroup(d, dt, ts) for (d, dt), ts in groups.items()]
