"""The Transformers Trainer on the backend's autocast and scaler.

    trainer = AmpTrainer(model=model, args=args, train_dataset=ds, amp_backend="cpu", amp_dtype=torch.float16)

The Trainer runs everything AMP through its Accelerator; :class:`AmpTrainer` applies
:func:`amp_backends.integrations.accelerate.prepare` to it as soon as it exists, so the logged
``grad_norm`` is the true (unscaled) norm, ``max_grad_norm`` clips unscaled gradients, steps with
inf/NaN gradients are skipped (and the LR scheduler with them), and ``scaler.pt`` in checkpoints
is the backend scaler's state. Leave ``fp16``/``bf16`` in ``TrainingArguments`` off: the dtype
is ``amp_dtype``.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from transformers import Trainer
except ImportError:  # pragma: no cover - exercised only without Transformers
    raise ImportError(
        "amp_backends.integrations.transformers needs Transformers: pip install 'amp-backends[transformers]'"
    ) from None

from ..backend import Backend
from ..scaler.scaler import GradScaler
from .accelerate import prepare

__all__ = ["AmpTrainer"]


class AmpTrainer(Trainer):
    """``transformers.Trainer`` whose mixed precision is an amp_backends backend's.

    Args beyond the Trainer's: ``amp_backend`` (name or Backend; default: the one serving the
    Trainer's device), ``amp_dtype`` (default: the backend's), ``amp_scaler_kwargs`` for
    :class:`amp_backends.GradScaler`.
    """

    def __init__(self, *args: Any, amp_backend: str | Backend | None = None,
                 amp_dtype: torch.dtype | str | None = None, amp_scaler_kwargs: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        self._amp_options = (amp_backend, amp_dtype, dict(amp_scaler_kwargs or {}))
        self.amp_scaler: GradScaler | None = None
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        backend, dtype, scaler_kwargs = self._amp_options
        self.amp_scaler = prepare(self.accelerator, backend, dtype, **scaler_kwargs)
