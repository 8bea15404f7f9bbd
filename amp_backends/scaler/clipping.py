"""Gradient clipping through the scaler: unscale (if not done yet), measure, clip; the norms kept.

With torch's kernel this is ``unscale_`` followed by ``torch.nn.utils.clip_grad_norm_`` over the
optimizer's parameters, bit for bit (a fused optimizer then steps on the unscaled gradients, as in
torch's recipe); with a kernel that measures while it unscales (Triton), one pass that unscales,
checks and sums squares, then the multiply. It asks the scaler for four things only (:class:`ScalerForClipping`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch.amp.grad_scaler import OptState

from ..gradients.groups import ARENA_ATTR, group_by_device_and_dtype
from ..torch_private import foreach_mul_, foreach_norm

if TYPE_CHECKING:
    from ..gradients.arena import FlatGrads

__all__ = ["ScalerForClipping", "clip", "group_norms"]


class ScalerForClipping(Protocol):
    """What clipping needs of the scaler (:class:`~.scaler.GradScaler` implements it)."""

    def _clip_stage(self, optimizer: torch.optim.Optimizer) -> OptState:
        """READY (not unscaled yet this iteration), UNSCALED or STEPPED; UNSCALED with scaling off."""

    def _clip_unscale(self, optimizer: torch.optim.Optimizer,
                      with_norm: bool = False) -> tuple[FlatGrads | None, torch.Tensor | None]:
        """Unscale and check; the arena whose buffers were unscaled (or None), and with ``with_norm``
        the fp32 sum of squares of the unscaled gradients, measured in the same pass."""

    def _clip_one_pass(self) -> bool:
        """Whether the kernel measures the norm while it unscales."""

    def _clip_total(self, total: torch.Tensor) -> torch.Tensor:
        """The norm as the step will see it (inf where the scale underflowed)."""


def params_with_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters that have a gradient, sparse gradients coalesced (a clip
    counts each index once)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    for p in params:
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()
    return params


def group_norms(scaler: ScalerForClipping, optimizer: torch.optim.Optimizer, norm_type: float) -> tuple[torch.Tensor, ...]:
    """Each parameter group's gradient norm, unscaled, before the clip."""
    if scaler._clip_stage(optimizer) is OptState.READY:
        scaler._clip_unscale(optimizer)
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


def clip(scaler: ScalerForClipping, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float) -> torch.Tensor:
    """:meth:`GradScaler.clip_grad_norm_` once its arguments are checked: the total norm."""
    exact = getattr(optimizer, "clip_masters_", None)
    if exact is not None:  # float32 masters: the norm and the clip on their float32 gradients
        if scaler._clip_stage(optimizer) is OptState.READY:
            scaler._clip_unscale(optimizer)
        return scaler._clip_total(exact(max_norm, norm_type))
    arena: FlatGrads | None = getattr(optimizer, ARENA_ATTR, None)
    # without an arena, the walk (and sparse coalescing) comes first, as torch's recipe has it
    params = params_with_grads(optimizer) if arena is None else None
    stage = scaler._clip_stage(optimizer)
    if stage is not OptState.READY or not (norm_type == 2.0 and scaler._clip_one_pass()):
        if stage is OptState.READY:
            in_buffers, _ = scaler._clip_unscale(optimizer)  # the buffers hold the gradients, or not
        else:
            in_buffers = arena if arena is not None and arena.attached() else None
        if arena is not None and in_buffers is arena:
            total = _clip_flat(arena, max_norm, norm_type)
        else:
            holders = _dense_grad_holders(params_with_grads(optimizer) if params is None else params)
            total = torch.nn.utils.clip_grad_norm_(holders, max_norm, norm_type=norm_type)
        return scaler._clip_total(total)
    in_buffers, norm_sq = scaler._clip_unscale(optimizer, with_norm=True)
    assert norm_sq is not None
    total = scaler._clip_total(norm_sq.sqrt())
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if in_buffers is not None:
        for flat in in_buffers.groups:
            foreach_mul_([flat.buffer], coef.to(flat.device))
            flat.dirty = True  # the coefficient may be NaN
    else:
        if params is None:  # an arena whose gradients were not in place
            params = params_with_grads(optimizer)
        for (device, _), grads in group_by_device_and_dtype(p.grad for p in params).items():
            c = coef.to(device)
            foreach_mul_([g for g in grads if not g.is_sparse], c)
            for g in grads:
                if g.is_sparse:
                    g.mul_(c)
    return total


def _clip_flat(arena: FlatGrads, max_norm: float, norm_type: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` on an arena, with its results bit for bit: the same
    norms of the same views, stacked in the same order; the clip multiplies each whole buffer
    by the coefficient with the op torch uses per gradient (foreach where the device has it)."""
    from ..torch_private import device_has_foreach_support as _device_has_foreach_support

    norms: list[torch.Tensor] = []
    for flat in arena.groups:  # where torch loops over vector_norm, _foreach_norm runs that loop in C++
        views = flat.views()
        if views:
            norms.extend(foreach_norm(views, norm_type))
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for flat in arena.groups:
        c = coef.to(flat.device)
        if _device_has_foreach_support(flat.device):
            foreach_mul_([flat.buffer], c)
        else:
            flat.buffer.mul_(c)
        flat.dirty = True  # the coefficient may be NaN
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
