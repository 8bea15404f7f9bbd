"""Low-precision DDP gradient reduction on 2 CPU ranks (gloo), launched by torchrun from tests/distributed/test_comms.py.

Each run builds the same model from the same seed, wraps it in DDP and trains a few steps on this
rank's data, with one way of reducing gradients: DDP's own float32 all-reduce, our hook
(``reduce_in_low_precision``), torch's ``fp16_compress_hook``, the bf16 recipe written out here
(torch's ``bf16_compress_hook`` is refused on a CPU build of torch), and torch's ``_compress_hook``
with bfloat16 where torch has it. The collectives of each step are counted as dispatched.
"""

import argparse
import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import amp_backends
from amp_backends import distributed
from amp_backends.devices import collectives
from amp_backends.distributed.counting import count_collectives

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--quick", action="store_true", help="float32 and our bf16 reduction only (the two-node test)")
args = parser.parse_args()

info = distributed.init_process_group("cpu")
be = info.backend
world = info.world_size
g = torch.Generator().manual_seed(100 + info.rank)
X, Y = torch.randn(4, 16, 32, generator=g), torch.randn(4, 16, 4, generator=g)


def bf16_recipe(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's compression recipe (default_hooks.py) written out for bfloat16: cast, divide, SUM, copy back."""
    buffer = bucket.buffer()
    low = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(low, async_op=True).get_future()

    def back(f: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(f.value()[0])
        return buffer

    return fut.then(back)


def torch_bf16(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return default_hooks._compress_hook(torch.bfloat16, state, bucket)  # type: ignore[attr-defined]  # torch's private hook, compared against


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def flat(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in m.parameters()])


def train(reduce: str, *, steps: int = args.steps, scale: float | None = None, accumulate: bool = False,
          arena: bool = False, clip: float | None = None, autocast: bool = True) -> dict:
    net = model()
    ddp = DDP(net)
    state = None
    if reduce == "ours_fp16":
        state = distributed.reduce_in_low_precision(ddp, be, torch.float16)
    elif reduce == "ours_bf16":
        state = distributed.reduce_in_low_precision(ddp, be)  # the cpu backend's default: bfloat16
    elif reduce != "fp32":
        hook: Callable = {"torch_fp16": default_hooks.fp16_compress_hook, "recipe_bf16": bf16_recipe,
                          "torch_bf16": torch_bf16}[reduce]
        ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    if arena:
        amp_backends.flat_grads(opt)
    scaler = amp_backends.GradScaler(be, init_scale=scale, growth_interval=10_000) if scale else None
    rec = []
    for step in range(steps):
        opt.zero_grad()
        micro = [(X[step % 4][:8], Y[step % 4][:8]), (X[step % 4][8:], Y[step % 4][8:])] if accumulate else \
            [(X[step % 4], Y[step % 4])]
        with distributed.count_collectives() as log:
            for i, (x, y) in enumerate(micro):
                sync = i == len(micro) - 1
                ctx = ddp.no_sync() if not sync else torch.enable_grad()
                with ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = torch.nn.functional.mse_loss(ddp(x).float(), y) / len(micro)
                (scaler.scale(loss) if scaler else loss).backward()
        norm = None
        if scaler:
            if clip:
                norm = float(scaler.clip_grad_norm_(opt, clip))
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        rec.append({"loss": float(loss) * len(micro), "allreduce_bytes": log.bytes("allreduce_"),
                    "allreduces": len(log.of("allreduce_")),
                    "dtypes": sorted(str(d) for d in log.dtypes("allreduce_")),
                    "skipped": scaler.last_step_skipped if scaler else False,
                    "scale": scaler.get_scale() if scaler else None, "norm": norm,
                    "hook_bytes": state.bytes_sent if state else None})
        if state:
            state.reset_counts()
    params = flat(net)
    gathered = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(gathered, params)
    return {"params": params, "record": rec, "numel": params.numel(),
            "identical_across_ranks": all(torch.equal(gathered[0], t) for t in gathered),
            "finite": bool(params.isfinite().all())}


def refusals() -> dict:
    """Each bad call raises before anything is registered; the same DDP model then takes our hook."""
    cpu_cls = type(be)
    out = {}
    ddp = DDP(model())
    cases = {
        "no_fp16": (type("NoFP16", (cpu_cls,), {"collectives": dataclasses.replace(
            collectives.GLOO, library="nofp16", reduce_dtypes=(torch.bfloat16, torch.float32))})(), torch.float16),
        "upcasts_fp16": (type("Upcast", (cpu_cls,), {"collectives": dataclasses.replace(
            collectives.GAUDI_HCCL, process_group="gloo")})(), torch.float16),
        "no_sum": (type("NoSum", (cpu_cls,), {"collectives": dataclasses.replace(
            collectives.GLOO, library="nosum", reduce_ops=("max",))})(), torch.bfloat16),
        "float32": (be, torch.float32),
    }
    for name, (backend, dtype) in cases.items():
        try:
            distributed.reduce_in_low_precision(ddp, backend, dtype)
            out[name] = None
        except distributed.CollectiveError as e:
            out[name] = str(e)
    try:
        distributed.reduce_in_low_precision(model(), be)  # type: ignore[arg-type]  # the wrong type on purpose: the refusal is the test
    except TypeError as e:
        out["not_ddp"] = str(e)
    out["hooks_after_refusals"] = len(ddp._comm_hooks)
    from amp_backends.distributed.sharding import _can_divide_then_sum

    if not _can_divide_then_sum():  # fully_shard would reduce float32 with AVG, which gloo refused before PR 149781
        try:
            distributed.shard_in_low_precision(model(), be)
            out["fsdp_old_torch"] = None
        except distributed.CollectiveError as e:
            out["fsdp_old_torch"] = str(e)
    distributed.reduce_in_low_precision(ddp, be, torch.float16)
    try:
        distributed.reduce_in_low_precision(ddp, be, torch.float16)
    except RuntimeError as e:
        out["twice"] = str(e)
    return out


def simulations() -> dict:
    """Collectives gloo runs, refused (or not) by the simulated vendor libraries, as the real ones would."""
    from amp_backends.testing.simcollectives import SimulatedCollectiveError, simulated_library

    def attempt(library: collectives.Collectives, call: Callable[[], object]) -> str | None:
        try:
            with simulated_library(library):
                call()
        except SimulatedCollectiveError as e:
            return str(e)
        return None

    t64 = torch.ones(4, dtype=torch.float64)
    with count_collectives() as log:  # whether this torch shows a collective's ReduceOp to Python (2.11 does, 2.8
        dist.all_reduce(torch.ones(4))  # does not): the simulated library can refuse only an op it sees
    shows_op = log.reduce_ops() == {"SUM"}
    out = {
        "hccl_fp64_allreduce": attempt(collectives.HCCL, lambda: dist.all_reduce(t64)),
        "cncl_fp64_broadcast": attempt(collectives.CNCL, lambda: dist.broadcast(t64, 0)),
        "gloo_fp64_allreduce": attempt(collectives.GLOO, lambda: dist.all_reduce(t64)),
        "gaudi_avg": attempt(collectives.GAUDI_HCCL, lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.AVG))
        if _TORCH >= (2, 8) and shows_op else "not run: older gloo refuses AVG itself, and this torch hides the op",
        "shows_op": shows_op,
    }

    def ddp_step(dtype: torch.dtype) -> None:
        ddp = DDP(model())
        distributed.reduce_in_low_precision(ddp, be, dtype)
        torch.nn.functional.mse_loss(ddp(X[0]), Y[0]).backward()

    out["cncl_ddp_bf16"] = attempt(collectives.CNCL, lambda: ddp_step(torch.bfloat16))
    out["gaudi_ddp_bf16"] = attempt(collectives.GAUDI_HCCL, lambda: ddp_step(torch.bfloat16))
    out["gaudi_sum_allowed"] = attempt(collectives.GAUDI_HCCL, lambda: dist.all_reduce(torch.ones(4)))
    return out


_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if args.quick:
    runs = {r: train(r) for r in ("fp32", "ours_bf16")}
    Path(args.out, f"rank{info.rank}.json").write_text(json.dumps({
        "rank": info.rank, "world_size": world, "node": int(os.environ.get("GROUP_RANK", -1)), "numel": runs["fp32"]["numel"],
        "runs": {k: {"record": v["record"], "identical_across_ranks": v["identical_across_ranks"],
                     "max_diff_vs_fp32": float((v["params"] - runs["fp32"]["params"]).abs().max())} for k, v in runs.items()}}))
    distributed.destroy_process_group()
    raise SystemExit(0)
runs = {r: train(r) for r in ("fp32", "ours_fp16", "torch_fp16", "ours_bf16", "recipe_bf16")}
if hasattr(default_hooks, "_compress_hook"):
    runs["torch_bf16"] = train("torch_bf16")
# float16 overflow: a loss scale that float32 buckets hold and float16 ones do not
over = {r: train(r, scale=2.0**22, autocast=False) for r in ("ours_fp16", "fp32")}
# no_sync accumulation, flat gradients, the scaler and clipping
acc = {r: train(r, scale=2.0**8, accumulate=True, arena=True, clip=0.5) for r in ("ours_fp16", "torch_fp16")}

ref = runs["fp32"]["params"]
result = {
    "rank": info.rank, "world_size": world, "numel": runs["fp32"]["numel"],
    "runs": {k: {"record": v["record"], "identical_across_ranks": v["identical_across_ranks"],
                 "max_diff_vs_fp32": float((v["params"] - ref).abs().max())} for k, v in runs.items()},
    "ours_fp16_equals_torch": torch.equal(runs["ours_fp16"]["params"], runs["torch_fp16"]["params"]),
    "ours_bf16_equals_recipe": torch.equal(runs["ours_bf16"]["params"], runs["recipe_bf16"]["params"]),
    "ours_bf16_equals_torch": (torch.equal(runs["ours_bf16"]["params"], runs["torch_bf16"]["params"])
                               if "torch_bf16" in runs else None),
    "overflow": {k: {"record": v["record"], "finite": v["finite"], "identical_across_ranks": v["identical_across_ranks"]}
                 for k, v in over.items()},
    "accumulate": {k: {"record": v["record"], "identical_across_ranks": v["identical_across_ranks"]}
                   for k, v in acc.items()},
    "accumulate_equal": torch.equal(acc["ours_fp16"]["params"], acc["torch_fp16"]["params"]),
    "refusals": refusals(),
    "simulations": simulations(),
}
Path(args.out, f"rank{info.rank}.json").write_text(json.dumps(result, default=lambda o: None if o != o else o))
distributed.destroy_process_group()
