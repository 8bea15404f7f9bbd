"""amp_backends: one mixed-precision API (autocast, GradScaler) for every PyTorch device.

    be = amp_backends.get()          # best available backend, or get("cpu"), get("cuda"), ...
    scaler = be.grad_scaler()
    with be.autocast():
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
"""

from __future__ import annotations

from . import compat
from .backend import Backend, get
from .devices.capabilities import OverflowStatus
from .devices.contract import ComputedMapping
from .errors import (
    AmpBackendsError,
    BackendUnavailableError,
    DuplicateBackendError,
    PerformanceWarning,
    PluginLoadError,
    StateDictError,
    UnknownBackendError,
    UnsupportedDtypeError,
)
from .extension import ExtensionBackend
from .gradients.kernel import Kernel, TorchKernel
from .registry.hookspecs import hookimpl, hookspec
from .registry.registry import available, names, plugins, register_plugin, reload, reprobe

__version__ = "0.1.0"

compat.install()  # the flat package's old module paths, each with the release that removes it

#: Submodules reached as attributes, imported on first use: name -> module.
_LAZY_SUBMODULES = {"checkpoint": "checkpoint", "distributed": "distributed", "memory": "memory", "testing": "testing"}
#: What a training loop may not use, imported on first use (keeps ``import amp_backends`` cheap): name -> module.
_LAZY_NAMES = {
    "GradScaler": "scaler.scaler", "ScalerStats": "scaler.telemetry",
    "FlatGrads": "gradients.arena", "flat_grads": "gradients.arena",
    "RECIPE": "precision.policy", "PrecisionPolicy": "precision.policy", "precision_policy": "precision.policy",
    "QuantStats": "precision.stats", "quant_stats": "precision.stats",
    "PrecisionPlan": "precision.plan", "plan_precision": "precision.planner",
    "AutocastModule": "precision.autocast_module", "autocast_module": "precision.autocast_module",
    "memory_lean": "memory.lean", "Lean": "memory.lean",
    "check_model": "inspector.check", "ModelReport": "inspector.report",
    "detect_nonfinite": "inspector.nonfinite", "NonFiniteReport": "inspector.nonfinite",
}


def __getattr__(name: str) -> object:
    """``amp_backends.GradScaler``, ``precision_policy``, ``distributed`` and friends, imported on first use;
    an old module path (``amp_backends.check``) the way ``import`` answers it (:mod:`.compat`)."""
    import importlib

    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{_LAZY_SUBMODULES[name]}")
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY_NAMES[name]}"), name)
        globals()[name] = value  # asked once
        return value
    old = compat.moved(name)
    if old is not None:
        return old
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_NAMES) | set(_LAZY_SUBMODULES))


__all__ = [
    "AmpBackendsError",
    "AutocastModule",
    "Backend",
    "BackendUnavailableError",
    "ComputedMapping",
    "DuplicateBackendError",
    "ExtensionBackend",
    "FlatGrads",
    "GradScaler",
    "Kernel",
    "Lean",
    "ModelReport",
    "NonFiniteReport",
    "OverflowStatus",
    "PerformanceWarning",
    "PluginLoadError",
    "PrecisionPlan",
    "PrecisionPolicy",
    "QuantStats",
    "RECIPE",
    "ScalerStats",
    "StateDictError",
    "TorchKernel",
    "UnknownBackendError",
    "UnsupportedDtypeError",
    "__version__",
    "autocast_module",
    "available",
    "check_model",
    "detect_nonfinite",
    "flat_grads",
    "get",
    "hookimpl",
    "hookspec",
    "memory_lean",
    "names",
    "plugins",
    "plan_precision",
    "precision_policy",
    "quant_stats",
    "register_plugin",
    "reload",
    "reprobe",
]
