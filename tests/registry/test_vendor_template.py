"""The path a vendor takes, end to end: install core and the template plugin into a fresh
virtual environment (no dependencies fetched: torch is reused from this environment), see
the plugin in `amp-backends info`, and run the conformance suite against it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _shared_site(tmp: Path) -> Path:
    """This environment's packages, minus amp-backends itself, as one folder of links."""
    shared = tmp / "outer-site"
    shared.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = entry.name.lower()
        if name.startswith(("amp_backends", "amp-backends", "__editable__", "__pycache__")) or name.endswith(".pth"):
            continue
        (shared / entry.name).symlink_to(entry)
    return shared


@pytest.mark.slow
def test_template_plugin_installs_and_passes_the_conformance_suite(tmp_path):
    venv = tmp_path / "venv"
    # no pip or setuptools of its own: the outer environment's (via the .pth below) build and install
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "outer.pth").write_text(str(_shared_site(tmp_path)) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AMP_BACKEND", "PYTHONPATH", "VIRTUAL_ENV"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    # build from copies: pip builds a local folder in place, and this checkout is in use by other tests
    skip = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", "out", ".pytest_cache")
    core = shutil.copytree(ROOT, tmp_path / "src" / "amp-backends", ignore=skip, symlinks=True)
    template = core / "plugins" / "vendor-template"
    for target in (core, template):
        proc = subprocess.run(pip + [str(target)], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]

    proc = subprocess.run([str(venv / "bin" / "amp-backends"), "info", "--json"], capture_output=True, text=True,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    rows = {b["name"]: b for b in info["backends"]}
    assert rows["acme"]["package"] == "amp-backends-acme" and rows["acme"]["builtin"] is False
    assert rows["acme"]["available"] and rows["cpu"]["available"]
    location = subprocess.run([str(python), "-c", "import amp_backends; print(amp_backends.__file__)"],
                              capture_output=True, text=True, env=env, cwd=tmp_path).stdout
    assert str(venv) in location, "the core came from the fresh environment, not this checkout"

    proc = subprocess.run(
        [str(python), "-m", "pytest", "--pyargs", "amp_backends.testing", "--amp-backend", "acme", "-q", "-p", "no:cacheprovider"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "failed" not in summary, summary
