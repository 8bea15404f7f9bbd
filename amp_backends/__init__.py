"""amp_backends: one mixed-precision API (autocast, GradScaler) for every PyTorch device.

    be = amp_backends.get()          # best available backend, or get("cpu"), get("cuda"), ...
    scaler = be.grad_scaler()
    with be.autocast():
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
"""

from __future__ import annotations

from .gradients.arena import FlatGrads, flat_grads
from .backend import Backend
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
from .registry.hookspecs import hookimpl, hookspec
from .gradients.kernel import Kernel, TorchKernel
from .precision.autocast_module import AutocastModule, autocast_module
from .precision.policy import RECIPE, PrecisionPolicy, precision_policy
from .registry.registry import available, get, names, plugins, register_plugin, reload, reprobe
from .scaler.scaler import GradScaler, ScalerStats

__version__ = "0.1.0"


#: Submodules reached as attributes, imported on first use: name -> module.
_LAZY_SUBMODULES = {"check": "inspector.check", "checkpoint": "checkpoint", "distributed": "distributed",
                    "info": "cli.info", "testing": "testing"}
#: The inspector's names, imported on first use: name -> module.
_LAZY_NAMES = {"check_model": "inspector.check", "ModelReport": "inspector.report",
               "detect_nonfinite": "inspector.nonfinite", "NonFiniteReport": "inspector.nonfinite"}


def __getattr__(name: str) -> object:
    """``amp_backends.distributed``, ``check_model`` and friends, imported on first use (keeps import cheap)."""
    import importlib

    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{_LAZY_SUBMODULES[name]}")
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "AmpBackendsError",
    "AutocastModule",
    "Backend",
    "BackendUnavailableError",
    "DuplicateBackendError",
    "FlatGrads",
    "GradScaler",
    "Kernel",
    "ModelReport",
    "NonFiniteReport",
    "PerformanceWarning",
    "PluginLoadError",
    "PrecisionPolicy",
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
    "names",
    "plugins",
    "precision_policy",
    "register_plugin",
    "reload",
    "reprobe",
]
