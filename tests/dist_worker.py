"""A training worker launched by torchrun from tests/distributed/test_distributed.py (2 CPU ranks, gloo).

--mode ddp:     DistributedDataParallel; inf enters one rank's gradient before the all-reduce.
--mode sharded: gradients all-reduced by hand, then inf put into one rank's copy only, so the
                ranks hold different gradients (as with FSDP/ZeRO shards).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import amp_backends
from amp_backends import distributed

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["ddp", "sharded"], required=True)
parser.add_argument("--sync", action="store_true", help="all-reduce found_inf in the scaler")
parser.add_argument("--policy", action="store_true", help="run the head in float32 (precision_policy, before DDP)")
parser.add_argument("--inject-rank", type=int, default=1)
parser.add_argument("--inject-step", type=int, default=3)
parser.add_argument("--out", required=True)
args = parser.parse_args()

info = distributed.init_process_group("cpu")
be = info.backend
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
g = torch.Generator().manual_seed(100 + info.rank)
x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
state = {"step": -1}
first = next(model.parameters())

policy = amp_backends.precision_policy(model) if args.policy else None  # the recipe: the head in float32
if args.mode == "ddp":
    if info.rank == args.inject_rank:
        first.register_hook(lambda grad: torch.full_like(grad, math.inf) if state["step"] == args.inject_step else grad)
    net: torch.nn.Module = DDP(model)
else:
    net = model

opt = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = amp_backends.GradScaler(be, init_scale=2.0**10, growth_interval=4, process_group="world" if args.sync else None)
record = []
for step in range(8):
    state["step"] = step
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        out = net(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
    scaler.scale(loss).backward()
    if args.mode == "sharded":
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= info.world_size
        if info.rank == args.inject_rank and step == args.inject_step:
            first.grad[0, 0] = math.inf
    scaler.step(opt)
    scaler.update()
    record.append({"step": step, "skipped": scaler.last_step_skipped, "scale": scaler.get_scale()})

params = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.empty_like(params) for _ in range(info.world_size)]
dist.all_gather(gathered, params)
Path(args.out, f"rank{info.rank}.json").write_text(json.dumps({
    "rank": info.rank,
    "world_size": info.world_size,
    "dist_backend": info.dist_backend,
    "record": record,
    "identical_across_ranks": all(torch.equal(gathered[0], t) for t in gathered),
    "out_dtype": str(out.dtype),
    "policy": None if policy is None else sorted(policy.selected),
}))
distributed.destroy_process_group()
