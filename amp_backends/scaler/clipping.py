"""Gradient clipping through the scaler: unscale (if not done yet), measure, clip; the norms kept.

With torch's kernel this is ``unscale_`` followed by ``torch.nn.utils.clip_grad_norm_`` over the
optimizer's parameters, bit for bit (a fused optimizer then steps on the unscaled gradients, as in
torch's recipe); with a kernel that measures while it unscales (Triton), one pass that unscales,
checks and sums squares, then the multiply.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from ..gradients.arena import FlatGrads, flat_grads_of
from ..backend import group_by_device_and_dtype

#: The amp_backends.GradScaler doing the clip (typed loosely: this module sits below the scaler).
GradScaler = Any

__all__ = ["clip", "group_norms"]


def params_with_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters that have a gradient, sparse gradients coalesced (a clip
    counts each index once)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    for p in params:
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()
    return params


def group_norms(scaler: GradScaler, optimizer: torch.optim.Optimizer, norm_type: float) -> tuple[torch.Tensor, ...]:
    """Each parameter group's gradient norm, unscaled, before the clip."""
    if scaler._stage(optimizer) is OptState.READY:
        scaler._unscale(optimizer)
    norms = []
    for group in optimizer.param_groups:
        grads = [p.grad for p in group["params"] if p.grad is not None]
        if not grads:
            norms.append(torch.zeros(()))
            continue
        dense = [g.coalesce()._values() if g.is_sparse else g for g in grads]
        per = [torch.linalg.vector_norm(g.float(), norm_type).to(dense[0].device) for g in dense]
        norm = torch.linalg.vector_norm(torch.stack(per), norm_type)
        norms.append(norm)
    return tuple(norms)


def clip(scaler: GradScaler, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float) -> torch.Tensor:
    """:meth:`GradScaler.clip_grad_norm_` once its arguments are checked: the total norm."""
    arena = flat_grads_of(optimizer)
    # without an arena, the walk (and sparse coalescing) comes first, as torch's recipe has it
    params = params_with_grads(optimizer) if arena is None else None
    stage = scaler._stage(optimizer)
    if stage is not OptState.READY or not (norm_type == 2.0 and scaler.backend.kernel.one_pass_norm):
        if stage is OptState.READY:
            scaler._unscale(optimizer)  # sets scaler._arena: the buffers hold the gradients, or not
        elif arena is not None:
            scaler._arena = arena if arena.attached() else None
        if arena is not None and scaler._arena is arena:
            total = _clip_flat(arena, max_norm, norm_type)
        else:
            holders = _dense_grad_holders(params_with_grads(optimizer) if params is None else params)
            total = torch.nn.utils.clip_grad_norm_(holders, max_norm, norm_type=norm_type)
        return scaler._inf_when_scale_underflowed(total)
    scale, _ = scaler._check_scale_growth_tracker("clip_grad_norm_")
    state = scaler._per_optimizer_states[id(optimizer)]
    inv_scale = scaler._inv_scale(scale)
    norm_sq = torch.zeros((), dtype=torch.float32, device=scale.device)
    found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
    state["found_inf_per_device"] = scaler._grad_op(optimizer, inv_scale, found_inf, False, norm_sq)
    total = scaler._inf_when_scale_underflowed(norm_sq.sqrt())
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if scaler._arena is not None:
        for flat in scaler._arena.groups:
            torch._foreach_mul_([flat.buffer], coef.to(flat.device))
        scaler._arena.after_multiply()
    else:
        if params is None:  # an arena whose gradients were not in place
            params = params_with_grads(optimizer)
        for (device, _), grads in group_by_device_and_dtype(p.grad for p in params).items():
            c = coef.to(device)
            torch._foreach_mul_([g for g in grads if not g.is_sparse], c)
            for g in grads:
                if g.is_sparse:
                    g.mul_(c)
    state["stage"] = OptState.UNSCALED
    return total


def _clip_flat(arena: FlatGrads, max_norm: float, norm_type: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` on an arena, with its results bit for bit: the same
    norms of the same views, stacked in the same order; the clip multiplies each whole buffer
    by the coefficient with the op torch uses per gradient (foreach where the device has it)."""
    from torch.utils._foreach_utils import _device_has_foreach_support

    norms: list[torch.Tensor] = []
    for flat in arena.groups:  # where torch loops over vector_norm, _foreach_norm runs that loop in C++
        views = flat.views()
        if views:
            norms.extend(torch._foreach_norm(views, norm_type))
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for flat in arena.groups:
        c = coef.to(flat.device)
        if _device_has_foreach_support(flat.device):
            torch._foreach_mul_([flat.buffer], c)
        else:
            flat.buffer.mul_(c)
    arena.after_multiply()
    return total


def _dense_grad_holders(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` for ``torch.nn.utils.clip_grad_norm_``, which cannot measure sparse gradients:
    each sparse (coalesced) gradient is stood in for by a holder whose ``.grad`` is an alias
    of its values, so the norm counts each index once and the clip scales it in place."""
    if not any(p.grad.is_sparse for p in params):
        return params
    holders = []
    for p in params:
        if p.grad.is_sparse:
            values = p.grad._values()
            holder = torch.empty_like(values)
            holder.grad = values
            p = holder
        holders.append(p)
    return holders
