"""Old import paths: the flat package's module paths, each answered with the moved module itself, a
DeprecationWarning naming its new path, and the release that removes it.

One way in: ``import amp_backends.fused`` and the attribute ``amp_backends.fused`` are the same import
through :class:`MovedModules` (the attribute goes through the package's ``__getattr__``, which asks
:func:`moved`), with the same warning. ``amp_backends.check`` and ``amp_backends.info`` are old paths
like the others: import :mod:`amp_backends.inspector.check` and :mod:`amp_backends.cli.info`.

The device contract's older spellings are accepted at registration in
:mod:`amp_backends.devices.old_contract`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

PACKAGE = "amp_backends"


@dataclass(frozen=True)
class Moved:
    """Where an old module path lives now, and the release that stops answering the old one."""

    new: str
    removed_in: str

    def message(self, old: str) -> str:
        """The DeprecationWarning's text for ``amp_backends.<old>``."""
        return f"{PACKAGE}.{old} moved to {PACKAGE}.{self.new}: import it from there (the old path is removed in {self.removed_in})"


def _moved(removed_in: str, **paths: str) -> dict[str, Moved]:
    return {old: Moved(new, removed_in) for old, new in paths.items()}


#: Modules of the flat package (before the layout into packages by concern): old name -> new home.
MOVED_MODULES: dict[str, Moved] = _moved(
    "0.3",
    accelerator="devices.accelerator", fused="devices.fused", hardware="devices.hardware",
    arena="gradients.arena", flat="gradients.groups", kernels="gradients.kernel",
    hookspecs="registry.hookspecs",
    clipping="scaler.clipping", consensus="scaler.consensus", telemetry="scaler.telemetry",
    validation="scaler.validation",
    attribution="tracing.attribution", isolation="tracing.isolation", opcount="tracing.opcount",
    checkpoint_values="checkpoint.values",
    fp32_forward="precision.fp32_forward", selectors="precision.selectors",
    modules="precision.autocast_module", fp8="precision.fp8.engine", fp8_linear="precision.fp8.linear",
    fp8_policy="precision.fp8.convert",
    check="inspector.check", nonfinite="inspector.nonfinite", report="inspector.report",
    bench="cli.bench", bench_fp8="cli.bench_fp8", bench_models="cli.bench_models",
    check_cli="cli.check", demo="cli.demo", info="cli.info",
)


def moved(name: str) -> ModuleType | None:
    """``amp_backends.<name>`` as an attribute: the old path imported (with its warning) where ``name``
    is one, else None."""
    if name not in MOVED_MODULES:
        return None
    return importlib.import_module(f"{PACKAGE}.{name}")


class MovedModules(MetaPathFinder, Loader):
    """Import hook, last on ``sys.meta_path``, that answers the old paths in :data:`MOVED_MODULES`."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> ModuleSpec | None:
        package, _, old = fullname.partition(".")
        if package != PACKAGE or old not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        old = spec.name.partition(".")[2]
        entry = MOVED_MODULES[old]
        warnings.warn(entry.message(old), DeprecationWarning, stacklevel=2)
        module = importlib.import_module(f"{PACKAGE}.{entry.new}")
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module already ran at its new path: give it back the spec the import system replaced."""
        spec = module.__spec__
        module.__spec__ = spec.loader_state if spec is not None else None


def install() -> None:
    """Put :class:`MovedModules` last on ``sys.meta_path``, once per process."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
