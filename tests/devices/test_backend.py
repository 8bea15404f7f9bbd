"""The Backend contract on the CPU: autocast policy, dtypes, and the unscale/inf-check op."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import amp_backends
from amp_backends import Backend, UnsupportedDtypeError
from amp_backends.testing import grad_op_

LOW = [torch.bfloat16, torch.float16]


@pytest.fixture
def cpu():
    return amp_backends.get("cpu")


@pytest.mark.parametrize("dtype", LOW)
def test_cpu_autocast_follows_torch_policy(cpu, dtype):
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    img = torch.randn(1, 3, 8, 8)
    conv = torch.nn.Conv2d(3, 4, 3)
    with cpu.autocast(dtype):
        assert torch.get_autocast_dtype("cpu") == dtype
        assert (x @ w).dtype == dtype
        assert F.linear(x, w).dtype == dtype
        assert conv(img).dtype == dtype
        low = x @ w
        assert F.mse_loss(low, x).dtype == torch.float32
        assert F.cross_entropy(low, torch.zeros(4, dtype=torch.long)).dtype == torch.float32
    assert (x @ w).dtype == torch.float32


def test_default_dtype_enabled_false_nesting_and_decorator(cpu):
    x = torch.randn(4, 4)
    with cpu.autocast():
        assert (x @ x).dtype == torch.bfloat16
        with cpu.autocast(enabled=False):
            assert (x @ x).dtype == torch.float32
        with cpu.autocast(torch.float16):
            assert (x @ x).dtype == torch.float16
        assert (x @ x).dtype == torch.bfloat16
    with cpu.autocast(enabled=False):
        assert (x @ x).dtype == torch.float32

    @cpu.autocast(dtype="float16")
    def forward(a):
        return a @ a

    assert forward(x).dtype == torch.float16
    assert (x @ x).dtype == torch.float32


@pytest.mark.parametrize("bad", [torch.float64, torch.int8, "float128", 16])
def test_unsupported_dtype_is_refused_clearly(cpu, bad):
    with pytest.raises(UnsupportedDtypeError) as info:
        cpu.autocast(bad)
    message = str(info.value)
    assert "bfloat16" in message or "torch dtype" in message
    with pytest.raises(UnsupportedDtypeError):
        cpu.grad_scaler(bad)
    assert not torch.is_autocast_enabled("cpu"), "a refused dtype leaves autocast untouched"


def _case_grads(dtype_list, seed=0):
    g = torch.Generator().manual_seed(seed)
    grads = []
    for i, dtype in enumerate(dtype_list):
        base = torch.randn(7, 5, generator=g) * 100
        kind = i % 4
        if kind == 0:
            grads.append(base.to(dtype).contiguous())
        elif kind == 1:
            grads.append(base.to(dtype).t())  # transposed
        elif kind == 2:
            grads.append(base.to(dtype)[1:6:2, ::2])  # sliced with strides
        else:
            grads.append(torch.empty(0, dtype=dtype))
    return grads


def _reference(grads, inv):
    return [(g.double() * inv).to(g.dtype) for g in grads]


@pytest.mark.parametrize("where", ["none", "first", "last", "random"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_unscale_and_check_mixed_dtypes_and_layouts(cpu, where, value):
    dtypes = [torch.float32, torch.float16, torch.bfloat16] * 3
    grads = _case_grads(dtypes)
    dense = [g for g in grads if g.numel()]
    if where != "none":
        target = {"first": dense[0], "last": dense[-1], "random": dense[4]}[where]
        flat_index = {"first": 0, "last": target.numel() - 1, "random": target.numel() // 2}[where]
        idx = torch.unravel_index(torch.tensor(flat_index), target.shape)
        target[tuple(int(i) for i in idx)] = value
    expected = _reference(grads, 0.25)
    found = torch.zeros(())
    grad_op_(cpu, grads, found, torch.tensor(0.25))
    assert found.item() == (0.0 if where == "none" else 1.0)
    for got, want in zip(grads, expected):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


def test_unscale_updates_views_in_place(cpu):
    base = torch.full((6, 6), 8.0)
    view = base[::2, 1:4]
    grad_op_(cpu, [view, base.t()[0]], torch.zeros(()), torch.tensor(0.5))
    assert base[0, 1].item() == 4.0 and base[2, 3].item() == 4.0  # inside the strided view
    assert base[1, 1].item() == 8.0 and base[0, 4].item() == 8.0  # outside it: untouched
    assert base[5, 0].item() == 4.0  # base.t()[0] is column 0


def test_check_is_read_only_and_finds_inf(cpu):
    grads = _case_grads([torch.float32, torch.float16, torch.bfloat16, torch.float32])
    before = [g.clone() for g in grads]
    found = torch.zeros(())
    grad_op_(cpu, grads, found)
    assert found.item() == 0.0
    grads[2][0, 0] = math.nan
    grad_op_(cpu, grads, found)
    assert found.item() == 1.0
    for g, b in zip(grads[:2], before[:2]):
        assert torch.equal(g, b)


def test_unscale_check_norm_matches_float64_norm(cpu):
    grads = _case_grads([torch.float32, torch.float16, torch.bfloat16] * 2, seed=3)
    expected = torch.linalg.vector_norm(torch.cat([(g.double() * 0.5).flatten() for g in grads]))
    norm_sq = torch.zeros(())
    found = torch.zeros(())
    grad_op_(cpu, grads, found, torch.tensor(0.5), norm_sq)
    assert found.item() == 0.0
    torch.testing.assert_close(norm_sq.sqrt().double(), expected, rtol=2e-3, atol=0)


class MinimalVendor(Backend):
    """A vendor backend as the docs promise: three attributes and unavailable_reason()."""

    name = "minimal"
    device_type = "cpu"
    default_dtype = torch.bfloat16

    def unavailable_reason(self) -> str | None:
        return None


class OlderVendor(Backend):
    """A plugin written against the older contract: is_available() alone."""

    name = "older"
    device_type = "cpu"
    default_dtype = torch.bfloat16

    def __init__(self, answer: object) -> None:
        self.answer = answer

    def is_available(self) -> bool:
        return self.answer  # type: ignore[return-value]  # the wrong type on purpose: the refusal is the test


def test_minimal_vendor_backend_gets_working_defaults():
    be = MinimalVendor()
    assert be.supported_dtypes()[0] == torch.bfloat16
    assert be.unavailable_reason() is None and be.dist_backend == "gloo"
    x = torch.randn(3, 3)
    with be.autocast():
        assert (x @ x).dtype == torch.bfloat16
    grads = [torch.tensor([2.0, math.inf])]
    found = torch.zeros(())
    grad_op_(be, grads, found, torch.tensor(0.5))
    assert found.item() == 1.0 and grads[0][0].item() == 1.0
    assert be.kernel.name == "torch"
    assert not be.grad_scaler().is_enabled(), "bf16 needs no scaling"
    with pytest.raises(NotImplementedError, match="must implement unavailable_reason"):
        Backend().is_available()


def test_the_one_availability_probe_also_answers_for_an_older_plugins_is_available():
    assert OlderVendor(True).unavailable_reason() is None and OlderVendor(True).is_available()
    assert OlderVendor(False).unavailable_reason() == "OlderVendor.is_available() returned False"
    assert "returned int 1, not True or False" in OlderVendor(1).unavailable_reason()
