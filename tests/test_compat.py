"""Old import paths answer one way: the import and the attribute give the moved module with the same
DeprecationWarning, naming the release that removes the old path."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings

import pytest

import amp_backends
from amp_backends import compat


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _moved_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and " moved to " in str(w.message)]


@pytest.mark.parametrize(("old", "new"), [("check", "inspector.check"), ("info", "cli.info"), ("fused", "devices.fused")])
def test_attribute_and_import_of_an_old_path_are_one_way(old, new, monkeypatch):
    module = importlib.import_module(f"amp_backends.{new}")
    messages = []
    for reach in (lambda: getattr(amp_backends, old), lambda: importlib.import_module(f"amp_backends.{old}")):
        monkeypatch.delitem(sys.modules, f"amp_backends.{old}", raising=False)
        monkeypatch.delitem(vars(amp_backends), old, raising=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert reach() is module
        messages.append(_moved_warnings(caught))
    expected = f"amp_backends.{old} moved to amp_backends.{new}: import it from there (the old path is removed in 0.3)"
    assert messages == [[expected], [expected]]


def test_every_old_path_names_a_later_release_and_an_existing_module():
    current = _version(amp_backends.__version__)
    for old, entry in compat.MOVED_MODULES.items():
        assert _version(entry.removed_in) > current, f"{old}: removal {entry.removed_in} is not after {amp_backends.__version__}"
        assert importlib.util.find_spec(f"amp_backends.{entry.new}") is not None, f"{old} -> {entry.new} does not exist"
        assert old not in amp_backends._LAZY_SUBMODULES and old not in amp_backends._LAZY_NAMES, f"{old} resolves two ways"


def test_a_name_that_is_neither_public_nor_old_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        getattr(amp_backends, "no_such_thing")


def test_the_hook_is_installed_once():
    compat.install()
    compat.install()
    assert sum(isinstance(finder, compat.MovedModules) for finder in sys.meta_path) == 1
