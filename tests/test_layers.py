"""The package's layering: no import circles between its modules (lazy imports included), and
the backend contract imports neither the scaler nor the registry."""

from __future__ import annotations

import ast
from pathlib import Path

import amp_backends

PACKAGE = Path(amp_backends.__file__).resolve().parent
# What may import what is read from the source: every import statement, wherever it stands
# (a function-level import is a dependency too), of a sibling module of the package.


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:
                found.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith("amp_backends."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("amp_backends."))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {p.stem: p for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_the_backend_contract_imports_neither_the_scaler_nor_the_registry():
    deps = _graph()["backend"]
    assert "scaler" not in deps and "registry" not in deps, deps
    assert deps <= {"accelerator", "errors", "fused", "kernels", "flat"}, f"backend.py should sit just above the kernels: {deps}"


def test_the_kernel_layer_calls_nothing_above_it():
    graph = _graph()
    assert graph["flat"] == set()
    assert graph["kernels"] <= {"flat"}, graph["kernels"]


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


def test_a_backend_still_builds_its_scaler_and_finds_its_kernel():
    be = amp_backends.get("cpu")
    scaler = be.grad_scaler("float16")
    assert isinstance(scaler, amp_backends.GradScaler) and scaler.is_enabled()
    assert not be.grad_scaler("bfloat16").is_enabled()
    assert isinstance(be.kernel, amp_backends.Kernel)
