"""The lazy LM head under DDP on 2 CPU ranks (gloo), launched by torchrun from tests/memory/test_lean_loss.py.

Each rank builds the same tiny LM, wraps it in DDP (then, another, in FSDP2's fully_shard) and runs one
forward with the head lever on: the lever must be refused (before any gradient is computed), and the
check ``memory_lean`` calls must say so too. Then the way out the message names: the fused loss computed inside the wrapped model's
forward, whose gradients DDP reduces (checked against DDP's plain loss on the full logits).
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from amp_backends import distributed
from amp_backends.distributed.sharding import fsdp_api
from amp_backends.memory.chunked_loss import LazyHeadError, head_lever_refusal, lazy_head, undo_lazy_head
from amp_backends.memory.fused_loss import linear_cross_entropy

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--fsdp2", action="store_true", help="also FSDP2 (fully_shard on CPU needs torch 2.6+)")
args = parser.parse_args()

info = distributed.init_process_group("cpu")


class LM(nn.Module):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.body, self.head, self.fused = nn.Linear(8, 8), nn.Linear(8, 32, bias=False), fused

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if self.fused:
            return linear_cross_entropy(h, self.head.weight, y)
        return F.cross_entropy(self.head(h).float(), y)


g = torch.Generator().manual_seed(10 + info.rank)
x, y = torch.randn(12, 8, generator=g), torch.randint(0, 32, (12,), generator=g)
result: dict = {"rank": info.rank, "world": info.world_size}

torch.manual_seed(0)
model = LM()
result["refusal"] = head_lever_refusal(model, model.head)
lazy_head(model.head)
ddp = DDP(model)
try:
    ddp(x, y)
    result["forward"] = "ran"
except LazyHeadError as exc:
    result["forward"] = str(exc)
undo_lazy_head(model.head)

if args.fsdp2:
    fully_shard, _ = fsdp_api()
    torch.manual_seed(0)
    sharded = LM()
    lazy_head(sharded.head)
    fully_shard(sharded)
    result["fsdp2_refusal"] = head_lever_refusal(sharded, sharded.head)
    try:
        sharded(x, y)
        result["fsdp2_forward"] = "ran"
    except LazyHeadError as exc:
        result["fsdp2_forward"] = str(exc)

grads = {}
for fused in (False, True):
    torch.manual_seed(0)
    net = DDP(LM(fused))
    net(x, y).backward()
    grads[fused] = [p.grad for p in net.parameters()]
result["fused_vs_plain"] = max(float((a - b).abs().max()) for a, b in zip(grads[True], grads[False]))
others = [torch.zeros_like(grads[True][1]) for _ in range(info.world_size)]
torch.distributed.all_gather(others, grads[True][1])
result["head_grad_same_on_ranks"] = all(torch.equal(o, others[0]) for o in others)
Path(args.out, f"rank{info.rank}.json").write_text(json.dumps(result))
distributed.destroy_process_group()  # barrier, destroy, collect: avoids Gloo's abort at exit
