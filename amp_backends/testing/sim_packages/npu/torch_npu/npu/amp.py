"""``torch_npu.npu.amp`` of the simulated torch_npu: what its GradScaler keeps in a checkpoint.

torch_npu's ``npu/amp/grad_scaler.py``: ``state_dict()`` is torch's plus ``"dynamic"`` (when
enabled), and ``load_state_dict()`` refuses an empty state_dict and requires ``"dynamic"`` (a
``KeyError`` without it). Only the checkpoint format is kept here: the scaling runs as torch's.
"""

from __future__ import annotations

from typing import Any

import torch


class GradScaler(torch.amp.GradScaler):
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, dynamic: bool = True) -> None:
        super().__init__("npu", init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)
        self._dynamic = dynamic

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._enabled:
            state["dynamic"] = self._dynamic
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        super().load_state_dict(state_dict)
        self._dynamic = state_dict["dynamic"]
