"""Gradients all-reduced in float16/bfloat16 under DDP (amp_backends.distributed.reduce_in_low_precision),
on 2 real gloo CPU ranks launched by torchrun (tests/comms_worker.py), against independent references:
torch's fp16_compress_hook, the bf16 recipe written out (and torch's _compress_hook where it exists), and
DDP's own float32 all-reduce on the same data. Bytes are counted as the collectives are dispatched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import amp_backends
from amp_backends.devices import collectives
from amp_backends.distributed import CollectiveError, library_of, sharding
from torchrun import torchrun

HERE = Path(__file__).resolve().parents[1]  # tests/: the workers
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("comms")
    proc = torchrun(HERE / "comms_worker.py", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_fp16_matches_torchs_fp16_compress_hook_bitwise(ranks):
    for r in ranks:
        assert r["ours_fp16_equals_torch"]
        ours, ref = r["runs"]["ours_fp16"]["record"], r["runs"]["torch_fp16"]["record"]
        assert [e["loss"] for e in ours] == [e["loss"] for e in ref]


def test_bf16_matches_the_written_out_recipe_and_torchs_compress_hook(ranks):
    for r in ranks:
        assert r["ours_bf16_equals_recipe"]
        if r["ours_bf16_equals_torch"] is not None:  # torch 2.4 has no shared _compress_hook
            assert r["ours_bf16_equals_torch"]


def test_low_precision_runs_stay_close_to_the_float32_reduction(ranks):
    for r in ranks:
        for name, tol in (("ours_fp16", 1e-4), ("ours_bf16", 1e-3)):
            run = r["runs"][name]
            assert 0 < run["max_diff_vs_fp32"] < tol, name  # not the float32 run, and near it
            assert run["identical_across_ranks"]
            ref = [e["loss"] for e in r["runs"]["fp32"]["record"]]
            assert [e["loss"] for e in run["record"]] == pytest.approx(ref, rel=1e-3)


def test_bytes_counted_are_half_of_float32(ranks):
    for r in ranks:
        full = r["numel"] * 4
        for e in r["runs"]["fp32"]["record"]:
            assert e["allreduce_bytes"] == full and e["dtypes"] == ["torch.float32"]
        for name, dtype in (("ours_fp16", "torch.float16"), ("ours_bf16", "torch.bfloat16")):
            for e in r["runs"][name]["record"]:
                assert e["allreduce_bytes"] == full // 2 == e["hook_bytes"], name
                assert e["dtypes"] == [dtype]


def test_fp16_overflow_in_the_reduction_is_skipped_on_every_rank(ranks):
    """A loss scale float32 buckets hold (the float32 control never skips) overflows float16 buckets:
    the scaler sees inf on both ranks, skips the same steps and backs off until the scale fits."""
    ours = [r["overflow"]["ours_fp16"] for r in ranks]
    control = ranks[0]["overflow"]["fp32"]["record"]
    assert not any(e["skipped"] for e in control)
    steps = [[(e["skipped"], e["scale"]) for e in o["record"]] for o in ours]
    assert steps[0] == steps[1], "the same skips and scales on both ranks (each its own data and loss)"
    skipped = [e["skipped"] for e in ours[0]["record"]]
    assert skipped[0] and not skipped[-1], "skipped while the scale overflows float16, then training resumes"
    scales = [e["scale"] for e in ours[0]["record"]]
    assert all(b == a / 2 for a, b, s in zip([2.0**22] + scales, scales, skipped) if s)
    assert all(o["finite"] and o["identical_across_ranks"] for o in ours), "no inf ever applied"


def test_no_sync_accumulation_flat_grads_and_clipping_match_torchs_hook(ranks):
    for r in ranks:
        ours, ref = r["accumulate"]["ours_fp16"], r["accumulate"]["torch_fp16"]
        assert r["accumulate_equal"] and ours["identical_across_ranks"]
        keys = ("loss", "skipped", "scale", "norm", "allreduce_bytes")
        assert [[e[k] for k in keys] for e in ours["record"]] == [[e[k] for k in keys] for e in ref["record"]]
        assert all(e["allreduces"] == 1 for e in ours["record"]), "no_sync: one all-reduce per step"


def test_refusals_name_the_problem_and_register_nothing(ranks):
    for r in ranks:
        ref = r["refusals"]
        assert "nofp16 does not reduce float16" in ref["no_fp16"] and "dtype=torch.bfloat16" in ref["no_fp16"]
        assert "through float32 copies, so nothing would be saved" in ref["upcasts_fp16"]
        assert "does not take ReduceOp.SUM" in ref["no_sum"] and "float32 reduction" in ref["no_sum"]
        assert "float16 or bfloat16" in ref["float32"]
        assert "DistributedDataParallel" in ref["not_ddp"]
        assert ref["hooks_after_refusals"] == 0, "a refusal leaves the model as it was"
        assert "has a communication hook already" in ref["twice"]
        if "fsdp_old_torch" in ref:  # a torch whose fully_shard cannot be told to divide first (2.4)
            assert "reduces float32 with AVG" in ref["fsdp_old_torch"]
            assert "gloo does not take ReduceOp.AVG" in ref["fsdp_old_torch"]


def test_library_of_needs_a_process_group():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(CollectiveError, match="init_process_group"):
        library_of(amp_backends.get("cpu"))


@pytest.mark.parametrize(("lib", "dtype", "op", "refused"), [
    (collectives.GLOO, torch.bfloat16, "sum", False),
    (collectives.GLOO, torch.float16, "premul_sum", True),
    (collectives.GAUDI_HCCL, torch.float16, "avg", True),
    (collectives.GAUDI_HCCL, torch.float16, "sum", False),  # accepted, through float32 copies
    (collectives.CNCL, torch.float16, "premul_sum", True),
    (collectives.MCCL, torch.bfloat16, "premul_sum", True),
    (collectives.HCCL, torch.float64, "sum", True),
    (collectives.NCCL, torch.bfloat16, "avg", False),
])
def test_declared_refusals(lib, dtype, op, refused):
    assert (lib.reduce_refusal(dtype, op) is not None) == refused


def test_every_builtin_backend_declares_its_library():
    """Each plugin's class attribute, read without probing the device."""
    import amp_backends_plugins.cpu, amp_backends_plugins.cuda, amp_backends_plugins.hpu  # noqa: E401 - the plugins in two lines
    import amp_backends_plugins.mlu, amp_backends_plugins.musa, amp_backends_plugins.npu, amp_backends_plugins.xpu  # noqa: E401 - the plugins in two lines
    p = amp_backends_plugins
    expected = {p.cpu.CPUBackend: collectives.GLOO, p.cuda.CUDABackend: collectives.NCCL,
                p.hpu.HPUBackend: collectives.GAUDI_HCCL, p.mlu.MLUBackend: collectives.CNCL,
                p.musa.MUSABackend: collectives.MCCL, p.npu.NPUBackend: collectives.HCCL,
                p.xpu.XPUBackend: collectives.XCCL}
    for cls, lib in expected.items():
        assert cls.collectives is lib, cls.__name__
    assert collectives.GAUDI_HCCL.wire_dtype(torch.float16) == torch.float32


needs_cpu_fsdp2 = pytest.mark.skipif(
    _TORCH < (2, 6), reason="FSDP2 on CPU (gloo) needs torch 2.6+: torch 2.4's fully_shard creates CUDA streams")
needs_divide_then_sum = pytest.mark.skipif(
    _TORCH >= (2, 6) and not sharding._can_divide_then_sum(),
    reason=f"torch {torch.__version__}'s fully_shard has no custom reduce-scatter (set_custom_reduce_scatter, "
           "set_force_sum_reduction_for_comms): it reduces with gloo's AVG, which shard_in_low_precision refuses")


@pytest.fixture(scope="module")
def fsdp_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("comms_fsdp")
    proc = torchrun(HERE / "comms_fsdp_worker.py", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@needs_cpu_fsdp2
@needs_divide_then_sum
def test_fsdp2_policy_matches_hand_written_policies_bitwise(fsdp_ranks):
    """bf16 weights, the recipe's norm and head in float32 with their own float32 policy, gradients
    reduced in float32 (the default), bfloat16 or float16: the same shards as fully_shard with the policies written
    by hand (on 2 ranks dividing by 2 first is exact, so divide-then-SUM equals gloo's AVG bitwise)."""
    for r in fsdp_ranks:
        assert r["equal_fp32_reduce"] and r["equal_bf16_reduce"] and r["equal_fp16_reduce"]
        assert r["equal_with_mesh"], "a 1-D DeviceMesh shards as the default group does"
        ours = r["runs"]["ours"]
        assert ours["policies"] == {"head": ["torch.float32", "torch.float32", "None"],
                                    "norm": ["torch.float32", "torch.float32", "None"],
                                    "body": ["torch.bfloat16", "torch.float32", "None"],
                                    "": ["torch.bfloat16", "torch.float32", "torch.float32"]}
        assert r["runs"]["ours_bf16"]["policies"]["body"][1] == "torch.bfloat16"
        assert ours["head_dtypes"] == ["torch.float32"] and ours["record"][0]["out_dtype"] == "torch.float32"
        assert 0 < r["max_diff_vs_fp32"] < 5e-3 and 0 < r["max_diff_bf16_vs_fp32"] < 5e-3


@needs_cpu_fsdp2
@needs_divide_then_sum
def test_fsdp2_divides_then_sums_where_fully_shard_would_average(fsdp_ranks):
    for r in fsdp_ranks:
        assert r["runs"]["ours"]["reduction"] == "divide by 2, then SUM"
        for e in r["runs"]["ours"]["record"] + r["runs"]["ours_bf16"]["record"] + r["runs"]["ours_fp16"]["record"]:
            assert e["scatter_ops"] in (["SUM"], ["None"])  # None: this torch does not show the op
        assert all(e["scatter_ops"] in (["AVG"], ["None"]) for e in r["runs"]["hand"]["record"])
        assert r["premul_sum"] in (None, "Cannot use ReduceOp.PREMUL_SUM with Gloo"), \
            "a custom divide factor makes fully_shard ask gloo for PREMUL_SUM, which it refuses"


@needs_cpu_fsdp2
@needs_divide_then_sum
def test_fsdp2_bytes_counted_half_for_low_precision_modules(fsdp_ranks):
    """Against the same modules sharded with float32 policies: bf16 weights gather half the bytes, and
    bf16 reduction scatters half; the float32 modules' bytes stay."""
    for r in fsdp_ranks:
        full = r["runs"]["hand_fp32"]["record"]
        for e, f in zip(r["runs"]["ours_bf16"]["record"], full):
            assert set(f["gather_by_dtype"]) == {"float32"}
            low, kept = e["gather_by_dtype"]["bfloat16"], e["gather_by_dtype"]["float32"]
            assert 2 * low + kept == f["gather_by_dtype"]["float32"] and low > kept
            low, kept = e["scatter_by_dtype"]["bfloat16"], e["scatter_by_dtype"]["float32"]
            assert 2 * low + kept == f["scatter_by_dtype"]["float32"]
        for e, f in zip(r["runs"]["ours"]["record"], full):
            assert e["scatter_by_dtype"] == f["scatter_by_dtype"], "float32 reduction by default"


@needs_cpu_fsdp2
@needs_divide_then_sum
def test_fsdp2_refusal_before_sharding(fsdp_ranks):
    for r in fsdp_ranks:
        assert "does not all-gather or broadcast bfloat16" in r["refusal"]["error"] and "leave FSDP2 in float32" in r["refusal"]["error"]
        assert r["refusal"]["untouched"], "nothing was sharded"


def test_simulated_libraries_refuse_what_the_vendors_refuse(ranks):
    """Collectives gloo runs, refused by the simulated vendor library as the real one would refuse them."""
    for r in ranks:
        sim = r["simulations"]
        assert "HCCL (Ascend, torch_npu) does not reduce float64" in sim["hccl_fp64_allreduce"]
        assert "CNCL (Cambricon, torch_mlu) does not all-gather or broadcast float64" in sim["cncl_fp64_broadcast"]
        assert sim["gloo_fp64_allreduce"] is None and sim["gaudi_sum_allowed"] is None
        assert sim["shows_op"] or _TORCH < (2, 11), "torch 2.11 and later show a collective's ReduceOp (2.8 does not)"
        if _TORCH >= (2, 8) and sim["shows_op"]:  # gloo takes AVG (pytorch PR 149781); the op seen, it is refused
            assert "HCCL (Intel Gaudi) does not take ReduceOp.AVG" in sim["gaudi_avg"]
        assert sim["cncl_ddp_bf16"] is None and sim["gaudi_ddp_bf16"] is None, "DDP's bf16 divide-then-SUM passes"


@needs_cpu_fsdp2
@needs_divide_then_sum
def test_fsdp2_on_simulated_gaudi_hccl_fails_where_the_hardware_would(fsdp_ranks):
    """fully_shard by hand fails under Gaudi's HCCL where this torch reduces with AVG over the group (seen
    by recording its reduce ops unrefused; torch 2.9 divides and sums over gloo itself, and nothing fails
    there); shard_in_low_precision divides and sums on every torch."""
    for r in fsdp_ranks:
        if "avg" in r["gaudi"]["hand_ops"]:
            assert "HCCL (Intel Gaudi) does not take ReduceOp.AVG" in r["gaudi"]["hand"]
            assert "_reduce_scatter_base_" in r["gaudi"]["hand"]
        else:
            assert r["gaudi"]["hand"] is None, r["gaudi"]
        assert r["gaudi"]["ours"] is None


def test_two_nodes_through_torchruns_rendezvous(tmp_path):
    """Two torchrun launches, one per "node", meeting through the c10d rendezvous on this machine, as a
    multi-node launch does: bf16 gradients, half the bytes, the ranks identical."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AMP_BACKEND", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                      "MASTER_", "GROUP_RANK", "TORCHELASTIC"))}
    env.update(AMP_BACKEND="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={n}",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=comms{port}",
         str(HERE / "comms_worker.py"), "--out", str(tmp_path), "--quick", "--steps", "3"],
        env=env, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in range(2)]
    try:
        for node in nodes:
            _, err = node.communicate(timeout=300)
            assert node.returncode == 0, err[-3000:]
    finally:
        for node in nodes:  # a node that failed or hung leaves nothing behind
            if node.poll() is None:
                node.kill()
                node.communicate()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(r["node"] for r in ranks) == [0, 1] and all(r["world_size"] == 2 for r in ranks)
    for r in ranks:
        fp32, bf16 = r["runs"]["fp32"], r["runs"]["ours_bf16"]
        assert all(e["allreduce_bytes"] == r["numel"] * 4 for e in fp32["record"])
        assert all(e["allreduce_bytes"] == r["numel"] * 2 and e["dtypes"] == ["torch.bfloat16"] for e in bf16["record"])
        assert bf16["identical_across_ranks"] and 0 < bf16["max_diff_vs_fp32"] < 1e-3


@needs_cpu_fsdp2
def test_shapes_of_sharding_the_divide_first_reduction_cannot_serve_are_refused_before_sharding():
    """A 2-D mesh (HSDP: the replicate all-reduce would sum undivided gradients where a shard dimension is 1)
    and shard_placement_fn (parameter groups the custom reduce-scatter does not take) are refused before
    anything is sharded, without a process group."""
    from torch import nn

    class TwoD:  # what the check reads of a DeviceMesh: its number of dimensions
        ndim = 2

    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="1-D DeviceMesh.*HSDP.*nothing was sharded"):
        sharding.shard_in_low_precision(model, "cpu", mesh=TwoD())
    if sharding._can_divide_then_sum():
        with pytest.raises(ValueError, match="shard_placement_fn.*nothing was sharded"):
            sharding.shard_in_low_precision(model, "cpu", shard_placement_fn=lambda p: None)
    assert not hasattr(model, "reshard") and type(model) is nn.Sequential, "nothing was sharded"
