"""Bytes each rank hands to the collectives per step, and the loss, with gradients reduced in float32,
bfloat16 and float16 (with the loss scaler), on 2 CPU ranks over gloo.

    python bench/comms.py                      # 300 steps, DDP (and FSDP2 where torch has it on CPU)
    python bench/comms.py --steps 100 --json out.json

Each configuration trains the same MLP from the same seed on the same per-rank data: DDP's own
float32 all-reduce; ``amp_backends.distributed.reduce_in_low_precision`` in bfloat16; the same in
float16 with ``amp_backends.GradScaler`` (initial scale 2**16, torch's default, and 2**24, which float16
buckets overflow at first: skipped steps); and, with torch 2.6+, FSDP2 sharded by
``shard_in_low_precision`` (bf16 weights; float32, then bf16 reduction) against float32 policies on the
same modules. Bytes are counted as each collective is dispatched
(:func:`amp_backends.distributed.count_collectives`: the payload a rank hands the library), not
inferred; the loss gap is the largest difference from the float32 run's loss over the last 50 steps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _data(rank: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(64, 8, generator=teacher)
    x = torch.randn(steps, 32, 64, generator=g)
    return x, torch.tanh(x @ w) + 0.01 * torch.randn(steps, 32, 8, generator=g)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
                               torch.nn.LayerNorm(256), torch.nn.Linear(256, 8))


def _ddp(config: str, rank: int, steps: int) -> dict:
    import amp_backends
    from amp_backends import distributed
    from torch.nn.parallel import DistributedDataParallel as DDP

    be = amp_backends.get("cpu")
    net = _model()
    ddp = DDP(net)
    if config != "fp32":
        distributed.reduce_in_low_precision(ddp, be, torch.float16 if config.startswith("fp16") else torch.bfloat16)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    # torch's default initial scale, and one float16 buckets overflow at first (float32 ones would not)
    scale = {"fp16+scaler": 2.0**16, "fp16+scaler 2^24": 2.0**24}.get(config)
    scaler = amp_backends.GradScaler(be, init_scale=scale) if scale else None
    x, y = _data(rank, steps)
    losses, per_step, dtypes, skipped = [], [], set(), 0
    for step in range(steps):
        opt.zero_grad()
        with distributed.count_collectives() as log:
            loss = torch.nn.functional.mse_loss(ddp(x[step]), y[step])
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(opt)
            scaler.update()
            skipped += scaler.last_step_skipped
        else:
            opt.step()
        losses.append(float(loss.detach()))
        per_step.append(log.bytes("allreduce_"))
        dtypes |= {str(d).replace("torch.", "") for d in log.dtypes("allreduce_")}
    return {"losses": losses, "bytes_per_step": max(per_step[1:]), "dtypes": sorted(dtypes), "skipped": skipped}


def _fsdp(config: str, rank: int, steps: int) -> dict:
    import amp_backends
    from amp_backends import distributed
    from amp_backends.distributed.sharding import fsdp_api

    fully_shard, MixedPrecisionPolicy = fsdp_api()
    net = _model()
    blocks = [net[0], net[2]]
    if config == "fp32":
        full = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for m in [net[4], net[5], *blocks, net]:
            fully_shard(m, mp_policy=full)
    else:
        distributed.shard_in_low_precision(net, "cpu", policy=amp_backends.precision_policy(net), blocks=blocks,
                                           reduce_dtype=torch.bfloat16 if config == "bf16 reduce" else torch.float32)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x, y = _data(rank, steps)
    losses, gathered, scattered = [], [], []
    for step in range(steps):
        opt.zero_grad()
        with distributed.count_collectives() as log:
            loss = torch.nn.functional.mse_loss(net(x[step]), y[step])
            loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        gathered.append(log.bytes(["_allgather_base_", "allgather_into_tensor_coalesced_"]))
        scattered.append(log.bytes(["_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"]))
    return {"losses": losses, "gather_bytes_per_step": max(gathered), "scatter_bytes_per_step": max(scattered)}


def _rank(rank: int, init: str, steps: int, out: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        result = {"ddp": {c: _ddp(c, rank, steps) for c in ("fp32", "bf16", "fp16+scaler", "fp16+scaler 2^24")}}
        from amp_backends.distributed.sharding import _can_divide_then_sum

        if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6) and _can_divide_then_sum():
            result["fsdp2"] = {c: _fsdp(c, rank, steps) for c in ("fp32", "bf16 weights", "bf16 reduce")}
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        import amp_backends.distributed

        amp_backends.distributed.destroy_process_group()


def _gap(losses: list[float], ref: list[float], last: int = 50) -> float:
    return max(abs(a - b) for a, b in zip(losses[-last:], ref[-last:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(f"file://{tmp}/rendezvous", args.steps, tmp), nprocs=WORLD, join=True)
        res = json.loads(Path(tmp, "0.json").read_text())
    print(f"torch {torch.__version__}, {platform.machine()}, {WORLD} gloo ranks on CPU, {args.steps} steps, "
          f"{datetime.date.today()}")
    ddp = res["ddp"]
    ref = ddp["fp32"]
    print(f"{'DDP':<18}{'bytes/step':>12}{'vs fp32':>9}{'wire':>16}{'final loss':>12}{'gap (last 50)':>15}{'skipped':>9}")
    for name, r in ddp.items():
        print(f"{name:<18}{r['bytes_per_step']:>12}{r['bytes_per_step'] / ref['bytes_per_step']:>9.3f}"
              f"{'/'.join(r['dtypes']):>16}{r['losses'][-1]:>12.5f}{_gap(r['losses'], ref['losses']):>15.2e}"
              f"{r['skipped']:>9}")
    if "fsdp2" in res:
        f = res["fsdp2"]
        ref = f["fp32"]
        print(f"{'FSDP2':<14}{'gather B/step':>14}{'vs fp32':>9}{'scatter B/step':>16}{'vs fp32':>9}{'final loss':>12}"
              f"{'gap (last 50)':>15}")
        for name, r in f.items():
            print(f"{name:<14}{r['gather_bytes_per_step']:>14}{r['gather_bytes_per_step'] / ref['gather_bytes_per_step']:>9.3f}"
                  f"{r['scatter_bytes_per_step']:>16}{r['scatter_bytes_per_step'] / ref['scatter_bytes_per_step']:>9.3f}"
                  f"{r['losses'][-1]:>12.5f}{_gap(r['losses'], ref['losses']):>15.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "steps": args.steps, **res}))


if __name__ == "__main__":
    sys.exit(main())
