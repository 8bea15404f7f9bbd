"""Module wrappers for mixed precision where autocast state does not follow the code.

Autocast state is thread-local: ``nn.DataParallel`` runs each replica's forward in a
worker thread, where an autocast entered in the main thread does not apply. Wrapping the
module makes its forward enter the backend's autocast itself, in whatever thread it runs.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..backend import Backend
from ..registry.registry import get
from ..torch_private import tree_leaves

__all__ = ["AutocastModule", "autocast_module"]


class AutocastModule(torch.nn.Module):
    """Runs ``module``'s forward under ``backend.autocast(dtype)`` in the calling thread.

    The first forward checks that the module's parameters and floating inputs are on the
    backend's device type, and warns once (naming both) where they are not: autocast would
    leave their ops in full precision."""

    def __init__(self, module: torch.nn.Module, backend: str | Backend | None = None, dtype: torch.dtype | str | None = None) -> None:
        super().__init__()
        be = backend if isinstance(backend, Backend) else get(backend)
        self.module = module
        self.backend_name = be.name
        self.dtype = be.resolve_dtype(dtype)
        self._backend = be

    #: whether the first forward compared the module's and inputs' devices with the backend's
    _checked = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._checked:
            self._checked = True
            self._warn_on_other_devices(args, kwargs)
        with self._backend.autocast(self.dtype):
            return self.module(*args, **kwargs)

    def _warn_on_other_devices(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Once, at the first forward: autocast only lowers ops of its own device type, so a
        module or inputs on another device would run in full precision without a word."""
        want = self._backend.device_type
        where = {"parameters": {t.device.type for t in self.module.parameters()},
                 "inputs": {t.device.type for t in tree_leaves((args, kwargs))
                            if isinstance(t, torch.Tensor) and t.is_floating_point()}}
        for what, types in where.items():
            other = sorted(types - {want})
            if other:
                warnings.warn(
                    f"AutocastModule: backend {self.backend_name!r} autocasts {want} ops, but the wrapped module's "
                    f"{what} are on {', '.join(other)}: those ops run without autocast, in full precision. Wrap "
                    f"with the backend of that device (autocast_module(model, {other[0]!r})) or move the module "
                    f"and its inputs to {want}.",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return

    def extra_repr(self) -> str:
        return f"backend={self.backend_name!r}, dtype={self.dtype}"


def autocast_module(module: torch.nn.Module, backend: str | Backend | None = None, dtype: torch.dtype | str | None = None) -> AutocastModule:
    """Wrap ``module`` so that its forward always runs under the backend's autocast,
    e.g. ``nn.DataParallel(autocast_module(model, "cuda"))``."""
    return AutocastModule(module, backend, dtype)
