"""torch's private names live in one module: every one resolves on the running torch or has its public
fallback recorded, and no other module of the package or its plugins names one (an AST scan)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import amp_backends
from amp_backends import torch_private

ROOT = Path(amp_backends.__file__).resolve().parent
PLUGINS = ROOT.parent / "plugins" / "amp_backends_plugins"
HOME = ROOT / "torch_private.py"
#: Modules whose own refactor (the scaler's step) brings their remaining uses here: path -> why now.
PENDING: dict[str, str] = {}
_PRIVATE = re.compile(r"^_(?!_)")  # _name, not __dunder__


def _sources() -> list[Path]:
    files = [p for p in ROOT.rglob("*.py") if "sim_packages" not in p.parts and p != HOME]
    return sorted(files + list(PLUGINS.rglob("*.py")) if PLUGINS.exists() else files)


def _dotted(node: ast.AST) -> list[str] | None:
    """``torch.a.b`` as ["torch", "a", "b"]; None for anything not a plain dotted name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _private_path(parts: list[str]) -> bool:
    """A torch path with a private component (``torch.ops`` is the dispatcher's op namespace: public)."""
    if parts[0] != "torch" or parts[1:2] == ["ops"]:
        return False
    return any(_PRIVATE.match(p) for p in parts[1:])


def private_uses(source: str, relative: str) -> list[str]:
    """Each private torch name ``source`` uses, as "line: name"."""
    readers = {a.name: a.readers for a in torch_private.ATTRIBUTES}
    tree = ast.parse(source)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # a chain is reported whole
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            module = node.module.split(".")
            if _private_path(module):
                names.append(node.module)
            elif module[0] == "torch":
                names += [f"{node.module}.{a.name}" for a in node.names if _PRIVATE.match(a.name)]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if _private_path(a.name.split("."))]
        elif isinstance(node, ast.Attribute):
            parts = _dotted(node)
            if parts is not None and id(node) not in inner and _private_path(parts):
                names.append(".".join(parts))
            if node.attr in readers and relative not in readers[node.attr]:
                names.append(f"<torch object>.{node.attr}")
        found += [f"{node.lineno}: {n}" for n in names]
    return found


def test_no_module_but_torch_private_names_a_private_torch_name():
    wrong = []
    for path in _sources():
        relative = path.relative_to(ROOT.parent).as_posix()
        if relative in PENDING:
            continue
        uses = private_uses(path.read_text(), relative)
        wrong += [f"{relative}:{use}" for use in uses]
    assert not wrong, "private torch names outside amp_backends/torch_private.py (import them from there):\n" + "\n".join(wrong)


def test_the_scan_finds_each_kind_of_use():
    source = ("import torch\nimport torch._dynamo\nfrom torch._C import _foo\nfrom torch.utils import _pytree\n"
              "x = torch._C._bar()\ny = torch.ops.aten._to_copy.default\nz = torch.__version__\n"
              "w = scaler._per_optimizer_states\n")
    uses = sorted(private_uses(source, "amp_backends/elsewhere.py"))
    assert uses == ["2: torch._dynamo", "3: torch._C", "4: torch.utils._pytree", "5: torch._C._bar",
                    "8: <torch object>._per_optimizer_states"]
    assert not private_uses(source.replace("scaler._per", "scaler.per"), "amp_backends/scaler/scaler.py")[4:]
    assert not private_uses("import torch\nx = torch.ops.aten._to_copy.default\nv = torch.__version__\n", "a.py")


@pytest.mark.parametrize("path", sorted(torch_private.NAMES))
def test_every_private_name_resolves_here_or_has_its_fallback(path):
    entry = torch_private.NAMES[path]
    assert entry.fallback, f"{path}: no fallback recorded (the public way, or what is refused without it)"
    assert entry.checked_on and all(re.fullmatch(r"\d+\.\d+\.\d+", v) for v in entry.checked_on)
    value = torch_private.resolve(path)
    running = torch.__version__.split("+")[0]
    if running in entry.checked_on:
        assert value is not None, f"{path} was checked on torch {running} but does not resolve"
    if not entry.lazy and not entry.per_call and value is not None:
        assert getattr(torch_private, _exported(path)) is value


def _exported(path: str) -> str:
    """The module-level name an eager entry is bound to in torch_private (the one whose value is it)."""
    for name, value in vars(torch_private).items():
        if not name.startswith("_") and value is torch_private.resolve(path):
            return name
    raise AssertionError(f"{path}: resolved but bound to no name in amp_backends.torch_private")


def test_an_op_is_looked_up_at_each_call_as_torch_calls_it(monkeypatch):
    """A test or a profiler that replaces ``torch._foreach_mul_`` is seen through torch_private."""
    calls = []
    real = torch._foreach_mul_

    def counted(tensors, factor):
        calls.append(len(tensors))
        return real(tensors, factor)

    monkeypatch.setattr(torch, "_foreach_mul_", counted)
    tensors = [torch.ones(2), torch.ones(3)]
    torch_private.foreach_mul_(tensors, 2.0)
    assert calls == [2] and all(torch.equal(t, torch.full_like(t, 2.0)) for t in tensors)


def test_recorded_attributes_exist_on_torchs_objects():
    scaler = torch.amp.GradScaler("cpu")
    storage = torch.empty(1).untyped_storage()
    owners = {"torch.amp.GradScaler": scaler, "torch.UntypedStorage": storage, "torch.nn.Module": torch.nn.Linear(1, 1),
              "torch.nn.modules.module": torch.nn.modules.module, "torch.Tensor": torch.nn.Parameter(torch.ones(1))}
    for attribute in torch_private.ATTRIBUTES:
        assert hasattr(owners[attribute.owner], attribute.name), f"{attribute.owner}.{attribute.name} is gone"
        for reader in attribute.readers:
            assert (ROOT.parent / reader).exists(), f"{attribute.name}: reader {reader} does not exist"
