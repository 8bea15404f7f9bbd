"""The command's warnings: the package's own as one line in its words, other libraries' as Python prints them
(a SyntaxWarning from compiling a library's source, a warning a library issues while the package calls it).
Printed by Python's own machinery in a fresh interpreter with the command's formatter in place."""

from __future__ import annotations

import json
import sys
import warnings

import pytest

from conftest import run_python

PROBE = '''
import warnings, numpy as np, torch

def ours():
    warnings.warn(
        "a word from the package",
        RuntimeWarning,
    )

def torchs(array):
    return torch.from_numpy(array)
'''

SCRIPT = '''
import importlib.util, json, pathlib, sys, tempfile, warnings
import numpy as np, torch
import amp_backends
from amp_backends.cli.warning_format import format_warning
from amp_backends.devices.contract import warn_if_emulated

warnings.simplefilter("always")
warnings.formatwarning = format_warning
folder = pathlib.Path(tempfile.mkdtemp())
(folder / "warn_probe.py").write_text(%r)
spec = importlib.util.spec_from_file_location("amp_backends._warn_probe", folder / "warn_probe.py")
probe = importlib.util.module_from_spec(spec)  # a module of the package, by its name
spec.loader.exec_module(probe)
frozen = np.zeros(3)
frozen.flags.writeable = False
cases = {
    # as torchao 0.17's source compiled by Python 3.12 (an invalid escape): issued from C, in the compiler
    "compiled": lambda: compile("'\\\\.'", "their_source.py", "eval"),
    "ours": probe.ours,
    "torch_from_the_package": lambda: probe.torchs(frozen),  # torch's C++ warning, in a call from the package
    "emulated": lambda: warn_if_emulated(amp_backends.get("cpu"), torch.float64),
}
for name, emit in cases.items():
    print("@@" + name, file=sys.stderr, flush=True)
    emit()
    sys.stderr.flush()
''' % PROBE


def _printed() -> dict[str, str]:
    proc = run_python(SCRIPT, env={"PYTHONWARNINGS": ""})
    assert proc.returncode == 0, proc.stderr
    parts = proc.stderr.split("@@")[1:]
    return {part.split("\n", 1)[0]: part.split("\n", 1)[1] for part in parts}


def test_the_packages_own_warnings_in_its_words_and_everyone_elses_as_python_prints_them():
    printed = _printed()
    category = SyntaxWarning if sys.version_info >= (3, 12) else DeprecationWarning
    assert printed["compiled"] == warnings._formatwarning_orig(
        category("invalid escape sequence '\\.'"), category, "their_source.py", 1, None)
    assert printed["ours"] == "amp-backends: warning: a word from the package\n"
    assert "UserWarning: The given NumPy array is not writable" in printed["torch_from_the_package"]
    assert "amp-backends" not in printed["torch_from_the_package"]
    assert printed["emulated"].startswith("amp-backends: warning: float64 autocast on cpu is emulated")
    assert printed["emulated"].count("\n") == 1, json.dumps(printed)


def test_the_command_installs_it(capsys):
    from amp_backends.cli import main
    from amp_backends.cli.warning_format import format_warning

    with warnings.catch_warnings():
        assert main(["info", "--json"]) == 0
        assert warnings.formatwarning is format_warning


@pytest.mark.slow  # compiles the whole of torchao's source (about 40 s)
def test_importing_torchao_for_the_fp8_engine_shows_no_warning_about_its_source(tmp_path):
    """Python 3.12 compiling torchao 0.17's source (no bytecode cached: an empty cache folder) warns about an
    invalid escape in it; the package's import of the engine (``info`` on a machine with fp8 matmuls) does not
    show it, and leaves torchao's own filters in place."""
    from amp_backends.precision.fp8 import engine

    if engine.torchao_version() is None:
        pytest.skip("torchao is not installed")
    proc = run_python("""
    import warnings
    from amp_backends.precision.fp8 import engine
    print(engine.unavailable_reason())
    print(any("Failed to initialize NumPy" in getattr(f[1], "pattern", "") for f in warnings.filters))
    """, env={"PYTHONPYCACHEPREFIX": str(tmp_path), "PYTHONWARNINGS": "always"})
    assert proc.returncode == 0 and "SyntaxWarning" not in proc.stderr, proc.stderr
    assert proc.stdout.split() == ["None", "True"], "the engine imports; torchao's filter (its __init__'s) stays"
