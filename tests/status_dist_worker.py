"""A 2-rank run (torchrun, Gloo) where only rank 1's backward overflows at step 1: the ranks
must skip the same steps and end with identical parameters. Gradients are averaged as DDP
does, through CPU copies (Gloo), so that on a device in saturation mode rank 0 receives finite
saturated values and a clear overflow status, as it would after HCCL's all-reduce."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

import amp_backends
import amp_backends.distributed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--extra", action="store_true",
                        help="a second optimizer over a parameter only rank 0 uses: rank 1 has no gradient for it")
    args = parser.parse_args()
    be = amp_backends.get(args.backend)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        dev = be.device()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(dev)
        torch.manual_seed(1 + rank)
        x = torch.randn(32, 8)
        y = x[:, :1].clone()
        x, y = x.to(dev), y.to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        extra = torch.nn.Parameter(torch.ones(3, device=dev))
        opt2 = torch.optim.SGD([extra], lr=0.05)
        scaler = amp_backends.GradScaler(be, init_scale=2.0**8)
        record, reduced = [], []
        for step in range(4):
            opt.zero_grad()
            opt2.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            if args.extra and rank == 0:
                loss = loss + (extra * extra).sum() * 1e-3
            if rank == 1 and step == 1:
                loss = loss * torch.full((), 3e38, device=dev)  # this rank's backward overflows
            scaler.scale(loss).backward()
            for p in model.parameters():  # DDP's average: each rank's half, summed
                g = p.grad.cpu() / 2
                dist.all_reduce(g)
                p.grad.copy_(g.to(dev))
                reduced.append(g)  # alive until the group is gone: Gloo's threads then never need the GIL
            scaler.step(opt)
            if args.extra:
                scaler.step(opt2)  # rank 1: no gradient, yet it must take part in the status agreement
            scaler.update()
            record.append({"skipped": scaler.last_step_skipped, "scale": scaler.get_scale()})
        params = [p.detach().cpu().tolist() for p in model.parameters()]
        status_mode = bool(be.global_overflow_status)
        Path(args.out, f"rank{rank}.json").write_text(
            json.dumps({"record": record, "params": params, "status_mode": status_mode,
                        "extra": extra.detach().cpu().tolist()})
        )
    finally:
        amp_backends.distributed.destroy_process_group()  # barrier, teardown, collect: a clean exit


if __name__ == "__main__":
    main()
