"""The hooks a plugin implements (see CONTRIBUTING.md for the reference)."""

from __future__ import annotations

from typing import Callable

import pluggy

PROJECT = "amp_backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def amp_backends_register_backends(register: Callable[..., None]) -> None:
    """Register backends: call ``register(backend, override=False, fallback=False)`` once per Backend instance."""


@hookspec
def amp_backends_register_kernels(register: Callable[..., None]) -> None:
    """Register gradient kernels: call ``register(kernel)`` once per Kernel instance."""
