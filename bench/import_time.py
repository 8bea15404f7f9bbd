"""Time that ``import amp_backends`` plus ``get("cpu")`` adds beyond ``import torch``.

    python bench/import_time.py [--runs 9]

Each run is a fresh interpreter that imports torch, then amp_backends, and resolves the
cpu backend (plugin discovery included); the median over runs is printed. Goal: < 30 ms, as an
installed package runs (its bytecode cached by pip or by a first import). Also measured with no
bytecode cache (``PYTHONDONTWRITEBYTECODE=1`` and no ``__pycache__``: every module compiled from
source each time), which some sandboxes impose. It also checks that no optional device library
(triton, torch_mlu) was imported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import os
import subprocess
import sys
import tempfile

PROBE = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import amp_backends
amp_backends.get("cpu")
t2 = time.perf_counter()
print(json.dumps({"torch": t1 - t0, "amp": t2 - t1, "optional": [m for m in ("triton", "torch_mlu") if m in sys.modules]}))
"""


def measure(runs: int, cached: bool = True) -> dict[str, float | list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if cached:  # one run that writes the bytecode the measured runs read
        subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=env)
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp()  # an empty cache: nothing compiled is found
    samples = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=env)
        samples.append(json.loads(out.stdout))
    return {
        "torch_ms": statistics.median(s["torch"] for s in samples) * 1e3,
        "amp_backends_ms": statistics.median(s["amp"] for s in samples) * 1e3,
        "optional_imported": sorted({m for s in samples for m in s["optional"]}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.runs)
    result["uncached_amp_backends_ms"] = measure(args.runs, cached=False)["amp_backends_ms"]
    if args.json:
        print(json.dumps(result))
    else:
        print(f"import torch:                          {result['torch_ms']:7.1f} ms (median of {args.runs})")
        print(f"import amp_backends + get('cpu') more: {result['amp_backends_ms']:7.1f} ms (goal < 30 ms)")
        print(f"  ... with no bytecode cache:          {result['uncached_amp_backends_ms']:7.1f} ms")
        print(f"optional device libraries imported:    {result['optional_imported'] or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
