"""amp_backends: one mixed-precision API (autocast, GradScaler) for every PyTorch device.

    be = amp_backends.get()          # best available backend, or get("cpu"), get("cuda"), ...
    scaler = be.grad_scaler()
    with be.autocast():
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec
    from types import ModuleType

#: Submodules reached as attributes, imported on first use: name -> module.
_LAZY_SUBMODULES = {"check": "inspector.check", "checkpoint": "checkpoint", "distributed": "distributed",
                    "info": "cli.info", "memory": "memory", "testing": "testing"}
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
    """``amp_backends.GradScaler``, ``precision_policy``, ``distributed`` and friends, imported on first use."""
    import importlib

    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{_LAZY_SUBMODULES[name]}")
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY_NAMES[name]}"), name)
        globals()[name] = value  # asked once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_NAMES) | set(_LAZY_SUBMODULES))


#: Modules that moved into the packages by concern: old name -> where it lives now. Importing the old
#: path gives the module itself (the same object), with a DeprecationWarning naming the new path.
_MOVED_MODULES = {
    "accelerator": "devices.accelerator", "fused": "devices.fused", "hardware": "devices.hardware",
    "arena": "gradients.arena", "flat": "gradients.groups", "kernels": "gradients.kernel",
    "hookspecs": "registry.hookspecs",
    "clipping": "scaler.clipping", "consensus": "scaler.consensus", "telemetry": "scaler.telemetry",
    "validation": "scaler.validation",
    "attribution": "tracing.attribution", "isolation": "tracing.isolation", "opcount": "tracing.opcount",
    "checkpoint_values": "checkpoint.values",
    "fp32_forward": "precision.fp32_forward", "selectors": "precision.selectors",
    "modules": "precision.autocast_module", "fp8": "precision.fp8.engine", "fp8_linear": "precision.fp8.linear",
    "fp8_policy": "precision.fp8.convert",
    "check": "inspector.check", "nonfinite": "inspector.nonfinite", "report": "inspector.report",
    "bench": "cli.bench", "bench_fp8": "cli.bench_fp8", "bench_models": "cli.bench_models",
    "check_cli": "cli.check", "demo": "cli.demo", "info": "cli.info",
}


class _MovedModules:
    """Import hook, last on ``sys.meta_path``, that answers the old paths in ``_MOVED_MODULES``."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        package, _, old = fullname.partition(".")
        if package != __name__ or old not in _MOVED_MODULES:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        import importlib
        import warnings

        new = f"{__name__}.{_MOVED_MODULES[spec.name.partition('.')[2]]}"
        warnings.warn(f"{spec.name} moved to {new}: import it from there", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module already ran at its new path: give it back the spec the import system replaced."""
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())


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
