"""Module wrappers for mixed precision where autocast state does not follow the code.

Autocast state is thread-local: ``nn.DataParallel`` runs each replica's forward in a
worker thread, where an autocast entered in the main thread does not apply. Wrapping the
module makes its forward enter the backend's autocast itself, in whatever thread it runs.
"""

from __future__ import annotations

from typing import Any

import torch

from .backend import Backend
from .registry import get

__all__ = ["AutocastModule", "autocast_module"]


class AutocastModule(torch.nn.Module):
    """Runs ``module``'s forward under ``backend.autocast(dtype)`` in the calling thread."""

    def __init__(self, module: torch.nn.Module, backend: str | Backend | None = None, dtype: torch.dtype | str | None = None) -> None:
        super().__init__()
        be = backend if isinstance(backend, Backend) else get(backend)
        self.module = module
        self.backend_name = be.name
        self.dtype = be.resolve_dtype(dtype)
        self._backend = be

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._backend.autocast(self.dtype):
            return self.module(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"backend={self.backend_name!r}, dtype={self.dtype}"


def autocast_module(module: torch.nn.Module, backend: str | Backend | None = None, dtype: torch.dtype | str | None = None) -> AutocastModule:
    """Wrap ``module`` so that its forward always runs under the backend's autocast,
    e.g. ``nn.DataParallel(autocast_module(model, "cuda"))``."""
    return AutocastModule(module, backend, dtype)
