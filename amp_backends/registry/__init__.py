"""Plugin discovery: the ``amp_backends`` entry points, the backends and kernels they register.

Owns the hook specifications (:mod:`.hookspecs`) and the registry (:mod:`.registry`).

May import: :mod:`amp_backends.gradients`, :mod:`amp_backends.devices`, :mod:`amp_backends.errors`,
:mod:`amp_backends.patches` and pluggy.
"""

from __future__ import annotations

from .registry import (
    PluginRecord,
    Registry,
    available,
    default_registry,
    get,
    kernel_for,
    names,
    plugins,
    probe,
    probe_timeout,
    register_plugin,
    reload,
    reprobe,
    resolve_backend,
    shadowing_message,
)

__all__ = ["PluginRecord", "Registry", "available", "default_registry", "get", "kernel_for", "names", "plugins",
           "probe", "probe_timeout", "register_plugin", "reload", "reprobe", "resolve_backend", "shadowing_message"]
