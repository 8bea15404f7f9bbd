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
from amp_backends.distributed import CollectiveError, library_of
from test_distributed import torchrun

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


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
    import amp_backends_plugins.cpu, amp_backends_plugins.cuda, amp_backends_plugins.hpu  # noqa: E401
    import amp_backends_plugins.mlu, amp_backends_plugins.musa, amp_backends_plugins.npu, amp_backends_plugins.xpu  # noqa: E401
    p = amp_backends_plugins
    expected = {p.cpu.CPUBackend: collectives.GLOO, p.cuda.CUDABackend: collectives.NCCL,
                p.hpu.HPUBackend: collectives.GAUDI_HCCL, p.mlu.MLUBackend: collectives.CNCL,
                p.musa.MUSABackend: collectives.MCCL, p.npu.NPUBackend: collectives.HCCL,
                p.xpu.XPUBackend: collectives.XCCL}
    for cls, lib in expected.items():
        assert cls.collectives is lib, cls.__name__
    assert collectives.GAUDI_HCCL.wire_dtype(torch.float16) == torch.float32
