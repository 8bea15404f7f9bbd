"""A torchrun worker (2 CPU ranks over gloo): fp8 training (emulated, a precision policy's ``fp8=``)
wrapped in DDP or FSDP2, under bf16 autocast, against the same steps computed by hand on every rank:
each rank's batch through the fp8 model alone, the gradients averaged, the optimizer stepped.

--wrap ddp:   DistributedDataParallel over the converted model.
--wrap fsdp2: fully_shard on each fp8 layer and the model (parameters and gradients are DTensor shards).
--all-gather: with fsdp2, the policy's fp8_all_gather=True (FSDP2 gathers the weights in fp8); the
              reference stays the model by hand without it.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import amp_backends
from amp_backends import distributed, precision_policy

parser = argparse.ArgumentParser()
parser.add_argument("--wrap", choices=["ddp", "fsdp2"], required=True)
parser.add_argument("--recipe", default="tensorwise")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--all-gather", action="store_true")
parser.add_argument("--out", required=True)
args = parser.parse_args()
warnings.simplefilter("ignore", amp_backends.PerformanceWarning)

info = distributed.init_process_group("cpu")
torch.manual_seed(0)
base = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
batches = []
for step in range(args.steps):
    g = torch.Generator().manual_seed(1000 + step)
    batches.append([(torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)) for _ in range(info.world_size)])


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", torch.bfloat16):
        out = model(x)
    return nn.functional.mse_loss(out.float(), y)


# the reference: every rank's batch through one fp8 model, the gradients averaged by hand
reference = copy.deepcopy(base)
precision_policy(reference, fp32=(), fp8=[nn.Linear], fp8_recipe=args.recipe, emulate=True)
ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
for step_batches in batches:
    grads = []
    for x, y in step_batches:
        reference.zero_grad()
        loss_of(reference, x, y).backward()
        grads.append([p.grad.clone() for p in reference.parameters()])
    for p, *per_rank in zip(reference.parameters(), *grads):
        p.grad = sum(per_rank[1:], per_rank[0]) / info.world_size
    ref_opt.step()

model = copy.deepcopy(base)
policy = precision_policy(model, fp32=(), fp8=[nn.Linear], fp8_recipe=args.recipe, emulate=True,
                          fp8_all_gather=args.all_gather)
gathered_dtypes: list[str] = []  # what FSDP2 all-gathers for each fp8 weight (torchao's pre-all-gather hook)
if args.all_gather:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    pre_all_gather = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    @functools.wraps(pre_all_gather)  # FSDP2 checks the hook's signature: torchao's, through __wrapped__
    def recording(self, *a, **k):
        out = pre_all_gather(self, *a, **k)
        gathered_dtypes.extend(str(t.dtype) for t in out[0])
        return out

    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = recording
layers = [type(m).__name__ for m in model]
if args.wrap == "ddp":
    wrapped = nn.parallel.DistributedDataParallel(model)
else:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    wrapped = fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
losses = []
for step_batches in batches:
    opt.zero_grad()
    x, y = step_batches[info.rank]
    loss = loss_of(wrapped, x, y)
    loss.backward()
    opt.step()
    losses.append(loss.item())

params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in model.parameters()]
flat = torch.cat([p.flatten() for p in params])
gathered = [torch.empty_like(flat) for _ in range(info.world_size)]
dist.all_gather(gathered, flat)
ref_flat = torch.cat([p.detach().flatten() for p in reference.parameters()])
Path(args.out, f"rank{info.rank}.json").write_text(json.dumps({
    "layers": layers,
    "converted": sorted(policy.fp8),
    "grad_type": type(next(model.parameters()).grad).__name__ if next(model.parameters()).grad is not None else None,
    "equal_to_reference": bool(torch.equal(flat, ref_flat)),
    "max_diff": float((flat - ref_flat).abs().max()),
    "identical_across_ranks": all(torch.equal(gathered[0], t) for t in gathered),
    "losses": losses,
    "gathered_dtypes": sorted(set(gathered_dtypes)),
    "gathers": len(gathered_dtypes),
}))
distributed.destroy_process_group()
