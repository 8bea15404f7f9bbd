"""Every example under examples/ runs and trains."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXPECT = {
    "plain_loop.py": r"backend=cpu dtype=torch.bfloat16 final_loss=0\.0[0-9]+ skipped=0",
    "grad_accumulation.py": r"accumulated 4 micro-batches per step: final_loss=0\.[0-2]",
    "grad_clipping.py": r"torch recipe: final_loss=(0\.[0-9]+) last_norm=.*\n\s*scaler recipe: final_loss=\1",
    "two_optimizers.py": r"two optimizers: final_loss=0\.[0-2][0-9]* steps=\d+ skipped=\d+",
    "bf16_no_scaler.py": r"bf16: final_loss=0\.[0-9]+ skipped=1 weights_finite=True",
    "save_and_evaluate.py": r"eval_loss=0\.[0-9]+ identical_weights=True scale=\d+",
}


UNDER_TORCHRUN = {"ddp.py"}  # run with two ranks by tests/distributed/test_distributed.py


def test_every_example_is_covered():
    assert {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")} == set(EXPECT) | UNDER_TORCHRUN


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_example_runs(name, tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AMP_BACKEND")}, "AMP_BACKEND": "cpu"}
    args = [sys.executable, str(EXAMPLES / name)] + ([str(tmp_path)] if name == "save_and_evaluate.py" else [])
    proc = subprocess.run(args, capture_output=True, text=True, cwd=EXAMPLES, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert re.search(EXPECT[name], proc.stdout), proc.stdout
