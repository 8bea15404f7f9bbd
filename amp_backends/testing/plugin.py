"""pytest plugin (entry point ``pytest11``): the backend conformance suite.

Inert unless asked for. Run every check against one backend with::

    pytest --pyargs amp_backends.testing --amp-backend NAME

The checks live in ``amp_backends/testing/test_conformance_*.py``; without
``--amp-backend`` they are not collected at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("amp-backends", "amp-backends conformance suite")
    group.addoption("--amp-backend", default=None, metavar="NAME",
                    help="run the amp-backends conformance suite against backend NAME")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.parent == _HERE and collection_path.name.startswith("test_conformance"):
        if config.getoption("--amp-backend") is None:
            return True
    return None


def pytest_report_header(config: pytest.Config) -> str | None:
    name = config.getoption("--amp-backend")
    return f"amp-backends conformance suite: backend {name!r}" if name else None


@pytest.fixture(scope="session")
def amp_backend_name(request: pytest.FixtureRequest) -> str:
    name = request.config.getoption("--amp-backend")
    if name is None:
        pytest.skip("no --amp-backend given")
    return name


@pytest.fixture(scope="session")
def backend(amp_backend_name: str):
    """The backend under test; every check skips, with the reason, when it is unavailable."""
    import amp_backends

    registry = amp_backends.registry.default_registry()
    found = [b for b, _ in registry.backends() if b.name == amp_backend_name.lower()]
    if not found:
        try:
            return amp_backends.get(amp_backend_name)
        except amp_backends.AmpBackendsError as exc:
            pytest.fail(f"backend {amp_backend_name!r} cannot be loaded: {exc}", pytrace=False)
    be = found[0]
    reason = amp_backends.registry.probe(be)  # bounded in time; a probe that raises is a reason too
    if reason is not None:
        pytest.skip(f"backend {be.name!r} is not available here: {reason}")
    return be
