"""Two CPU ranks over gloo launched by torchrun, for the tests of distributed training; the workers
they run live beside this file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

#: tests/: where the worker scripts are.
TESTS = Path(__file__).resolve().parent
#: The running torch's (major, minor).
TORCH_MINOR = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def torchrun(script: Path, *args: str, cwd: Path = TESTS, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AMP_BACKEND", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env["AMP_BACKEND"] = "cpu"
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks: a GPU would be picked by DeviceMesh and DDP otherwise
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *args],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=300,
    )
