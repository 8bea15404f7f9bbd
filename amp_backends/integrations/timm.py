"""timm: its ``loss_scaler`` calling convention on the backend's scaler.

    loss_scaler = NativeScaler("cpu", torch.float16)
    loss_scaler(loss, optimizer, clip_grad=1.0, clip_mode="norm", parameters=model.parameters())
    checkpoint[loss_scaler.state_dict_key] = loss_scaler.state_dict()

timm's own ``NativeScaler`` builds ``torch.amp.GradScaler(device=...)`` and, where that fails,
falls back to fp16 with no loss scaling at all; this one always scales on the backend (or, for
bf16, is the free scaler, with ``check_finite=True`` to skip inf/NaN steps). timm itself is not
imported except for ``clip_mode="agc"`` (its adaptive gradient clipping).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..backend import Backend
from . import ScalerSignals, resolve

__all__ = ["NativeScaler"]

_CLIP_MODES = ("norm", "value", "agc")


class NativeScaler(ScalerSignals):
    """timm's ``NativeScaler`` protocol: ``__call__``, ``state_dict``, ``load_state_dict``, ``state_dict_key``."""

    state_dict_key = "amp_scaler"

    def __init__(self, backend: str | Backend | None = None, dtype: torch.dtype | str | None = None,
                 **scaler_kwargs: Any) -> None:
        self.backend, self.dtype, self.scaler = resolve(backend, dtype, scaler_kwargs)

    def __call__(
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        clip_grad: float | None = None,
        clip_mode: str = "norm",
        parameters: Iterable[torch.Tensor] | None = None,
        create_graph: bool = False,
        need_update: bool = True,
    ) -> None:
        """Backward the scaled loss; then, when ``need_update`` (the last micro-batch), clip the
        unscaled gradients if asked, step (skipped on inf/NaN) and update the scale."""
        if clip_mode not in _CLIP_MODES:
            raise ValueError(f"clip_mode must be one of {', '.join(_CLIP_MODES)}, got {clip_mode!r}")
        if clip_grad is not None and parameters is None:
            raise ValueError("clip_grad needs the parameters to clip: pass parameters=model.parameters()")
        if clip_grad is not None and clip_mode == "agc":
            _agc()  # refused before the backward and the unscale, not after them
        self.scaler.scale(loss).backward(create_graph=create_graph)
        if not need_update:
            return
        if clip_grad is not None:
            assert parameters is not None
            self.scaler.ensure_unscaled_(optimizer)
            _clip(list(parameters), clip_grad, clip_mode)
        self.scaler.step(optimizer)
        self.scaler.update()


def _clip(parameters: list[torch.Tensor], value: float, mode: str) -> None:
    if mode == "norm":
        torch.nn.utils.clip_grad_norm_(parameters, value)
    elif mode == "value":
        torch.nn.utils.clip_grad_value_(parameters, value)
    else:
        _agc()(parameters, value)


def _agc() -> Any:
    """timm's adaptive gradient clipping, or the error naming what to install."""
    try:
        from timm.utils.agc import adaptive_clip_grad
    except ImportError:
        raise ValueError("clip_mode='agc' is timm's adaptive clipping: install timm") from None
    return adaptive_clip_grad
