"""The GradScaler: torch's ``torch.amp.GradScaler`` with the backend's gradient op.

Owns the scaler (:mod:`.scaler`, whose ``step`` reads top to bottom as torch's), how each optimizer's
step is treated (:mod:`.treatment`: a ``Treatment`` chosen once per optimizer), the step's branches
and the unscale they share (:mod:`.steps`), the gradient op over one optimizer (:mod:`.gradwork`),
clipping (:mod:`.clipping`), the counters (:mod:`.telemetry`), argument checks (:mod:`.validation`)
and agreement across ranks (:mod:`.consensus`).

May import: :mod:`amp_backends.registry`, :mod:`amp_backends.gradients`, :mod:`amp_backends.devices`,
:mod:`amp_backends.eager`, :mod:`amp_backends.errors`, :mod:`amp_backends.torch_private` and torch.
"""

from __future__ import annotations

from .scaler import GradScaler, ScalerStats

__all__ = ["GradScaler", "ScalerStats"]
