"""CUDA backend on a real GPU; every test here skips cleanly where no CUDA device is visible."""

from __future__ import annotations

import math

import pytest
import torch

import amp_backends
import amp_backends.testing

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def cuda():
    return amp_backends.get("cuda")


def test_cuda_backend_contract(cuda):
    assert cuda.is_available() and cuda.unavailable_reason() is None
    assert cuda.default_dtype == torch.float16 and cuda.dist_backend == "nccl"
    assert (torch.bfloat16 in cuda.supported_dtypes()) == torch.cuda.is_bf16_supported()
    assert (torch.bfloat16 in cuda.native_dtypes()) == torch.cuda.is_bf16_supported(including_emulation=False)
    assert amp_backends.get().name == "cuda", "accelerators come before the CPU"
    cuda.reset_peak_memory_stats()
    x = torch.empty(1 << 20, device="cuda")
    assert cuda.max_memory_allocated() >= x.numel() * 4
    cuda.synchronize()


def test_cuda_autocast_policy(cuda):
    x = torch.randn(8, 8, device="cuda")
    with cuda.autocast():
        low = x @ x
        assert low.dtype == torch.float16
        assert torch.softmax(low, -1).dtype == torch.float32
        assert torch.nn.functional.mse_loss(low, x).dtype == torch.float32


def test_cuda_unscale_on_every_layout(cuda):
    grads = [torch.randn(33, 17, device="cuda", dtype=d) for d in (torch.float32, torch.float16, torch.bfloat16)]
    grads += [grads[0].t(), torch.randn(40, 40, device="cuda")[::3, 1::2], torch.empty(0, device="cuda")]
    grads[4][2, 3] = math.nan
    expected = [(g.double() * 0.5).to(g.dtype) for g in grads]
    found = torch.zeros((), device="cuda")
    amp_backends.testing.grad_op_(cuda, grads, found, torch.full((), 0.5, device="cuda"))
    assert found.item() == 1.0
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fused", [False, True])
def test_cuda_trajectory_matches_torch(fused):
    def run(make):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        scaler = make()
        x = torch.randn(32, 64, device="cuda")
        scales = []
        for step in range(12):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            if step in (3, 7):
                model[0].weight.grad[0, 0] = math.inf
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        return [p.detach() for p in model.parameters()], scales

    ours = run(lambda: amp_backends.GradScaler("cuda", growth_interval=3))
    ref = run(lambda: torch.amp.GradScaler("cuda", growth_interval=3))
    assert ours[1] == ref[1]
    for a, b in zip(ours[0], ref[0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_cuda_demo_trains():
    from amp_backends.cli.demo import DemoConfig, run

    out = run(DemoConfig(backend="cuda", epochs=10, progress=False))
    assert out["test_accuracy"] >= 0.95 and out["scaler"]["enabled"] and out["peak_memory_kind"] == "device allocator peak"


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("check", ["identity", "refcount"])
@pytest.mark.parametrize("triton_at_every_size", [True, False])
def test_cuda_arena_is_bitwise_the_per_tensor_path(fused, check, triton_at_every_size):
    """flat_grads on the GPU (the Triton kernel's vectorized path, or torch's op for a model this
    small when Triton keeps its size threshold): same parameters, norms and skips."""
    import copy

    be = copy.copy(amp_backends.get("cuda"))
    if triton_at_every_size and hasattr(be.kernel, "min_elements"):
        kernel = copy.copy(be.kernel)
        kernel.min_elements = 0
        be.kernel = kernel

    def run(arena):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 37), torch.nn.ReLU(), torch.nn.Linear(37, 4099),
                                    torch.nn.ReLU(), torch.nn.Linear(4099, 8)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        flat = amp_backends.flat_grads(opt, check=check) if arena else None
        scaler = amp_backends.GradScaler(be, growth_interval=3)
        x = torch.randn(32, 64, device="cuda")
        norms = []
        for step in range(8):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            if step == 3:
                model[2].weight.grad[0, 0] = math.inf
            norms.append(scaler.clip_grad_norm_(opt, 1.0))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if flat is not None:
                assert flat.problem() is None
        return [p.detach() for p in model.parameters()], norms, scaler.stats

    params, norms, stats = run(True)
    ref_params, ref_norms, ref_stats = run(False)
    assert amp_backends.get("cuda").kernel.name in ("triton", "torch")
    assert stats.skipped == ref_stats.skipped == 1
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)
    for a, b in zip(norms, ref_norms):
        assert torch.equal(a, b) or (a.isnan() and b.isnan())
