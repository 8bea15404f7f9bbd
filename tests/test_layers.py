"""The package's layout keeps its rules: packages by concern in layers, each importing only the ones
below it (function-level imports count), no import circles, no service locator, and modules and
classes of a size a newcomer can read."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import amp_backends

PACKAGE = Path(amp_backends.__file__).resolve().parent

#: The layers, lowest first: a module may import its own package and the packages of lower layers.
LAYERS: list[set[str]] = [
    {"errors", "eager", "console"},           # base utilities
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
            assert "May import" in doc or package in ("testing", "integrations"), f"{name} does not say what it may import"


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
