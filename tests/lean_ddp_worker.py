"""Lean weights under DDP, one rank of a torchrun launch (2 CPU ranks over Gloo): each rank builds the
model from its own seed; memory_lean then DDP (DDP's broadcast of rank 0's weights reaches the masters),
and DDP then memory_lean (refused). Writes rankN.json into --out."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from amp_backends import distributed
from amp_backends.memory.lean import LeanError, memory_lean


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # different weights on each rank until DDP broadcasts rank 0's
    model = _model()
    lean = memory_lean(model, torch.optim.AdamW(model.parameters(), lr=1e-2), backend="cpu", weights=torch.bfloat16)
    ddp = nn.parallel.DistributedDataParallel(model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for _ in range(3):
        lean.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(ddp(x).float(), y).backward()
        lean.optimizer.step()
    masters = torch.cat([m.flatten() for m in lean.state_dict().values()])
    gathered = [torch.empty_like(masters) for _ in range(2)]
    dist.all_gather(gathered, masters)

    refused = ""
    other = _model()
    wrapped = nn.parallel.DistributedDataParallel(other)  # noqa: F841  # alive while memory_lean looks
    try:
        memory_lean(other, torch.optim.AdamW(other.parameters()), backend="cpu", weights=torch.bfloat16)
    except LeanError as exc:
        refused = str(exc)
    result = {"rank": rank, "identical": torch.equal(gathered[0], gathered[1]),
              "trained": not torch.equal(masters, torch.cat([p.detach().float().flatten() for p in _seeded()])),
              "refused": refused, "other_dtype": str(other[0].weight.dtype)}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    distributed.destroy_process_group()  # barrier, destroy, collect: avoids Gloo's abort at exit


def _seeded() -> list[torch.Tensor]:
    torch.manual_seed(100)
    return list(_model().state_dict().values())


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
