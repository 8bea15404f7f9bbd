"""The scaler's checkpoints: torch's ``state_dict`` (with torch_npu's ``"dynamic"`` where the backend
needs it), a malformed one refused with nothing changed, and pickling by backend name."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from ..registry.registry import get, registered
from .gradwork import GradientOp
from .validation import f32, validate_state_dict

__all__ = ["Checkpointing"]


class Checkpointing(torch.amp.GradScaler):
    """What :class:`~.scaler.GradScaler` saves and loads, over torch's scaler."""

    _dynamic: bool
    _grads: GradientOp
    _telemetry: Any
    backend: Any

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict; plus ``"dynamic"`` (whether the scale moves) where the backend says
        its vendor's scaler requires it to load one (torch_npu's; torch's ignores the extra key)."""
        state = super().state_dict()
        if self._enabled and self.backend.state_dict_dynamic:
            state["dynamic"] = self._dynamic
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state_dict from this scaler, ``torch.amp.GradScaler`` or torch_npu's scaler (whose
        ``"dynamic"`` is taken, as torch_npu takes it); a malformed one raises StateDictError and
        changes nothing."""
        if not self._enabled:
            return
        values = validate_state_dict(state_dict)
        super().load_state_dict(values)
        self._dynamic = values.get("dynamic", self._dynamic)
        self._telemetry.mirror = (f32(values["scale"]), values["_growth_tracker"])

    def __getstate__(self) -> dict[str, Any]:
        pg = self._grads.process_group
        if pg is not None and pg != "world":
            raise TypeError(
                "a GradScaler holding a process group object cannot be pickled: pickle its state_dict(), "
                "or build it with process_group='world'."
            )
        state = super().__getstate__()
        state["backend"] = self.backend.name  # resolved again from the registry on load
        state["_grads"] = pg
        state["_treatments"] = None
        state.pop("_unscaled_refs", None)  # (weak references: the optimizers stay behind)
        state["_telemetry"] = self._telemetry.for_pickling(self._enabled, state["_init_scale"],
                                                           state.get("_init_growth_tracker", 0))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        enabled = state.get("_enabled", True) or state.get("_check_finite", False)
        state["backend"] = get(state["backend"]) if enabled else (registered(state["backend"]) or get(state["backend"]))
        state["_grads"] = GradientOp(state["backend"], state["_grads"])
        state.pop("_plans", None)  # pickled before the treatments replaced the plans
        state["_treatments"] = weakref.WeakKeyDictionary()
        super().__setstate__(state)

