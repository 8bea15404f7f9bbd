"""The package's layering: no import circles between its modules (lazy imports included), and
the backend contract imports neither the scaler nor the registry."""

from __future__ import annotations

import ast
from pathlib import Path

import amp_backends

PACKAGE = Path(amp_backends.__file__).resolve().parent
# What may import what is read from the source: every import statement, wherever it stands
# (a function-level import is a dependency too), of a sibling module of the package.


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
                root = base[: len(base) - node.level + 1]
                mod = ".".join(root + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("amp_backends"):
                mod = node.module
            else:
                continue
            for a in node.names:
                found.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("amp_backends."))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_name(p): p for p in PACKAGE.rglob("*.py") if "sim_packages" not in p.parts and p.stem != "__main__"}
    return {name: {m for m in _imports(path, set(modules)) if m in modules and m != name} for name, path in modules.items()}


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
