"""Conformance: availability, dtypes, autocast policy, and the unscale/inf-check op."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import amp_backends

# Devices whose autocast follows CUDA's lists (softmax, layer_norm in fp32, too).
CUDA_LIKE = {"cuda", "mlu", "xpu", "hpu"}


def test_availability_and_reason(backend):
    assert backend.is_available() is True
    assert backend.unavailable_reason() is None
    assert amp_backends.get(backend.name) is backend
    assert backend.name in amp_backends.available()


def test_dtypes(backend):
    supported = backend.supported_dtypes()
    assert supported and supported[0] == backend.default_dtype
    assert set(supported) <= {torch.float16, torch.bfloat16}
    assert isinstance(backend.dist_backend, str) and backend.dist_backend
    assert backend.device().type == backend.device_type


@pytest.mark.parametrize("bad", [torch.float64, torch.int32, "not_a_dtype"])
def test_unsupported_dtype_is_refused_clearly(backend, bad):
    with pytest.raises(amp_backends.UnsupportedDtypeError) as info:
        backend.autocast(bad)
    message = str(info.value)
    assert backend.name in message and str(backend.default_dtype).replace("torch.", "") in message


def _low_dtypes(backend):
    return list(backend.supported_dtypes())


def test_autocast_lowers_matmul_linear_conv(backend):
    dev = backend.device()
    x = torch.randn(4, 8, device=dev)
    w = torch.randn(8, 8, device=dev)
    conv = torch.nn.Conv2d(3, 4, 3).to(dev)
    img = torch.randn(1, 3, 8, 8, device=dev)
    for dtype in _low_dtypes(backend):
        with backend.autocast(dtype):
            assert (x @ w).dtype == dtype
            assert torch.mm(x, w).dtype == dtype
            assert F.linear(x, w).dtype == dtype
            assert conv(img).dtype == dtype


def test_autocast_keeps_fp32_ops_in_fp32(backend):
    dev = backend.device()
    x = torch.randn(4, 8, device=dev)
    w = torch.randn(8, 8, device=dev)
    target = torch.zeros(4, dtype=torch.long, device=dev)
    for dtype in _low_dtypes(backend):
        with backend.autocast(dtype):
            low = x @ w
            assert F.mse_loss(low, x).dtype == torch.float32
            assert F.cross_entropy(low, target).dtype == torch.float32
            if backend.device_type in CUDA_LIKE:
                assert F.softmax(low, -1).dtype == torch.float32
                assert F.layer_norm(low, (8,)).dtype == torch.float32


def test_autocast_nesting_disable_and_decorator(backend):
    dev = backend.device()
    x = torch.randn(4, 4, device=dev)
    low = backend.default_dtype
    with backend.autocast():
        assert (x @ x).dtype == low
        with backend.autocast(enabled=False):
            assert (x @ x).dtype == torch.float32
        assert (x @ x).dtype == low
    assert (x @ x).dtype == torch.float32

    @backend.autocast()
    def forward(a):
        return a @ a

    assert forward(x).dtype == low
    assert (x @ x).dtype == torch.float32


def _grads(backend, seed):
    """Contiguous, transposed, sliced and empty gradients in every supported dtype and fp32."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for dtype in (torch.float32, *backend.supported_dtypes()):
        base = torch.randn(9, 7, generator=g) * 64
        out += [  # each its own memory: .to() of the same dtype would alias base
            base.to(dtype).clone(),
            base.to(dtype).clone().t(),
            base.to(dtype).clone()[1:8:3, ::2],
            torch.empty(0, dtype=dtype),
        ]
    return [t.to(backend.device()) for t in out]


CASES = [(None, "-")] + [(v, w) for v in (math.inf, -math.inf, math.nan) for w in ("first", "last", "middle")]


@pytest.mark.parametrize(("value", "where"), CASES)
def test_unscale_and_check(backend, value, where):
    grads = _grads(backend, seed=7)
    if value is not None:
        for i in range(0, len(grads), 4):  # one tensor of each dtype group and layout in turn
            target = grads[i + (i // 4) % 3]
            n = target.numel()
            pos = {"first": 0, "last": n - 1, "middle": n // 2}[where]
            target[tuple(int(k) for k in torch.unravel_index(torch.tensor(pos), target.shape))] = value
    expected = [(t.cpu().double() * 0.125).to(t.dtype) for t in grads]
    found = torch.zeros((), device=backend.device())
    backend.unscale_and_check_(grads, found, torch.full((), 0.125, device=backend.device()))
    assert found.item() == (0.0 if value is None else 1.0)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)
