"""FSDP2 with the MixedPrecisionPolicy from the backend and the precision policy
(amp_backends.distributed.shard_in_low_precision) against fully_shard with hand-written policies,
on 2 CPU ranks (gloo), launched by torchrun from tests/distributed/test_comms.py; collectives counted as dispatched."""

import argparse
import dataclasses
import json
from pathlib import Path

import torch

import amp_backends
from amp_backends import distributed
from amp_backends.devices import collectives
from amp_backends.distributed.sharding import fsdp_api

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

info = distributed.init_process_group("cpu")
be = info.backend
world = info.world_size
fully_shard, MixedPrecisionPolicy = fsdp_api()
g = torch.Generator().manual_seed(100 + info.rank)
X, Y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))


GATHERS = ["_allgather_base_", "allgather_into_tensor_coalesced_"]
SCATTERS = ["_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"]


def by_hand(net: Net, reduce_dtype: torch.dtype, param_dtype: torch.dtype = torch.bfloat16) -> None:
    full = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    fully_shard(net.head, mp_policy=full)
    fully_shard(net.norm, mp_policy=full)
    fully_shard(net.body, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    fully_shard(net, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                                    output_dtype=torch.float32))


def run(how: str, reduce_dtype: torch.dtype = torch.float32) -> dict:
    net = Net()
    head_dtypes = []
    net.head.register_forward_pre_hook(lambda m, a: head_dtypes.append(str(m.weight.dtype)))
    plan = None
    if how in ("ours", "ours_mesh"):
        policy = amp_backends.precision_policy(net)  # the recipe: the norm and the head in float32
        mesh = None
        if how == "ours_mesh":
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (world,))
        plan = distributed.shard_in_low_precision(net, be, policy=policy, blocks=[net.body], reduce_dtype=reduce_dtype,
                                                  mesh=mesh)
    elif how == "hand":
        by_hand(net, reduce_dtype)
    elif how == "hand_fp32":  # the same modules sharded, every policy float32
        by_hand(net, torch.float32, torch.float32)
    else:
        fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    rec = []
    for step in range(args.steps):
        opt.zero_grad()
        with distributed.count_collectives() as log:
            out = net(X)
            loss = torch.nn.functional.mse_loss(out, Y)
            loss.backward()
        opt.step()
        rec.append({"loss": float(loss), "out_dtype": str(out.dtype),
                    "gather_bytes": log.bytes(["_allgather_base_", "allgather_into_tensor_coalesced_"]),
                    "gather_dtypes": sorted(map(str, log.dtypes(["_allgather_base_", "allgather_into_tensor_coalesced_"]))),
                    "scatter_bytes": log.bytes(["_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"]),
                    "scatter_dtypes": sorted(map(str, log.dtypes(["_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"]))),
                    "gather_by_dtype": log.bytes_by_dtype(GATHERS), "scatter_by_dtype": log.bytes_by_dtype(SCATTERS),
                    "scatter_ops": sorted(map(str, log.reduce_ops(SCATTERS))),
                    "ops": sorted({r.op for r in log.records})})
    shards = torch.cat([p.to_local().detach().flatten() for p in net.parameters()])
    return {"shards": shards, "record": rec, "head_dtypes": sorted(set(head_dtypes)),
            "policies": {k: [str(v.param_dtype), str(v.reduce_dtype), str(v.output_dtype)]
                         for k, v in (plan.policies.items() if plan else [])},
            "reduction": plan.reduction if plan else None}


def refusal() -> dict:
    net = Net()
    nobf16 = type("NoBF16Gather", (type(be),), {"collectives": dataclasses.replace(
        collectives.GLOO, library="nobf16", gather_dtypes=(torch.float32,))})()
    try:
        distributed.shard_in_low_precision(net, nobf16)
        return {"error": None}
    except distributed.CollectiveError as e:
        return {"error": str(e), "untouched": not any(hasattr(m, "unshard") for m in net.modules())}


def premul_sum() -> str | None:
    """What the divide-then-SUM comm avoids: fully_shard's PREMUL_SUM for a custom factor, which gloo refuses."""
    net = Net()
    fully_shard(net, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    if not hasattr(net, "set_gradient_divide_factor"):
        return None
    net.set_gradient_divide_factor(4.0)
    try:  # the loss in float32, as the other runs take it (output_dtype): torch 2.11 cannot differentiate
        # mse_loss between a bfloat16 output and a float32 target ("Found dtype Float but expected BFloat16")
        torch.nn.functional.mse_loss(net(X).float(), Y).backward()
    except RuntimeError as e:
        return str(e)
    return "accepted"


def gaudi() -> dict:
    """Under Gaudi's HCCL (simulated: it refuses AVG and PREMUL_SUM): fully_shard's own AVG fails at the first
    backward, as on the hardware; shard_in_low_precision, checked against the same declaration, divides and sums."""
    from amp_backends.testing.simcollectives import REDUCTIONS, SimulatedCollectiveError, simulated_library

    declared = dataclasses.replace(collectives.GAUDI_HCCL, process_group="gloo")
    gaudi_cpu = type("GaudiLike", (type(be),), {"collectives": declared})()
    net = Net()
    by_hand(net, torch.float32)
    with distributed.count_collectives() as log:  # the reduce ops this torch's fully_shard issues by hand, unrefused
        torch.nn.functional.mse_loss(net(X), Y).backward()
    out: dict = {"hand_ops": sorted((op or "SUM").lower() for op in log.reduce_ops(list(REDUCTIONS)))}
    for how in ("hand", "ours"):
        net = Net()
        if how == "hand":
            by_hand(net, torch.float32)
        else:
            distributed.shard_in_low_precision(net, gaudi_cpu, policy=amp_backends.precision_policy(net),
                                               blocks=[net.body])
        try:
            with simulated_library(declared):
                torch.nn.functional.mse_loss(net(X), Y).backward()
            out[how] = None
        except SimulatedCollectiveError as e:
            out[how] = str(e)
    return out


runs = {"ours": run("ours"), "hand": run("hand"), "fp32": run("fp32"), "hand_fp32": run("hand_fp32"),
        "ours_bf16": run("ours", torch.bfloat16), "hand_bf16": run("hand", torch.bfloat16),
        "ours_fp16": run("ours", torch.float16), "hand_fp16": run("hand", torch.float16),
        "ours_mesh": run("ours_mesh")}
result = {
    "equal_fp32_reduce": torch.equal(runs["ours"]["shards"], runs["hand"]["shards"]),
    "equal_bf16_reduce": torch.equal(runs["ours_bf16"]["shards"], runs["hand_bf16"]["shards"]),
    "equal_with_mesh": torch.equal(runs["ours_mesh"]["shards"], runs["ours"]["shards"]),
    "equal_fp16_reduce": torch.equal(runs["ours_fp16"]["shards"], runs["hand_fp16"]["shards"]),
    "max_diff_vs_fp32": float((runs["ours"]["shards"] - runs["hand_fp32"]["shards"]).abs().max()),
    "max_diff_bf16_vs_fp32": float((runs["ours_bf16"]["shards"] - runs["hand_fp32"]["shards"]).abs().max()),
    "runs": {k: {kk: vv for kk, vv in v.items() if kk != "shards"} for k, v in runs.items()},
    "refusal": refusal(),
    "premul_sum": premul_sum(),
    "gaudi": gaudi(),
}
Path(args.out, f"rank{info.rank}.json").write_text(json.dumps(result))
distributed.destroy_process_group()
