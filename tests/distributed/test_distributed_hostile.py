"""Hostile distributed programs on real gloo CPU ranks (torch.multiprocessing, start method spawn, one
thread each): a rank whose optimizer has no gradient this step, a found_inf query made on one rank only,
ranks on different step paths (fused SGD with momentum whose buffers are not all made), a tied
embedding/head sharded with FSDP2, and the payloads count_collectives reads from gather, scatter,
all_gather_coalesced, all_to_all and a barrier.

Each worker below runs inside the spawned ranks and writes what it saw as JSON; the tests compare it with
torch's own programs (ShardedGradScaler, torch.amp.GradScaler, fully_shard by hand) or with the tensors
handed to the collectives. Every rank all-reduces a logging value after each step, as training scripts
do: a scaler collective one rank makes and another does not pairs with it, and the sum comes out wrong
(or a rank waits until gloo's timeout, which fails the test rather than hanging it).
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from torchrun import TORCH_MINOR

# end to end through fresh gloo ranks (about two minutes together): the torch-version legs skip them
pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed"),
              pytest.mark.slow]

#: Seconds a gloo collective waits for the other ranks: a desynchronised program fails in that time.
_PG_TIMEOUT = 30
#: Seconds a whole spawned program may take before its ranks are killed.
_DEADLINE = 150
#: What every rank contributes to the logging all-reduce after each step: 10 + rank, summed 21 on 2 ranks.
_LOGGED = 21.0


# -- the launcher -------------------------------------------------------------------------------------

def _entry(rank: int, world: int, store: str, out: str, worker: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=_PG_TIMEOUT))
    result = worker(rank, world, *args)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def spawn(tmp_path: Path, worker: Callable[..., Any], *args: Any, world: int = 2) -> list[dict]:
    """Run ``worker(rank, world, *args)`` on ``world`` gloo ranks (a FileStore in ``tmp_path``); its results per rank."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        ctx = mp.start_processes(_entry, args=(world, str(tmp_path / "store"), str(tmp_path), worker, args),
                                 nprocs=world, join=False, start_method="spawn")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    deadline = time.monotonic() + _DEADLINE
    try:
        while not ctx.join(timeout=1):  # raises with the rank's traceback where one failed
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                pytest.fail(f"{worker.__name__} did not finish in {_DEADLINE} s")
    except ProcessException as e:
        # a rank that made fewer collectives may have finished (and closed its connections) while another
        # still waits in one: show what the finished ranks saw as well as the failure
        done = {r: (tmp_path / f"rank{r}.json").read_text()[:4000] for r in range(world)
                if (tmp_path / f"rank{r}.json").exists()}
        last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise AssertionError(f"{worker.__name__} failed: {last}\nranks that finished: {done}\n{e}") from None
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _logged(rank: int) -> float:
    """The user's own all-reduce after a step (a loss summed for the log): 21 where nothing desynchronised."""
    t = torch.tensor([10.0 + rank])
    dist.all_reduce(t)
    return t.item()


def _sharded_scaler(init_scale: float) -> Any:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device="cpu", init_scale=init_scale, growth_interval=1000, process_group=dist.group.WORLD)


def _our_scaler(init_scale: float, **kwargs: Any) -> Any:
    from amp_backends import GradScaler

    return GradScaler("cpu", init_scale=init_scale, growth_interval=1000, process_group="world", **kwargs)


# -- the workers (run in the spawned ranks) ---------------------------------------------------------------

def _no_grad_rank(rank: int, world: int) -> dict:
    """ZeRO-like shards: each rank's optimizer holds its own parameter; rank 1's gets a gradient at steps 1
    and 4 only. inf on rank 0 at step 0 (rank 1 has no gradient then) and on rank 1 at step 4."""
    out: dict = {}
    for which in ("torch", "ours"):  # the reference first: it completes whatever ours does
        for kind in ("sgd", "sgd_fused"):
            torch.manual_seed(0)
            p = torch.nn.Parameter(torch.randn(4))
            opt = torch.optim.SGD([p], lr=0.1, fused=kind == "sgd_fused")
            scaler = _sharded_scaler(4.0) if which == "torch" else _our_scaler(4.0)
            rec = []
            for step in range(5):
                loss = (p * p * (rank + 1) * (step + 1)).sum()
                if rank == 0 or step in (1, 4):
                    scaler.scale(loss).backward()
                    if (rank, step) in ((0, 0), (1, 4)):
                        p.grad[1] = float("inf")
                else:
                    scaler.scale(loss)  # this shard took no part in the loss: p.grad stays None
                if which == "torch" and kind == "sgd_fused":
                    scaler.unscale_(opt)  # ShardedGradScaler agrees on found_inf in unscale_ only
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                rec.append({"scale": scaler.get_scale(), "p": p.detach().tolist(), "logged": _logged(rank)})
            out[f"{which}_{kind}"] = rec
    return out


def _no_grad_check_finite(rank: int, world: int) -> dict:
    """Scaling off, check_finite: rank 1 has no gradient at steps 0 and 2 ("none"), or a zero gradient there
    ("zero", the reference: it changes nothing under plain SGD and every rank joins); inf on rank 0 at
    step 1, NaN on rank 1 at step 3."""
    out: dict = {}
    for how in ("zero", "none"):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = _our_scaler(1.0, enabled=False, check_finite=True)
        rec = []
        for step in range(4):
            if rank == 0 or step in (1, 3):
                (p * p * (rank + 1)).sum().backward()
            elif how == "zero":
                p.grad = torch.zeros_like(p)
            if (rank, step) == (0, 1):
                p.grad[0] = float("inf")
            if (rank, step) == (1, 3):
                p.grad[2] = float("nan")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            rec.append({"skipped": scaler.last_step_skipped, "p": p.detach().tolist(), "logged": _logged(rank)})
        out[how] = rec
    return out


def _fsdp1_empty_shard(rank: int, world: int) -> dict:
    """FSDP1 (use_orig_params=True) holding a 1-element parameter: rank 1's shard is padding only, its
    optimizer never sees a gradient. inf on rank 0 at step 1."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.full((1,), 0.5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.w * x).pow(2).sum()

    out: dict = {}
    for which in ("torch", "ours"):
        net = FullyShardedDataParallel(Net(), use_orig_params=True, device_id=torch.device("cpu"))
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        scaler = _sharded_scaler(4.0) if which == "torch" else _our_scaler(4.0)
        rec = []
        for step in range(3):
            scaler.scale(net(torch.arange(1.0, 4.0) * (rank + 1))).backward()
            grads = [q.grad is not None for q in net.parameters()]
            if rank == 0 and step == 1:
                next(net.parameters()).grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            with FullyShardedDataParallel.summon_full_params(net):
                w = net.module.w.detach().tolist()
            rec.append({"scale": scaler.get_scale(), "w": w, "has_grad": grads, "logged": _logged(rank)})
        out[which] = rec
    return out


def _found_inf_query(rank: int, world: int) -> dict:
    """Scaling off, check_finite: NaN on rank 1 at step 0, inf on rank 0 at step 2; rank 0 alone asks
    scaler.found_inf(opt) before each step ("ask") or nobody asks ("quiet")."""
    out: dict = {}
    for how in ("quiet", "ask"):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = _our_scaler(1.0, enabled=False, check_finite=True)
        rec = []
        for step in range(4):
            (p * p * (rank + 1)).sum().backward()
            if (rank, step) == (1, 0):
                p.grad[0] = float("nan")
            if (rank, step) == (0, 2):
                p.grad[3] = float("inf")
            asked = scaler.found_inf(opt) if how == "ask" and rank == 0 else None
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            rec.append({"asked": asked, "skipped": scaler.last_step_skipped, "p": p.detach().tolist(),
                        "logged": _logged(rank)})
        out[how] = rec
    return out


def _momentum_program(rank: int, which: str, count: bool) -> list[dict]:
    """Fused SGD with momentum: ``a`` in one parameter group, stepped every step; on the last rank a second
    group holding ``b``, whose first gradient (and so its momentum buffer) comes at step 2; inf at step 3
    on the last rank. Each group's buffers are all made or all missing (what torch's fused SGD takes)."""
    from amp_backends.distributed import count_collectives
    from amp_backends.scaler.treatment import momentum_buffers_missing

    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))
    last = rank == dist.get_world_size() - 1
    groups = [{"params": [a]}] + ([{"params": [b]}] if last else [])
    opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9, fused=True)
    if which == "torch_amp":
        scaler: Any = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1000)
    elif which == "torch_sharded":
        scaler = _sharded_scaler(256.0)
    else:
        scaler = _our_scaler(256.0)
    rec = []
    for step in range(6):
        loss = (a * a * (step + 1)).sum() + ((b * b * (rank + 2)).sum() if last and step >= 2 else 0)
        scaler.scale(loss).backward()
        if step == 3 and last:
            a.grad[2] = float("inf")
        host_path = momentum_buffers_missing(opt)
        if which == "torch_sharded":
            scaler.unscale_(opt)  # ShardedGradScaler agrees on found_inf in unscale_ only
        if count:
            with count_collectives() as log:
                scaler.step(opt)
            allreduces = len(log.of("allreduce_"))
        else:
            scaler.step(opt)
            allreduces = None
        scaler.update()
        opt.zero_grad()
        rec.append({"host_path": host_path, "allreduces": allreduces, "scale": scaler.get_scale(),
                    "a": a.detach().tolist(), "b": b.detach().tolist(),
                    "logged": _logged(rank)})
    return rec


def _host_path_one_process(rank: int, world: int) -> dict:
    return {which: _momentum_program(rank, which, count=True) for which in ("torch_amp", "ours")}


def _paths_differ(rank: int, world: int) -> dict:
    return {which: _momentum_program(rank, which, count=which == "ours") for which in ("torch_sharded", "ours")}


class _LM(torch.nn.Module):
    """GPT-2's tie: head.weight is embed.weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(17, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(2)])
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 17, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class _RootTied(torch.nn.Module):
    """The head's weight is a parameter registered on the root itself."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(17, 8))
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 17, bias=False)
        self.head.weight = self.w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _tied(rank: int, world: int) -> dict:
    import amp_backends
    from amp_backends.distributed import shard_in_low_precision
    from amp_backends.distributed.sharding import fsdp_api
    from torch.distributed.fsdp import FSDPModule

    fully_shard, MixedPrecisionPolicy = fsdp_api()
    out: dict = {}
    # a tie with the root: refused, nothing sharded
    root_tied = _RootTied()
    policy = amp_backends.precision_policy(root_tied)
    try:
        shard_in_low_precision(root_tied, "cpu", policy=policy, blocks=[root_tied.body])
        out["refusal"] = None
    except ValueError as e:
        out["refusal"] = str(e)
    out["refusal_selected"] = sorted(policy.selected)
    out["refusal_sharded"] = [n for n, m in root_tied.named_modules() if isinstance(m, FSDPModule)]

    g = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randint(0, 17, (2, 5), generator=g) for _ in range(3)]
    for how in ("hand", "ours"):
        net = _LM()
        policy = amp_backends.precision_policy(net)  # the recipe: the norm and the head in float32
        run: dict = {"selected": sorted(policy.selected)}
        try:
            if how == "ours":
                plan = shard_in_low_precision(net, "cpu", policy=policy, blocks=list(net.layers))
                run["policies"] = {k: [str(v.param_dtype), str(v.reduce_dtype)] for k, v in plan.policies.items()}
            else:  # what shard_in_low_precision does, written out: blocks, the tied pair with the head's policy, the norm, the root
                low = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                full = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
                for layer in net.layers:
                    fully_shard(layer, mp_policy=low)
                fully_shard([net.embed, net.head], mp_policy=full)
                fully_shard(net.norm, mp_policy=full)
                fully_shard(net, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                                output_dtype=torch.float32))
            run["still_tied"] = net.head.weight is net.embed.weight
            opt = torch.optim.SGD(net.parameters(), lr=0.5)
            losses = []
            for x in xs:
                loss = net(x).float().logsumexp(-1).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            run["losses"] = losses
            run["shards"] = {n: p.to_local().detach().flatten().tolist() for n, p in net.named_parameters()}
            run["error"] = None
        except Exception as e:  # noqa: BLE001 - recorded for the test to show
            run["error"] = f"{type(e).__name__}: {e}"
        out[how] = run
    return out


def _counting(rank: int, world: int) -> dict:
    """Each rank hands over 1000 float32 (4000 bytes) of its own; scatter's root hands one tensor per rank."""
    import warnings

    from amp_backends.distributed import count_collectives

    def run(call: Callable[[], Any], sent: list[torch.Tensor]) -> dict:
        with count_collectives() as log:
            call()
        return {"records": [[r.op, r.nbytes] for r in log.records], "counted": log.bytes(),
                "direct": sum(t.numel() * t.element_size() for t in sent)}

    t = torch.full((1000,), float(rank + 1))
    root = rank == 0
    res: dict = {}
    gather_list = [torch.empty(1000) for _ in range(world)] if root else None
    res["gather"] = run(lambda: dist.gather(t, gather_list, dst=0), [t])
    scatter_list = [torch.ones(1000) for _ in range(world)] if root else None
    res["scatter"] = run(lambda: dist.scatter(torch.empty(1000), scatter_list, src=0), scatter_list or [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # all_gather_coalesced is deprecated
        res["all_gather_coalesced"] = run(
            lambda: dist.all_gather_coalesced([[torch.empty(1000)] for _ in range(world)], [t]), [t])
    res["all_to_all_single"] = run(lambda: dist.all_to_all_single(torch.empty(1000), t), [t])
    halves = list(t.chunk(world))
    try:
        res["all_to_all"] = run(lambda: dist.all_to_all([torch.empty(1000 // world) for _ in range(world)], halves),
                                halves)
    except RuntimeError as e:  # gloo before torch 2.12 has no alltoall
        res["all_to_all"] = {"unsupported": str(e)}
    res["barrier"] = run(dist.barrier, [])
    return res


# -- the tests -----------------------------------------------------------------------------------------

def _same(ours: list[dict], ref: list[dict], keys: tuple[str, ...]) -> None:
    for step, (o, r) in enumerate(zip(ours, ref, strict=True)):
        for k in keys:
            assert o[k] == r[k], f"step {step} {k}: ours {o[k]}, reference {r[k]}"


def test_a_rank_without_gradients_joins_found_inf_agreement_as_sharded_grad_scaler(tmp_path):
    """Each rank's optimizer holds its own parameter and rank 1's has no gradient at steps 0, 2, 3 (inf on
    rank 0 at step 0, on rank 1 at step 4): GradScaler(process_group="world") against torch's
    ShardedGradScaler on the same program, SGD and fused SGD (the scaler's fused path; the reference calls
    unscale_ first, where ShardedGradScaler agrees, and fused Adam is left out: torch 2.13's fused Adam
    refuses the shape-[1] found_inf ShardedGradScaler hands it): the same scale after every step and
    the same parameters, bitwise, on each rank; the user's logging all-reduce sums 21 after every step."""
    ranks = spawn(tmp_path, _no_grad_rank)
    for rank, r in enumerate(ranks):
        for kind in ("sgd", "sgd_fused"):
            ours, ref = r[f"ours_{kind}"], r[f"torch_{kind}"]
            assert [e["scale"] for e in ref] == [2.0, 2.0, 2.0, 2.0, 1.0], "the reference skips steps 0 and 4"
            _same(ours, ref, ("scale", "p", "logged"))
            assert all(e["logged"] == _LOGGED for e in ours), (rank, kind)
    for kind in ("sgd", "sgd_fused"):
        assert [e["scale"] for e in ranks[0][f"ours_{kind}"]] == [e["scale"] for e in ranks[1][f"ours_{kind}"]]


def test_check_finite_rank_without_gradients_skips_as_with_a_zero_gradient(tmp_path):
    """GradScaler(enabled=False, check_finite=True, process_group="world"), rank 1 without a gradient at
    steps 0 and 2, against the same program where rank 1 holds a zero gradient then (it joins the agreement
    like any rank; plain SGD moves nothing by it): the same skips (steps 1 and 3, inf on rank 0, NaN on
    rank 1) and parameters bitwise on each rank, and the logging all-reduce sums 21 after every step."""
    for r in spawn(tmp_path, _no_grad_check_finite):
        assert [e["skipped"] for e in r["zero"]] == [False, True, False, True]
        _same(r["none"], r["zero"], ("skipped", "p", "logged"))
        assert all(e["logged"] == _LOGGED for e in r["none"])


def test_fsdp1_orig_params_padding_only_shard_agrees_as_sharded_grad_scaler(tmp_path):
    """FSDP1 with use_orig_params=True and a 1-element parameter (rank 1's shard is padding: no gradient
    ever), inf on rank 0 at step 1: GradScaler(process_group="world") against torch's ShardedGradScaler on
    the same program: the same scales (4, 2, 2: both ranks back off at step 1) and the same full
    parameter, bitwise, on both ranks; the logging all-reduce sums 21."""
    ranks = spawn(tmp_path, _fsdp1_empty_shard)
    assert [e["has_grad"] for e in ranks[1]["torch"]] == [[False]] * 3, "rank 1's optimizer never sees a gradient"
    for r in ranks:
        assert [e["scale"] for e in r["torch"]] == [4.0, 2.0, 2.0]
        _same(r["ours"], r["torch"], ("scale", "w", "logged"))
        assert all(e["logged"] == _LOGGED for e in r["ours"])


def test_found_inf_query_on_one_rank_is_local_and_changes_nothing(tmp_path):
    """check_finite with scaling off: rank 0 alone calls scaler.found_inf(opt) before each step (rank-0
    logging) against the same program without the query: the same skips (steps 0 and 2) and parameters,
    bitwise, and the logging all-reduce sums 21 after every step; the query answers for rank 0's own
    gradients (False at step 0, where only rank 1 has a NaN; True at step 2)."""
    ranks = spawn(tmp_path, _found_inf_query)
    for r in ranks:
        assert [e["skipped"] for e in r["quiet"]] == [True, False, True, False]
        _same(r["ask"], r["quiet"], ("skipped", "p", "logged"))
        assert all(e["logged"] == _LOGGED for e in r["ask"])
    assert [e["asked"] for e in ranks[0]["ask"]] == [False, False, True, False]


def test_host_path_agrees_once_per_step_and_matches_torch_bitwise(tmp_path):
    """One process in a gloo group of world size 1, fused SGD with momentum: a step whose buffers are not
    all made takes the host path (steps 0 and 2), the others the fused path (inf at step 3). The all-reduce
    records count_collectives sees in scaler.step(opt): exactly one on every step, on either path. Values
    against torch.amp.GradScaler on the same program: the same scales and parameters, bitwise."""
    (r,) = spawn(tmp_path, _host_path_one_process, world=1)
    ours, ref = r["ours"], r["torch_amp"]
    assert [e["host_path"] for e in ours] == [True, False, True, False, False, False]
    assert [e["allreduces"] for e in ours] == [1] * 6, "one found_inf agreement per step, host or fused path"
    assert [e["scale"] for e in ref] == [256.0] * 3 + [128.0] * 3
    _same(ours, ref, ("scale", "a", "b"))


def test_ranks_on_different_step_paths_stay_in_step(tmp_path):
    """2 ranks, fused SGD with momentum; rank 1's optimizer has a second parameter group that gets its first
    gradient at step 2, so rank 1 takes the host path there while rank 0 takes the fused one (inf on rank 1
    at step 3). Against ShardedGradScaler (unscale_ then step): the same scales and parameters bitwise on
    each rank, one all-reduce in each of our steps, and the logging all-reduce sums 21 after every step."""
    ranks = spawn(tmp_path, _paths_differ)
    assert [e["host_path"] for e in ranks[0]["ours"]] == [True] + [False] * 5
    assert [e["host_path"] for e in ranks[1]["ours"]] == [True, False, True, False, False, False]
    for r in ranks:
        ours, ref = r["ours"], r["torch_sharded"]
        assert [e["scale"] for e in ref] == [256.0] * 3 + [128.0] * 3
        _same(ours, ref, ("scale", "a", "b", "logged"))
        assert all(e["logged"] == _LOGGED for e in ours)
        assert [e["allreduces"] for e in ours] == [1] * 6


needs_cpu_fsdp2 = pytest.mark.skipif(
    TORCH_MINOR < (2, 6), reason="FSDP2 on CPU (gloo) needs torch 2.6+: torch 2.4's fully_shard creates CUDA streams")


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from amp_backends.distributed.sharding import _can_divide_then_sum, fsdp_api

    if "List[nn.Module]" not in (fsdp_api()[0].__doc__ or "") or not _can_divide_then_sum():
        pytest.skip(f"torch {torch.__version__}'s fully_shard takes one module at a time or cannot divide first")
    return spawn(tmp_path_factory.mktemp("tied"), _tied)


@needs_cpu_fsdp2
def test_tied_head_and_embedding_shard_together_as_fully_shard_by_hand(tied):
    """A GPT-2 style tie (head.weight is embed.weight; the policy keeps the head and the norm in float32)
    through shard_in_low_precision against fully_shard by hand with the same groups (the blocks in
    bfloat16, [embed, head] and the norm in float32, the root): 3 SGD steps, the same losses and the same
    local shards bitwise on each rank (2 ranks: dividing by 2 before a SUM is exact, as gloo's AVG);
    plan.policies names the head and the embedding, both float32."""
    for r in tied:
        hand, ours = r["hand"], r["ours"]
        assert hand["error"] is None, hand["error"]
        assert ours["error"] is None, ours["error"]
        assert ours["selected"] == ["head", "norm"]
        assert ours["policies"]["head"] == ours["policies"]["embed"] == ["torch.float32", "torch.float32"]
        assert set(ours["policies"]) == {"layers.0", "layers.1", "head", "embed", "norm", ""}
        assert ours["still_tied"] and hand["still_tied"]
        assert ours["losses"] == hand["losses"]
        assert ours["shards"] == hand["shards"]


@needs_cpu_fsdp2
def test_tie_with_the_root_is_refused_with_nothing_sharded(tied):
    """A parameter registered on the root shared with the float32 head: refused before fully_shard runs
    (the error names the root), and no module is an FSDPModule afterwards."""
    for r in tied:
        assert r["refusal_selected"] == ["head"]
        assert r["refusal"] is not None, "sharded a tie fully_shard cannot keep"
        assert "is the root" in r["refusal"] and "nothing was sharded" in r["refusal"]
        assert r["refusal_sharded"] == []


def test_count_collectives_reads_what_each_rank_hands_over(tmp_path):
    """Each rank hands 4000 bytes of its own to gather, all_gather_coalesced, all_to_all(_single); scatter's
    root hands 8000 (one tensor per rank), a non-root nothing; a barrier carries nothing. The bytes counted
    against the bytes of the tensors passed as this rank's input, counted directly."""
    ranks = spawn(tmp_path, _counting)
    expected = {"gather": [4000, 4000], "scatter": [8000, 0], "all_gather_coalesced": [4000, 4000],
                "all_to_all_single": [4000, 4000], "all_to_all": [4000, 4000], "barrier": [0, 0]}
    for name, per_rank in expected.items():
        for rank, r in enumerate(ranks):
            got = r[name]
            if "unsupported" in got:
                assert name == "all_to_all" and "alltoall" in got["unsupported"]
                continue
            assert got["direct"] == per_rank[rank], (name, rank)
            assert got["counted"] == got["direct"], (name, rank, got["records"])
    assert ranks[0]["barrier"]["records"] == ranks[1]["barrier"]["records"] == []


def _inf_where_another_rank_has_none(rank: int, world: int) -> dict:
    """check_finite over the world: rank 0's gradient inf, rank 1 without ("none") or with a zero
    gradient ("zero") in the same step."""
    from amp_backends import GradScaler

    out: dict = {}
    for kind in ("none", "zero"):
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = GradScaler("cpu", enabled=False, check_finite=True, process_group="world")
        if rank == 0:
            p.grad = torch.full((3,), float("inf"))
        elif kind == "zero":
            p.grad = torch.zeros(3)
        scaler.step(opt)
        scaler.update()
        out[kind] = {"skipped": scaler.last_step_skipped, "stats": [scaler.stats.skipped, scaler.stats.overflows],
                     "logged": _logged(rank)}
    return out


def test_a_rank_without_gradients_counts_the_skip_another_ranks_inf_makes(tmp_path):
    """check_finite over two ranks, the inf on rank 0 in the very step rank 1 has no gradient: rank 1 records
    the skip (last_step_skipped, skipped and overflow counts) as it does holding a zero gradient, and as rank 0
    does."""
    ranks = spawn(tmp_path, _inf_where_another_rank_has_none)
    for r in ranks:
        assert r["none"] == r["zero"] == {"skipped": True, "stats": [1, 1], "logged": _LOGGED}


def _no_rank_has_gradients(rank: int, world: int) -> dict:
    from amp_backends import GradScaler

    out: dict = {}
    for name, scaler in (("ours", GradScaler("cpu", process_group="world")), ("torch", torch.amp.GradScaler("cpu")),
                         ("check_finite", GradScaler("cpu", enabled=False, check_finite=True, process_group="world"))):
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.ones((), requires_grad=True)
        scaler.scale(x * 2).backward()  # a loss that reaches no parameter of the optimizer
        try:
            scaler.step(opt)
            out[name] = "stepped"
        except AssertionError as exc:
            out[name] = str(exc)
        out[name + "_logged"] = _logged(rank)
    return out


def test_a_loss_that_reaches_no_rank_s_parameters_raises_torch_s_assertion_on_every_rank(tmp_path):
    """No rank has a gradient (a loss not connected to the model): with a process group every rank raises
    torch's "No inf checks were recorded for this optimizer.", as torch's scaler does in one process, and
    the ranks stay in step; check_finite (nothing to check) runs the optimizer, as it does in one process."""
    for r in spawn(tmp_path, _no_rank_has_gradients):
        assert r["ours"] == r["torch"] == "No inf checks were recorded for this optimizer."
        assert r["check_finite"] == "stepped"
        assert r["ours_logged"] == r["torch_logged"] == r["check_finite_logged"] == _LOGGED


def test_a_device_status_read_by_an_earlier_optimizer_skips_the_host_path_with_its_gradients_untouched():
    """A device whose overflow is a device-wide status (read and reset by the first optimizer's step) and
    a second optimizer on the host path (fused SGD with momentum, its first step): skipped too, its
    gradients left as they were (still multiplied by the scale), as the fused protocol leaves a skipped step."""
    import amp_backends
    from amp_backends import Backend, OverflowStatus

    class Register:
        overflow = False

    reg = Register()

    class StatusDevice(OverflowStatus, Backend):
        name, device_type, default_dtype = "statusdev", "cpu", torch.float16

        def unavailable_reason(self) -> None:
            return None

        def clear_overflow_status(self) -> None:
            reg.overflow = False

        def read_overflow_status_(self, found_inf: torch.Tensor) -> None:
            if reg.overflow:
                found_inf.fill_(1.0)
            reg.overflow = False

    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    o1 = torch.optim.SGD(a.parameters(), lr=0.1)
    o2 = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9, fused=True)
    scaler = amp_backends.GradScaler(StatusDevice(), init_scale=8.0)
    loss = scaler.scale(a(torch.ones(1, 4)).sum() + b(torch.ones(1, 4)).sum())
    reg.overflow = True
    loss.backward()
    before = [p.grad.clone() for p in b.parameters()]
    weights = [p.detach().clone() for p in b.parameters()]
    scaler.step(o1)
    assert scaler.last_step_skipped
    scaler.step(o2)
    assert scaler.last_step_skipped
    assert all(torch.equal(p.grad, g) for p, g in zip(b.parameters(), before)), "the skipped step's gradients untouched"
    assert all(torch.equal(p.detach(), w) for p, w in zip(b.parameters(), weights))
