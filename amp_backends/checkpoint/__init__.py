"""Training checkpoints saved and loaded safely: model, optimizer, scaler and the values in them.

Owns saving and loading (:mod:`.io`) and the checks of loaded values (:mod:`.values`).

May import: :mod:`amp_backends.errors` and torch.
"""

from __future__ import annotations

from .io import CheckpointError, check_destination, load, save

__all__ = ["CheckpointError", "check_destination", "load", "save"]
