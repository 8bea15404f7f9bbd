"""Adapters for the frameworks users already train with; each module is imported only when used.

- ``amp_backends.integrations.lightning.AmpPrecision``: a Precision plugin for Lightning's
  Fabric and Trainer (``pip install "amp-backends[lightning]"``);
- ``amp_backends.integrations.accelerate.prepare``: makes an HF ``Accelerator`` (and so the
  Transformers ``Trainer``, through ``AmpTrainer`` or ``AmpTrainerCallback``) use the backend's
  autocast and scaler (``[accelerate]``);
- ``amp_backends.integrations.timm.NativeScaler``: timm's loss-scaler calling convention (``[timm]``).

May import: :mod:`amp_backends.backend`, :mod:`amp_backends.scaler`, :mod:`amp_backends.registry`,
:mod:`amp_backends.errors` and the framework each adapter is for, imported when used.
"""

from __future__ import annotations

from typing import Any

import torch

from ..backend import Backend
from ..registry.registry import resolve_backend
from ..scaler.scaler import GradScaler, ScalerStats

__all__ = ["ScalerSignals", "resolve"]


def resolve(
    backend: str | Backend | None, dtype: torch.dtype | str | None, scaler_kwargs: dict[str, Any]
) -> tuple[Backend, torch.dtype, GradScaler]:
    """The backend, its autocast dtype and the scaler for that dtype (scaling only for fp16;
    bf16 gets the free scaler, which ``check_finite=True`` turns into a skip-on-inf guard)."""
    be = resolve_backend(backend)
    resolved = be.resolve_dtype(dtype)
    return be, resolved, be.grad_scaler(resolved, **scaler_kwargs)


class ScalerSignals:
    """What an adapter exposes of its ``scaler``: checkpoint state and the skip signals."""

    scaler: GradScaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state_dict)

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped for inf/NaN gradients."""
        return self.scaler.last_step_skipped

    @property
    def stats(self) -> ScalerStats:
        """The scaler's counters: steps, skipped steps, overflows, scale."""
        return self.scaler.stats
