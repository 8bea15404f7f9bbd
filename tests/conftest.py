"""Shared helpers: real third-party plugins as installed distributions, run in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported, and Lightning/Transformers/Accelerate
# import it while the test modules are collected: set it before any of them (CPU-only machines),
# so that tests/plugins/test_triton_kernels.py runs the kernels in Triton's interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist every core runs a worker: torch's intra-op threads (one per core in each
# worker, and in each subprocess a test starts) would spin against each other, and the small ops
# these tests run slow down many times over. One thread each; the arithmetic is the same.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def write_distribution(
    root: Path, package: str, module: str, source: str, entry_points: dict[str, str], version: str = "1.0"
) -> Path:
    """Write an importable module and a ``*.dist-info`` declaring its ``amp_backends`` entry points."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    dist = root / f"{package.replace('-', '_')}-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (dist / "entry_points.txt").write_text(f"[amp_backends]\n{lines}\n")
    return root


#: Variables that choose a simulated extension's visible devices: a test sets them when it means to.
_VISIBILITY = ("CN_VISIBLE_DEVICES", "MLU_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "MUSA_VISIBLE_DEVICES")


def cpu_only_env() -> dict[str, str]:
    """Environment for a subprocess that must see no accelerator backend (only cpu and what the
    test installs): the plugins serving the accelerators this machine has are switched off with the
    project's own ``AMP_BACKENDS_DISABLE_PLUGINS`` (the generic plugin too, for an unclaimed device). On a GPU
    machine, or in CI's accelerator-first leg, ``amp_backends.get()`` would otherwise pick them."""
    import amp_backends

    others = {name for name in amp_backends.available() if name != "cpu"}
    registry = amp_backends.registry.default_registry()
    plugins = sorted({record.name for backend, record in registry.backends() if backend.name in others})
    return {"AMP_BACKENDS_DISABLE_PLUGINS": ",".join(plugins)} if plugins else {}


def run_python(code: str, paths: list[Path] = (), env: dict[str, str] | None = None, timeout: int = 240):
    """Run ``code`` in a fresh interpreter with ``paths`` on sys.path; return the CompletedProcess."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("AMP_BACKEND") and k not in _VISIBILITY}
    if any("sim_packages" in str(p) and str(p).endswith("mlu") for p in paths):
        full_env.pop("CUDA_VISIBLE_DEVICES", None)  # torch_mlu falls back to it: a test sets it when it means to
    full_env["PYTHONPATH"] = os.pathsep.join([str(p) for p in paths] + [full_env.get("PYTHONPATH", "")])
    # a probe or kernel self-check on a loaded CI machine may take longer than the default 10 s; a test
    # of the time limit sets its own
    full_env["AMP_BACKENDS_PROBE_TIMEOUT"] = "120"
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


def run_json(code: str, paths: list[Path] = (), env: dict[str, str] | None = None):
    """Run ``code``, which prints one JSON document last, and return it parsed."""
    proc = run_python(code, paths, env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


ACME_SOURCE = '''
import torch
import amp_backends

class AcmeBackend(amp_backends.Backend):
    name = "acme"
    device_type = "cpu"
    default_dtype = torch.bfloat16

    def unavailable_reason(self):
        return None

@amp_backends.hookimpl
def amp_backends_register_backends(register):
    register(AcmeBackend())
'''


@pytest.fixture
def acme_plugin(tmp_path: Path) -> Path:
    """A third-party plugin package 'acme-amp' providing backend 'acme' (on the CPU)."""
    return write_distribution(tmp_path / "acme", "acme-amp", "acme_amp", ACME_SOURCE, {"acme": "acme_amp"})


@pytest.fixture
def no_amp_env(monkeypatch: pytest.MonkeyPatch):
    """Clear amp_backends' environment variables and reload the registry around a test."""
    import amp_backends

    for var in list(os.environ):
        if var.startswith("AMP_BACKEND"):
            monkeypatch.delenv(var)
    amp_backends.reload()
    yield
    monkeypatch.undo()
    amp_backends.reload()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fuzz-programs", type=int, default=400,
        help="programs the differential fuzz of the training step runs (tests/scaler/test_differential.py); "
             "CI runs the default, thousands on demand",
    )
    parser.addoption(
        "--fuzz-compiled", type=int, default=4,
        help="of those programs, how many also run the whole step under torch.compile per backend "
             "(eager; aot_eager and inductor take fewer)",
    )
