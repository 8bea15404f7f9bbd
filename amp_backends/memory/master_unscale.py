"""The scaler's float16 path for an optimizer with float32 masters: ``unscale_`` divides each
low-precision gradient in float32 into a float32 gradient kept for the step (no small value lost), and
``clip_grad_norm_`` clips those; the parameters' gradients hold the results rounded (what clipping by
hand and logging read). :class:`~.master.MasterWeights` takes it as a mixin; the scaler finds the two
methods (``unscale_masters_``, ``clip_masters_``) on the optimizer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..torch_private import foreach_copy_
from .master_buffers import float32_grads, grad_key, grads_of, norm, scale_

__all__ = ["ExactUnscale"]


class ExactUnscale:
    """The float16 path's two methods; the class mixing it in keeps ``masters`` (parameter -> float32
    master), ``_exact`` (parameter -> (exact float32 gradient, :func:`.master_buffers.grad_key` of its gradient then)) and
    ``_params()`` (the optimizer's parameters, in order)."""

    masters: dict[nn.Parameter, torch.Tensor]
    _exact: dict[nn.Parameter, tuple[torch.Tensor, tuple[Any, int]]]

    def _params(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def sync(self) -> Any:
        raise NotImplementedError

    @torch.no_grad()
    def unscale_masters_(self, inv_scale: torch.Tensor, norm_sq: torch.Tensor | None = None) -> None:
        """The scaler's ``unscale_`` for this optimizer: each low-precision gradient divided in float32
        into a float32 gradient kept for the step (no small value lost), the parameter's gradient holding
        its rounding (what clipping and logging read); float32 parameters' gradients divided in place.
        With ``norm_sq``, adds the float32 sum of squares of the unscaled gradients."""
        self.sync()
        low = [p for p in self.masters if p.grad is not None]
        wide = float32_grads(grads_of(low), inv_scale)
        plain = [p.grad for p in self._params() if p not in self.masters and p.grad is not None]
        scale_(plain, inv_scale)
        if low:
            foreach_copy_(grads_of(low), wide)
        self._exact = {p: (w, grad_key(p)) for p, w in zip(low, wide)}
        if norm_sq is not None:
            grads = [self._exact[p][0] if p in self._exact else p.grad for p in self._params() if p.grad is not None]
            norm_sq.add_(norm(grads, 2.0).to(norm_sq.device).square())

    @torch.no_grad()
    def clip_masters_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """The scaler's ``clip_grad_norm_`` for this optimizer, after :meth:`unscale_masters_`: the total
        norm of the float32 gradients (torch's formula), each scaled by torch's clip coefficient; the
        parameters' gradients hold the result rounded. Returns the total norm."""
        exact = self._exact
        low = [p for p in exact if p.grad is not None and exact[p][1] == grad_key(p)]
        wide = [self._exact[p][0] for p in low]
        # in the optimizer's order, as torch's clip over the same parameters sums them
        kept = set(low)
        grads = [exact[p][0] if p in kept else p.grad for p in self._params() if p.grad is not None]
        total = norm(grads, norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        scale_(grads, coef)
        if low:
            foreach_copy_(grads_of(low), wide)
        self._exact = {p: (w, grad_key(p)) for p, w in zip(low, wide)}
        return total
