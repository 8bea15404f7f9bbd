"""Quantization statistics per layer (``amp_backends.quant_stats``) and the quantizers they rest on
(``amp_backends.precision.quantize``).

Each figure is pinned to a direct count on tensors whose values are chosen so the count is known
(1e-8 underflows in fp16 and in every 8-bit format here, 7e4 overflows fp16), and the errors to
torchao's own quantizers where torchao is installed. The quantizers themselves are checked bitwise
against torchao's (tensorwise, rowwise along each operand's axis, MXFP8) and against torch's float8
casts."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import amp_backends
from amp_backends.precision import quantize
from amp_backends.precision.formats import AXIS, OPERANDS, spec
from amp_backends.precision.fp8 import engine as fp8_engine

from fp8_marks import needs_mx, needs_torchao

HAS_FLOAT8 = hasattr(torch, "float8_e4m3fn")


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32),
                                                                      b.contiguous().view(torch.int32))


def _wide(seed: int, shape: tuple[int, int] = (64, 96)) -> torch.Tensor:
    """Log-normal magnitudes over many decades, random signs, zeros and an outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(shape, generator=g) * 3.0) * torch.sign(torch.randn(shape, generator=g)) * 1e-2
    x[0, :5] = 0
    x[3, 7] = 7e4
    return x


@pytest.mark.skipif(not HAS_FLOAT8, reason="this torch has no float8 dtypes to compare with")
@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_round_fp8_equals_torchs_float8_cast_bitwise(element):
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[element]
    fmax = quantize.FP8[element][0]
    x = torch.cat([_wide(1).flatten() * 10, torch.linspace(-fmax, fmax, 20001), torch.tensor([0.0, -0.0])])
    x = x.clamp(-fmax, fmax)
    assert _bits(quantize.round_fp8(x, element), x.to(dtype).float())


@needs_torchao
@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_with_gw_hp",
                                 pytest.param("mxfp8", marks=needs_mx)])
@pytest.mark.parametrize("operand", OPERANDS)
def test_quantizers_equal_torchaos_bitwise(fmt, operand):
    """Dequantized values of every operand along its axis: torchao's tensor_to_scale + to_fp8_saturated
    (dequantized q / scale, its emulated matmul's), and its MX to_mx (dequantized q * 2**(e - 127))."""
    with fp8_engine._quiet_import():
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.quantization.quantize_.common import KernelPreference
    x = _wide(2)
    s = spec(fmt, operand)
    axis = AXIS[operand]
    deq, _, _ = quantize.qdq(x, s, axis)
    if s.kind == "hp":
        assert _bits(deq, x)
        return
    if s.kind == "mx":
        rows = x if axis == -1 else x.t().contiguous()
        ref = MXTensor.to_mx(rows, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL,
                             KernelPreference.EMULATED).dequantize(torch.float32)
        assert _bits(deq, ref if axis == -1 else ref.t().contiguous())
        return
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[s.element]
    if s.kind == "tensorwise":
        scale = tensor_to_scale(x, dtype, round_scales_to_power_of_2=s.pow2)
    else:
        scale = tensor_to_scale(x, dtype, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=axis, round_scales_to_power_of_2=True)
    ref = to_fp8_saturated(x.float() * scale, dtype).float() / scale
    assert _bits(deq, ref)


def _known(m: int, k: int, tiny: int, huge: int, small: float = 1e-8) -> torch.Tensor:
    """Ones, with ``tiny`` entries of ``small`` and ``huge`` of 7e4 at fixed places (one per row at most)."""
    x = torch.ones(m, k)
    x.view(-1)[torch.arange(tiny) * k + 1] = small
    x.view(-1)[torch.arange(huge) * k + 2] = 7e4
    return x


def test_statistics_equal_direct_counts_on_known_values():
    """A Linear whose input, weight and output gradient hold known numbers of tiny values (1e-8 against
    amax 7e4 or 1, 1e-14 against 1e-3: below every scaled format's smallest value, and fp16's) and 7e4 (beyond fp16's 65504): the figures for every
    operand and format are those counts, the amax is 7e4 (or 1), the fp16 mse is inf where 7e4 became
    inf; the errors equal the mean squared error of the quantizer's values, counted directly."""
    m, k, n = 64, 32, 32
    layer = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        layer.weight.copy_(_known(n, k, tiny=3, huge=2))
    model = nn.Sequential(layer)
    x = _known(m, k, tiny=5, huge=4).requires_grad_(True)
    gy = _known(m, n, tiny=7, huge=0, small=1e-11) * 1e-3  # gradients: 1e-14 underflows all but bf16 (e5m2 too)
    stats = amp_backends.quant_stats(model, every=1,
                                     formats=["fp32", "bf16", "fp16", "fp8_tensorwise", "fp8_rowwise", "mxfp8"])
    model(x).backward(gy)
    got = stats.read()
    assert list(got) == [0] and got[0]["0"]["format"] == "fp32"
    ops = got[0]["0"]["operands"]
    assert set(ops) == set(OPERANDS)
    tensors = {"input": (x.detach(), 5, 4), "weight": (layer.weight.detach(), 3, 2), "grad_output": (gy, 7, 0)}
    from amp_backends.precision.formats import TENSOR

    for operand, by_format in ops.items():
        t, tiny, huge = tensors[TENSOR[operand]]
        assert set(by_format) == {"fp32", "bf16", "fp16", "fp8_tensorwise", "fp8_rowwise", "mxfp8"}
        for fmt, figs in by_format.items():
            numel = t.numel()
            assert figs["numel"] == numel
            expected_under = 0 if fmt in ("fp32", "bf16") else tiny
            assert figs["underflow_pct"] == pytest.approx(100.0 * expected_under / numel), (operand, fmt)
            expected_over = huge if fmt == "fp16" else 0
            assert figs["overflow_pct"] == pytest.approx(100.0 * expected_over / numel), (operand, fmt)
            assert figs["amax"] == t.abs().max().item()
            deq = quantize.qdq(t, spec(fmt, operand), AXIS[operand])[0]
            direct = ((deq - t) ** 2).mean().item()
            if fmt == "fp16" and huge:
                assert figs["mse"] == math.inf
            else:
                assert figs["mse"] == pytest.approx(direct, rel=1e-6), (operand, fmt)
            if fmt == "fp32":
                assert figs["mse"] == 0 and figs["scale_min"] == figs["scale_max"] == 1.0
    # the scales: tensorwise fp8 of the input is amax / 448 (dequantization), MX's 2**ceil(log2(amax / 448))
    fwd = ops["fwd.input"]
    assert fwd["fp8_tensorwise"]["scale_max"] == pytest.approx(7e4 / 448, rel=1e-6)
    assert fwd["mxfp8"]["scale_max"] == 2.0 ** math.ceil(math.log2(7e4 / 448))  # blocks holding 7e4
    assert fwd["mxfp8"]["scale_min"] == 2.0 ** math.ceil(math.log2(1 / 448))  # blocks of ones and 1e-8
    assert ops["dgrad.grad_output"]["fp8_tensorwise"]["scale_max"] == pytest.approx(1e-3 / 57344, rel=1e-6)  # e5m2


@needs_torchao
def test_errors_equal_torchaos_quantizer_directly():
    """The mse of fp8 tensorwise on a wide-range input, against torchao's own quantize-dequantize."""
    with fp8_engine._quiet_import():
        from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    x = _wide(3, (64, 32))
    model = nn.Sequential(nn.Linear(32, 32))
    stats = amp_backends.quant_stats(model, every=1, formats=["fp8_tensorwise"])
    with torch.no_grad():
        model(x)
    figs = stats.read()[0]["0"]["operands"]["fwd.input"]["fp8_tensorwise"]
    scale = tensor_to_scale(x, torch.float8_e4m3fn)
    ref = to_fp8_saturated(x * scale, torch.float8_e4m3fn).float() / scale
    assert figs["mse"] == pytest.approx(((ref - x) ** 2).mean().item(), rel=1e-6)
    under = ((x != 0) & (ref == 0)).sum().item()
    assert figs["underflow_pct"] == pytest.approx(100.0 * under / x.numel()) and under > 0


def test_every_n_steps_the_layers_own_format_and_no_host_read():
    """Sampled on steps 0, 3, 6 of 8; under bf16 autocast the layer's format is bf16; the hooks read
    nothing from the device (no aten._local_scalar_dense) until read()."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    stats = amp_backends.quant_stats(model, layers=["2"], every=3, formats=["fp8_tensorwise"])

    class Reads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                self.reads += 1
            return func(*args, **(kwargs or {}))

    with Reads() as mode:
        for _ in range(8):
            with torch.autocast("cpu", torch.bfloat16):
                out = model(torch.randn(32, 32))
            out.float().sum().backward()
    assert mode.reads == 0
    got = stats.read()
    assert list(got) == [0, 3, 6] and set(got[0]) == {"2"}
    assert got[3]["2"]["format"] == "bf16"
    assert set(got[3]["2"]["operands"]["fwd.input"]) == {"bf16", "fp8_tensorwise"}
    assert stats.read() == {}  # read clears
    flat = stats.scalars(got)
    assert flat[6]["quant/2/wgrad.grad_output/fp8_tensorwise/underflow_pct"] == \
        got[6]["2"]["operands"]["wgrad.grad_output"]["fp8_tensorwise"]["underflow_pct"]
    stats.remove()
    model(torch.randn(32, 32))
    assert stats.read() == {}


@needs_mx
def test_an_mx_layer_reports_its_format_and_mx_skips_shapes_it_cannot_take():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48))
    amp_backends.precision_policy(model, fp32=[], fp8=["0"], fp8_recipe="mxfp8", emulate=True, backend="cpu")
    stats = amp_backends.quant_stats(model, every=1, formats=["mxfp8"])
    model(torch.randn(32, 32)).sum().backward()
    got = stats.read()[0]
    assert got["0"]["format"] == "mxfp8" and got["2"]["format"] == "fp32"
    assert "mxfp8" in got["2"]["operands"]["fwd.input"]  # along K = 64
    assert "mxfp8" not in got["2"]["operands"]["dgrad.grad_output"]  # along N = 48: not a multiple of 32


def test_bad_arguments_are_refused_naming_the_problem():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    with pytest.raises(ValueError, match="every"):
        amp_backends.quant_stats(model, every=0)
    with pytest.raises(ValueError, match="unknown format 'fp4'"):
        amp_backends.quant_stats(model, formats=["fp4"])
    with pytest.raises(ValueError, match="not a Linear layer"):
        amp_backends.quant_stats(model, layers=[nn.LayerNorm])
    assert not model._forward_pre_hooks and not model[0]._forward_hooks  # nothing left behind


@pytest.mark.skipif(not __import__("importlib").util.find_spec("tensorboard"),
                    reason="tensorboard is not installed (pip install tensorboard)")
def test_to_tensorboard_writes_every_figure(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = nn.Sequential(nn.Linear(32, 32))
    stats = amp_backends.quant_stats(model, every=1, formats=["bf16"])
    model(torch.randn(32, 32)).sum().backward()
    got = stats.to_tensorboard(str(tmp_path))
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(stats.scalars(got)[0])


def test_a_layer_a_policy_holds_in_float32_reports_fp32_inside_autocast():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    amp_backends.precision_policy(model, fp32=["2"])
    stats = amp_backends.quant_stats(model, every=1)
    with torch.autocast("cpu", torch.bfloat16):
        model(torch.randn(32, 32)).float().sum().backward()
    got = stats.read()[0]
    assert got["0"]["format"] == "bf16" and got["2"]["format"] == "fp32"
    assert set(got["2"]["operands"]["fwd.input"]) == {"fp32"}  # the own format only, by default
    assert got["2"]["operands"]["fwd.input"]["fp32"]["mse"] == 0


@pytest.mark.skipif(bool(__import__("importlib").util.find_spec("tensorboard")), reason="tensorboard is installed")
def test_to_tensorboard_without_tensorboard_says_what_to_install(tmp_path):
    model = nn.Sequential(nn.Linear(32, 32))
    stats = amp_backends.quant_stats(model, every=1)
    model(torch.randn(32, 32))
    with pytest.raises(ImportError, match="pip install tensorboard, or use read"):
        stats.to_tensorboard(str(tmp_path))
    assert 0 in stats.read()  # nothing was lost
