"""The package's layout keeps its rules: packages by concern in layers, each importing only the ones
below it (function-level imports count), no import circles, no service locator, and modules and
classes of a size a newcomer can read."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import amp_backends

from fp8_marks import NO_FP8

PACKAGE = Path(amp_backends.__file__).resolve().parent

#: The layers, lowest first: a module may import its own package and the packages of lower layers.
LAYERS: list[set[str]] = [
    {"torch_private"},                        # torch's private names, each resolved once
    {"errors", "eager", "console",            # base utilities; old import paths; reversible patches
     "compat", "patches"},
    {"devices"},                              # what a device is: the declarative contract
    {"gradients"},                            # the gradient op: kernels, executor, arena
    {"registry"},                             # plugin discovery: backends and kernels
    {"scaler"},                               # the GradScaler and its step plans
    {"backend"},                              # Backend: a device with grad_scaler() and its kernel
    {"extension"},                            # ExtensionBackend: the base of PrivateUse1 vendors' backends
    {"tracing", "checkpoint"},                # running a model to see what it does; checkpoints
    {"precision", "distributed"},             # per-layer precision and fp8; process groups
    {"memory"},                               # the memory ledger and memory-lean mixed precision
    {"inspector", "integrations"},            # check_model; Lightning, Accelerate, timm, Transformers
    {"cli", "testing"},                       # the command line and tools; the conformance suite
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _name(path: Path) -> str:
    parts = ("amp_backends",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports: ``from .x import y`` is ``x.y`` where that is a module, else ``x``."""
    tree = ast.parse(path.read_text())
    here = _name(path).split(".")
    base = here if path.name == "__init__.py" else here[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("amp_backends"):
                mod = node.module
            else:
                continue
            for a in node.names:
                found.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("amp_backends."))
    return found


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in PACKAGE.rglob("*.py") if "sim_packages" not in p.parts and p.stem != "__main__"}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in _imports(path, set(modules)) if m in modules and m != name} for name, path in modules.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_has_a_layer_and_says_what_it_owns():
    for name, path in _modules().items():
        package = _package(name)
        if package:
            assert package in LAYER_OF, f"{name}: package {package!r} has no layer in tests/test_layers.py"
        if path.name == "__init__.py" and package:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert "May import:" in doc, f"{name} does not say what it may import (a 'May import:' paragraph)"


def may_import(package_init: Path) -> set[str]:
    """The modules and packages a package's ``__init__`` docstring lists in its "May import:" paragraph
    (``:mod:`amp_backends.x``` references, up to the next blank line)."""
    doc = ast.get_docstring(ast.parse(package_init.read_text())) or ""
    paragraph = doc.partition("May import:")[2].split("\n\n")[0]
    return set(re.findall(r":mod:`(amp_backends(?:\.\w+)+)`", paragraph))


def _covers(entry: str, module: str) -> bool:
    return module == entry or module.startswith(entry + ".")


def test_each_package_imports_exactly_what_its_docstring_lists():
    """The "May import" maps are the imports: every module's import from another package (or a top-level
    module) is covered by its package's list, and every entry of the list is imported by some module."""
    modules, graph = _modules(), _graph()
    wrong = []
    for name, path in sorted(modules.items()):
        package = _package(name)
        if path.name != "__init__.py" or name.count(".") != 1:
            continue
        listed = may_import(path)
        wrong += [f"{name} lists {entry}, which is not a module or package" for entry in sorted(listed - set(modules))]
        used: set[str] = set()
        for module, deps in graph.items():
            if _package(module) != package:
                continue
            for dep in sorted(deps):
                if _package(dep) == package:
                    continue
                covering = {entry for entry in listed if _covers(entry, dep)}
                used |= covering
                if not covering:
                    wrong.append(f"{module} imports {dep}, not in {name}'s 'May import' list")
        wrong += [f"{name} lists {entry}, which none of its modules imports" for entry in sorted(listed - used)]
    assert not wrong, "the 'May import' maps and the imports differ:\n" + "\n".join(wrong)


def test_the_may_import_check_reads_what_it_is_given(tmp_path):
    """The parser takes the listed references and only those of the "May import:" paragraph."""
    init = tmp_path / "__init__.py"
    init.write_text('"""Owns :mod:`amp_backends.scaler`.\n\nMay import: :mod:`amp_backends.devices`,\n'
                    ':mod:`amp_backends.gradients.kernel` and torch.\n\nSee :mod:`amp_backends.cli`."""\n')
    assert may_import(init) == {"amp_backends.devices", "amp_backends.gradients.kernel"}
    assert _covers("amp_backends.devices", "amp_backends.devices.fused")
    assert not _covers("amp_backends.devices", "amp_backends.devices_extra")


def test_each_module_imports_only_its_own_package_and_lower_layers():
    wrong = []
    for name, deps in _graph().items():
        package = _package(name)
        if not package:  # the package root re-exports the public API
            continue
        for dep in deps:
            other = _package(dep)
            if other != package and (not other or LAYER_OF[other] >= LAYER_OF[package]):
                wrong.append(f"{name} -> {dep}")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_no_import_circles_between_modules():
    graph = _graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_no_service_locator():
    """No layer is handed factories from above at import time: every dependency is an import."""
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert "provide" not in defined, f"{name} defines provide(): a service locator"


@pytest.mark.parametrize(("limit", "kind"), [(500, "module"), (300, "class")])
def test_modules_and_classes_stay_readable(limit, kind):
    big = []
    for name, path in _modules().items():
        text = path.read_text()
        if kind == "module" and text.count("\n") > limit:
            big.append(f"{name}: {text.count(chr(10))} lines")
        if kind == "class":
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit:
                    big.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not big, f"over {limit} lines:\n" + "\n".join(big)


def test_a_backend_still_builds_its_scaler_and_finds_its_kernel():
    be = amp_backends.get("cpu")
    scaler = be.grad_scaler("float16")
    assert isinstance(scaler, amp_backends.GradScaler) and scaler.is_enabled()
    assert not be.grad_scaler("bfloat16").is_enabled()
    assert isinstance(be.kernel, amp_backends.Kernel)


#: Every module of the flat package before the layout (main at 1aa9fad), and its home now.
FLAT_MODULES = {
    "accelerator": "devices.accelerator", "arena": "gradients.arena", "attribution": "tracing.attribution",
    "backend": "backend", "bench": "cli.bench", "bench_fp8": "cli.bench_fp8", "bench_models": "cli.bench_models",
    "check": "inspector.check", "check_cli": "cli.check", "checkpoint": "checkpoint",
    "checkpoint_values": "checkpoint.values", "cli": "cli", "clipping": "scaler.clipping",
    "consensus": "scaler.consensus", "console": "console", "demo": "cli.demo", "distributed": "distributed",
    "eager": "eager", "errors": "errors", "extension": "extension", "flat": "gradients.groups",
    "fp32_forward": "precision.fp32_forward", "fp8": "precision.fp8.engine", "fp8_linear": "precision.fp8.linear",
    "fp8_policy": "precision.fp8.convert", "fused": "devices.fused", "gradients": "gradients",
    "hardware": "devices.hardware", "hookspecs": "registry.hookspecs", "info": "cli.info",
    "isolation": "tracing.isolation", "kernels": "gradients.kernel", "modules": "precision.autocast_module",
    "nonfinite": "inspector.nonfinite", "opcount": "tracing.opcount", "precision": "precision",
    "registry": "registry", "report": "inspector.report", "scaler": "scaler", "selectors": "precision.selectors",
    "telemetry": "scaler.telemetry", "validation": "scaler.validation",
}


@pytest.mark.parametrize("old", sorted(FLAT_MODULES))
def test_every_old_module_path_still_imports(old, monkeypatch):
    """A plugin or script written against the flat package keeps working: the old path is the moved
    module itself (one object, its own spec kept), with a DeprecationWarning naming the new path."""
    import importlib
    import sys
    import warnings

    if old == "fp8_linear" and NO_FP8 is not None:
        pytest.skip(f"the fp8 layer subclasses torchao's, at either path: {NO_FP8}")
    new = importlib.import_module(f"amp_backends.{FLAT_MODULES[old]}")
    spec = new.__spec__
    if FLAT_MODULES[old] != old:
        monkeypatch.delitem(sys.modules, f"amp_backends.{old}", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert importlib.import_module(f"amp_backends.{old}") is new
    assert new.__spec__ is spec and new.__name__ == spec.name
    moved = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and "moved" in str(w.message)]
    assert moved == ([f"amp_backends.{old} moved to amp_backends.{FLAT_MODULES[old]}: import it from there "
                      "(the old path is removed in 0.3)"] if FLAT_MODULES[old] != old else [])


def test_what_the_built_in_plugins_imported_before_the_layout_still_imports():
    """The imports the built-in plugins (the pattern vendors copy) made from the flat package."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from amp_backends.accelerator import autocast_dtypes
        from amp_backends.flat import FlatGroup
        from amp_backends.fp8 import RECIPES
        from amp_backends.fused import ABSENT, HONOURS, IGNORES, REFUSED
        from amp_backends.hardware import cpu_native_dtypes, cpu_summary, missing_cpu_features
        from amp_backends.kernels import TORCH_KERNEL, add_sum_of_squares, through_float32
    from amp_backends.devices import accelerator, fused, hardware
    from amp_backends.gradients import groups, kernel
    from amp_backends.precision.fp8 import engine

    assert (autocast_dtypes, FlatGroup, RECIPES) == (accelerator.autocast_dtypes, groups.FlatGroup, engine.RECIPES)
    assert (ABSENT, HONOURS, IGNORES, REFUSED) == (fused.ABSENT, fused.HONOURS, fused.IGNORES, fused.REFUSED)
    assert (cpu_native_dtypes, cpu_summary, missing_cpu_features) == \
        (hardware.cpu_native_dtypes, hardware.cpu_summary, hardware.missing_cpu_features)
    assert (TORCH_KERNEL, add_sum_of_squares, through_float32) == \
        (kernel.TORCH_KERNEL, kernel.add_sum_of_squares, kernel.through_float32)
