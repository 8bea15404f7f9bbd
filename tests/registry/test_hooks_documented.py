"""Every hook is documented (docstring and a CONTRIBUTING.md section) and exercised by a test."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from amp_backends.registry import hookspecs

ROOT = Path(__file__).resolve().parents[2]
HOOKS = sorted(name for name, obj in vars(hookspecs).items()
               if inspect.isfunction(obj) and hasattr(obj, hookspecs.PROJECT + "_spec"))


def test_hooks_are_found():
    assert HOOKS == ["amp_backends_register_backends", "amp_backends_register_kernels"]


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_docstring_a_reference_section_and_a_test(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook))
    assert doc and len(doc.split()) >= 5, f"{hook} needs a one-line docstring in hookspecs.py"
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    assert f"### `{hook}`" in contributing, f"CONTRIBUTING.md needs a '### `{hook}`' section"
    section = contributing.split(f"### `{hook}`", 1)[1].split("\n### ", 1)[0]
    assert "register(" in section, f"the {hook} section must say how to call register"
    users = [p.name for p in (ROOT / "tests").rglob("test_*.py")
             if p.name != Path(__file__).name and hook in p.read_text()]
    plugin_users = [p for p in (ROOT / "plugins").rglob("*.py") if hook in p.read_text()]
    assert users, f"no test implements {hook}"
    assert plugin_users, f"no plugin implements {hook}"
