"""The bytes of the distinct storages autograd saves for backward while ``run()`` runs, counted by a
saved-tensor hook of the test's own (handed what the hooks beneath a lever's receive)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def saved_storage_bytes(run: Callable[[], Any]) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())
