"""A torchrun worker (2 ranks: CPU over gloo, or one GPU each over nccl with --backend cuda) that trains two identical models side by side, one
with ``amp_backends.GradScaler`` and ``scaler.clip_grad_norm_``, one with ``torch.amp.GradScaler``
and torch's clip recipe (``unscale_`` then ``torch.nn.utils.clip_grad_norm_``), and records both.

--wrap fsdp2:        ``torch.distributed.fsdp.fully_shard``; gradients are DTensor shards.
--wrap ddp-buckets:  DDP with ``gradient_as_bucket_view=True``; gradients are views into buckets.
--wrap ddp:          DDP as it comes (gradients copied back from its buckets).
--arena:             ours keeps its gradients in ``amp_backends.flat_grads(opt)``.
--fused:             AdamW(fused=True): the scaler's clip is folded into the optimizer's grad_scale.
--policy:            amp_backends.precision_policy(model) (the head in float32) before wrapping, both runs.

At --inject-step, inf enters rank --inject-rank's own gradient (its shard, or its local
gradient before DDP's all-reduce): every rank must skip that step and back off.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import amp_backends
from amp_backends import distributed

parser = argparse.ArgumentParser()
parser.add_argument("--wrap", choices=["fsdp2", "ddp-buckets", "ddp"], required=True)
parser.add_argument("--fused", action="store_true")
parser.add_argument("--arena", action="store_true")
parser.add_argument("--policy", action="store_true")
parser.add_argument("--param-dtype", choices=["bfloat16", "float16"], help="FSDP2's MixedPrecisionPolicy(param_dtype=)")
parser.add_argument("--inject-rank", type=int, default=1)
parser.add_argument("--inject-step", type=int, default=3)
parser.add_argument("--steps", type=int, default=7)
parser.add_argument("--out", required=True)
parser.add_argument("--backend", default="cpu", help="cpu (gloo) or cuda (nccl, one GPU per rank)")
args = parser.parse_args()

info = distributed.init_process_group(args.backend)
be = info.backend
dev = info.device
state = {"step": -1}


def build(seed_offset: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 37), torch.nn.ReLU(),
                                torch.nn.Linear(37, 2)).to(dev)
    first = model[0].weight
    if args.policy:
        amp_backends.precision_policy(model)  # before wrapping: the model's own names
    if args.wrap == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard

        kwargs = {}
        if args.param_dtype:  # the forward runs on low-precision copies of the weights
            try:
                from torch.distributed.fsdp import MixedPrecisionPolicy
            except ImportError:  # torch < 2.6
                from torch.distributed._composable.fsdp import MixedPrecisionPolicy
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, args.param_dtype))
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        return model, model
    from torch.nn.parallel import DistributedDataParallel as DDP

    if info.rank == args.inject_rank:  # before DDP's all-reduce: only this rank's gradient is inf
        first.register_hook(lambda g: torch.full_like(g, math.inf) if state["step"] == args.inject_step else g)
    return DDP(model, device_ids=info.device_ids, gradient_as_bucket_view=args.wrap == "ddp-buckets",
               bucket_cap_mb=1), model


def inject(model: torch.nn.Module) -> None:
    if args.wrap != "fsdp2" or info.rank != args.inject_rank or state["step"] != args.inject_step:
        return
    local = model[0].weight.grad.to_local()
    local.view(-1)[0] = math.inf  # this rank's shard only


def global_norm(model: torch.nn.Module) -> float:
    total = 0.0
    for p in model.parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        total += float(g.double().pow(2).sum())
    return math.sqrt(total)


g = torch.Generator().manual_seed(100 + info.rank)
batches = [(torch.randn(16, 8, generator=g).to(dev), torch.randn(16, 2, generator=g).to(dev)) for _ in range(args.steps)]
runs = {}
for name in ("ours", "torch"):
    net, inner = build()
    opt = torch.optim.AdamW(inner.parameters(), lr=1e-2, fused=args.fused)
    arena = amp_backends.flat_grads(opt) if name == "ours" and args.arena else None
    caught = warnings.catch_warnings(record=True)
    arena_warnings = caught.__enter__()
    warnings.simplefilter("always", RuntimeWarning)
    if name == "ours":
        scaler = amp_backends.GradScaler(be, init_scale=2.0**12, growth_interval=3)
        assert scaler._device == be.device_type and isinstance(scaler, torch.amp.GradScaler)
    else:
        scaler = torch.amp.GradScaler(be.device_type, init_scale=2.0**12, growth_interval=3)
    record = []
    for step, (x, y) in enumerate(batches):
        state["step"] = step
        opt.zero_grad()
        with torch.autocast(be.device_type, dtype=torch.float16):
            out = net(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        inject(inner)
        grad_type = type(inner[0].weight.grad).__name__
        scale_before = scaler.get_scale()
        if name == "ours":
            in_arena = arena is not None and arena.problem() is None
            norm = scaler.clip_grad_norm_(opt, 0.05)
        else:
            scaler.unscale_(opt)
            unscaled_norm = global_norm(inner)
            norm = torch.nn.utils.clip_grad_norm_(inner.parameters(), 0.05)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        scaler.step(opt)
        scaler.update()
        entry = {"step": step, "norm": float(norm), "scale": scaler.get_scale(), "scale_before": scale_before}
        if name == "ours":
            entry["skipped"] = scaler.last_step_skipped
            entry["in_arena"] = in_arena
        else:
            entry["global_norm"] = unscaled_norm
        record.append(entry)
    caught.__exit__(None, None, None)
    if name == "ours":
        fallbacks = [str(w.message) for w in arena_warnings if "flat_grads" in str(w.message)]
    flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten() for p in inner.parameters()])
    runs[name] = (record, flat, scaler)

ours_record, ours_params, ours_scaler = runs["ours"]
ref_record, ref_params, _ = runs["torch"]
gathered = [torch.empty_like(ours_params) for _ in range(info.world_size)]
dist.all_gather(gathered, ours_params)
Path(args.out, f"rank{info.rank}.json").write_text(json.dumps({
    "rank": info.rank,
    "grad_type": grad_type,
    "out_dtype": str(out.dtype),
    "kernel": be.kernel.name,
    "ours": ours_record,
    "torch": ref_record,
    "params_equal": bool(torch.equal(ours_params, ref_params)),
    "params_max_diff": float((ours_params - ref_params).abs().max()),
    "identical_across_ranks": all(torch.equal(gathered[0], t) for t in gathered),
    "fallbacks": fallbacks,
    "stats": {"skipped": ours_scaler.stats.skipped, "overflows": ours_scaler.stats.overflows},
}))
distributed.destroy_process_group()
