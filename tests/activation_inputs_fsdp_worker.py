"""The MLP levers under FSDP2 on 2 CPU ranks (gloo), launched by torchrun from tests/memory/test_activation_inputs.py.

Each rank builds the same two MLP blocks in a ModuleList (``mlp_blocks.MlpBlocks``), turns on the
activations' inputs and outputs levers, then fully_shard on each block and on the root, and runs one
bf16-autocast step; the same without the levers. Written: whether the full gradients agree bitwise, and
how often the up-projection ran again in the backward.
"""

import argparse
import json
from pathlib import Path

import torch
from amp_backends import distributed
from amp_backends.distributed.sharding import fsdp_api
from amp_backends.memory import activation_inputs, recompute_activation_inputs, recompute_activation_outputs
from mlp_blocks import MlpBlocks

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

info = distributed.init_process_group("cpu")
fully_shard, _ = fsdp_api()

remakes = [0]
_call = activation_inputs._UpProjection.__call__


def _counted(self, x):  # type: ignore[no-untyped-def]
    remakes[0] += 1
    return _call(self, x)


activation_inputs._UpProjection.__call__ = _counted  # type: ignore[method-assign]


grads = {}
for on in (False, True):
    torch.manual_seed(0)
    net = MlpBlocks()
    if on:
        recompute_activation_inputs(net)
        recompute_activation_outputs(net)
    for block in net.blocks:
        fully_shard(block)
    fully_shard(net)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(info.rank))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = net(x).float().pow(2).mean()
    loss.backward()
    grads[on] = [p.grad.full_tensor() for p in net.parameters()]
result = {"rank": info.rank, "same": all(torch.equal(a, b) for a, b in zip(grads[False], grads[True])),
          "remakes": remakes[0]}
Path(args.out, f"rank{info.rank}.json").write_text(json.dumps(result))
distributed.destroy_process_group()  # barrier, destroy, collect: avoids Gloo's abort at exit
