"""Real multi-process training (2 CPU ranks over Gloo, launched by torchrun), DataParallel's
thread-local autocast, and torch.compile under the backend's autocast with the scaler."""

from __future__ import annotations

import json
import math
import re
import threading
import warnings
from pathlib import Path

import pytest
import torch

import amp_backends
from amp_backends import distributed

from torchrun import TESTS, TORCH_MINOR, torchrun
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


def run_worker(tmp_path: Path, *args: str) -> list[dict]:
    proc = torchrun(TESTS / "dist_worker.py", "--out", str(tmp_path), *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_ddp_inf_on_one_rank_skips_the_same_step_everywhere(tmp_path):
    ranks = run_worker(tmp_path, "--mode", "ddp")
    for r in ranks:
        assert r["world_size"] == 2 and r["dist_backend"] == "gloo" and r["identical_across_ranks"]
        skipped = [e["step"] for e in r["record"] if e["skipped"]]
        assert 3 in skipped
    assert ranks[0]["record"] == ranks[1]["record"], "same skips and the same scale history on both ranks"
    scales = [e["scale"] for e in ranks[0]["record"]]
    assert scales[3] == scales[2] / 2, "both ranks backed off at the injected step"


def test_ddp_with_a_precision_policy(tmp_path):
    """The policy applied to the model before DDP wraps it: the head runs in float32 on every
    rank, the same steps are skipped, and the ranks stay identical."""
    ranks = run_worker(tmp_path, "--mode", "ddp", "--policy")
    (tmp_path / "plain").mkdir()
    plain = run_worker(tmp_path / "plain", "--mode", "ddp")
    for r in ranks:
        assert r["policy"] == ["2"] and r["out_dtype"] == "torch.float32" and r["identical_across_ranks"]
        assert [e["skipped"] for e in r["record"]] == [e["skipped"] for e in plain[0]["record"]]
    assert plain[0]["out_dtype"] == "torch.float16" and plain[0]["policy"] is None
    assert ranks[0]["record"] == ranks[1]["record"]


def test_sharded_gradients_agree_on_found_inf_through_the_process_group(tmp_path):
    ranks = run_worker(tmp_path, "--mode", "sharded", "--sync")
    assert ranks[0]["record"] == ranks[1]["record"]
    assert ranks[0]["record"][3]["skipped"] and ranks[0]["identical_across_ranks"]


def test_without_found_inf_sync_sharded_ranks_diverge(tmp_path):
    """The negative control: what the process_group option prevents."""
    ranks = run_worker(tmp_path, "--mode", "sharded")
    assert ranks[0]["record"][3]["skipped"] is False and ranks[1]["record"][3]["skipped"] is True
    assert not ranks[0]["identical_across_ranks"]


def run_parity(tmp_path: Path, *args: str, env_extra: dict | None = None) -> list[dict]:
    proc = torchrun(TESTS / "dist_parity_worker.py", "--out", str(tmp_path), *args, env_extra=env_extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def _check_parity(ranks: list[dict], grad_type: str, bitwise: bool, kernel: str = "torch") -> None:
    for r in ranks:
        assert r["grad_type"] == grad_type and r["kernel"] == kernel
        ours, ref = r["ours"], r["torch"]
        assert [e["skipped"] for e in ours] == [e["step"] == 3 for e in ours], "every rank skips the injected step"
        assert ours[3]["scale"] == ours[3]["scale_before"] / 2, "and backs off"
        assert [e["scale"] for e in ours] == [e["scale"] for e in ref]
        assert r["stats"] == {"skipped": 1, "overflows": 1}
        for a, b in zip(ours, ref):
            if b["step"] == 3:
                assert math.isinf(a["norm"]) and math.isinf(b["norm"])
                continue
            assert a["norm"] == pytest.approx(b["global_norm"], rel=1e-6), "the clip measured the global norm"
            assert (a["norm"] == b["norm"]) if bitwise else a["norm"] == pytest.approx(b["norm"], rel=1e-6)
        assert r["params_equal"] if bitwise else r["params_max_diff"] < 1e-6
        assert r["identical_across_ranks"]
    assert ranks[0]["ours"] == ranks[1]["ours"]


needs_cpu_fsdp2 = pytest.mark.skipif(
    TORCH_MINOR < (2, 6), reason="FSDP2 on CPU (gloo) needs torch 2.6+: torch 2.4's fully_shard creates CUDA streams"
)


@needs_cpu_fsdp2
def test_fsdp2_scaler_and_clip_match_torch_bitwise(tmp_path):
    """fully_shard, fp16 autocast, inf in one rank's shard: both ranks skip, clip uses the global norm."""
    _check_parity(run_parity(tmp_path, "--wrap", "fsdp2"), "DTensor", bitwise=True)


@needs_cpu_fsdp2
def test_fsdp2_with_a_precision_policy(tmp_path):
    """The policy applied before fully_shard: the head runs in float32 on sharded ranks, and the
    scaler still matches torch's bitwise (both runs carry the same policy)."""
    ranks = run_parity(tmp_path, "--wrap", "fsdp2", "--policy")
    assert all(r["out_dtype"] == "torch.float32" for r in ranks)
    _check_parity(ranks, "DTensor", bitwise=True)


@needs_cpu_fsdp2
def test_fsdp2_with_bf16_parameters_and_a_precision_policy(tmp_path):
    """The documented combination: MixedPrecisionPolicy(param_dtype=bfloat16) and the recipe. The head's
    forward gets bf16 weights from FSDP2 and runs them in float32; training matches torch's scaler."""
    ranks = run_parity(tmp_path, "--wrap", "fsdp2", "--policy", "--param-dtype", "bfloat16")
    assert all(r["out_dtype"] == "torch.float32" for r in ranks)
    _check_parity(ranks, "DTensor", bitwise=True)


@needs_cpu_fsdp2
def test_fsdp2_fused_optimizer_clip_folded_into_grad_scale(tmp_path):
    _check_parity(run_parity(tmp_path, "--wrap", "fsdp2", "--fused"), "DTensor", bitwise=False)


@needs_cpu_fsdp2
def test_fsdp2_with_the_triton_kernel_hands_dtensor_shards_to_torch(tmp_path):
    """The Triton kernel (interpreted on CPU) never reads a DTensor's data_ptr: results equal torch's."""
    pytest.importorskip("triton")
    env = {"TRITON_INTERPRET": "1", "AMP_BACKENDS_KERNEL": "triton"}
    _check_parity(run_parity(tmp_path, "--wrap", "fsdp2", env_extra=env), "DTensor", bitwise=True, kernel="triton")


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.cuda
@pytest.mark.skipif(_gpus() < 2 or not torch.distributed.is_nccl_available(),
                    reason=f"FSDP2 on NCCL needs 2 CUDA GPUs and NCCL; this machine has {_gpus()} GPU(s)")
def test_fsdp2_on_nccl_matches_torch_bitwise(tmp_path):
    """The GPU variant: fully_shard over NCCL, one GPU per rank, fp16 autocast on cuda."""
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(2))), "AMP_BACKEND": "cuda"}
    _check_parity(run_parity(tmp_path, "--wrap", "fsdp2", "--backend", "cuda", env_extra=env), "DTensor",
                  bitwise=True, kernel=amp_backends.get("cuda").kernel.name)


def test_ddp_gradient_as_bucket_view_matches_torch_bitwise(tmp_path):
    _check_parity(run_parity(tmp_path, "--wrap", "ddp-buckets"), "Tensor", bitwise=True)


def test_ddp_with_flat_grads_matches_torch_bitwise(tmp_path):
    """DDP as it comes: gradients stay in the arena every step, results bit for bit torch's."""
    ranks = run_parity(tmp_path, "--wrap", "ddp", "--arena")
    _check_parity(ranks, "Tensor", bitwise=True)
    for r in ranks:
        assert all(e["in_arena"] for e in r["ours"]) and r["fallbacks"] == []


def test_ddp_bucket_views_take_gradients_out_of_the_arena_safely(tmp_path):
    """gradient_as_bucket_view=True replaces every gradient: the per-tensor path, named once, still exact."""
    ranks = run_parity(tmp_path, "--wrap", "ddp-buckets", "--arena")
    _check_parity(ranks, "Tensor", bitwise=True)
    for r in ranks:
        assert not any(e["in_arena"] for e in r["ours"])
        assert len(r["fallbacks"]) == 1 and "gradient_as_bucket_view=True" in r["fallbacks"][0]


def test_ddp_example_under_torchrun():
    proc = torchrun(TESTS.parent / "examples" / "ddp.py", cwd=TESTS.parent / "examples")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"ddp: world_size=2 backend=gloo final_loss=0\.[0-2]\d* ranks_identical=True", proc.stdout), proc.stdout


def test_init_process_group_outside_torchrun_says_how_to_launch(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(amp_backends.AmpBackendsError, match="torchrun --nproc_per_node=N"):
        distributed.init_process_group("cpu")


def test_autocast_module_applies_in_worker_threads():
    """DataParallel runs replicas in threads; autocast entered in the caller does not reach them."""
    be = amp_backends.get("cpu")
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 8)
    wrapped = amp_backends.autocast_module(linear, be, torch.bfloat16)
    x = torch.randn(4, 8)
    results: dict[str, torch.dtype] = {}

    def worker(name: str, module: torch.nn.Module) -> None:
        results[name] = module(x).dtype

    with be.autocast(torch.bfloat16):
        threads = [threading.Thread(target=worker, args=(n, m)) for n, m in (("plain", linear), ("wrapped", wrapped))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == {"plain": torch.float32, "wrapped": torch.bfloat16}
    assert "dtype=torch.bfloat16" in repr(wrapped)
    if not torch.cuda.is_available():  # without GPUs DataParallel calls the module directly
        assert torch.nn.DataParallel(wrapped)(x).dtype == torch.bfloat16


@pytest.mark.parametrize("where", ["parameters", "inputs"])
def test_autocast_module_warns_once_when_the_devices_differ(where):
    """A cpu backend's autocast around a module or inputs elsewhere (DataParallel moves replicas to
    cuda) would leave them in float32 silently: the first forward says so, naming both devices."""
    be = amp_backends.get("cpu")
    module = torch.nn.Linear(4, 4) if where == "parameters" else torch.nn.Identity()
    wrapped = amp_backends.autocast_module(module, be, torch.bfloat16)
    module.to("meta")  # moved after wrapping, as DataParallel moves replicas: checked at the first forward
    x = torch.randn(2, 4, device="meta")
    with pytest.warns(RuntimeWarning, match=rf"backend 'cpu' autocasts cpu ops, but the wrapped module's {where} are on meta"):
        wrapped(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped(x)  # checked once, not per step
    same = amp_backends.autocast_module(torch.nn.Linear(4, 4), be, torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert same(torch.randn(2, 4)).dtype == torch.bfloat16


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="DataParallel on cuda needs a CUDA GPU")
def test_autocast_module_under_data_parallel_on_cuda():
    """DataParallel's replicas run in threads, one per GPU: the cuda backend's autocast reaches them."""
    be = amp_backends.get("cuda")
    torch.manual_seed(0)
    wrapped = amp_backends.autocast_module(torch.nn.Linear(8, 8).cuda(), be, torch.float16)
    dp = torch.nn.DataParallel(wrapped)
    assert dp(torch.randn(4 * max(1, torch.cuda.device_count()), 8, device="cuda")).dtype == torch.float16


def test_compiled_model_trains_under_autocast_with_the_scaler():
    be = amp_backends.get("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = be.grad_scaler(torch.float16)
    x = torch.randn(64, 16)
    y = x[:, :1] * 0.5
    losses = []
    for step in range(25):
        opt.zero_grad()
        with be.autocast(torch.float16):
            out = compiled(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
        assert out.dtype == torch.float16
        scaler.scale(loss).backward()
        if step == 5:
            model[0].weight.grad[0, 0] = float("nan")
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0] and scaler.stats.skipped == 1
