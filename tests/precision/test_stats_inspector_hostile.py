"""Hostile inputs for the quantization statistics (``quant_stats``, ``precision.quantize``), the fp8
and MX layers a policy installs, and ``check_model``'s report.

Each test compares with a reference computed another way: torchao's own functions and layers used
directly, torch's float8 casts, a float64 computation, ``clip_grad_norm_``, or a count by hand."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

import amp_backends
from amp_backends.precision import quantize
from amp_backends.precision.formats import AXIS, spec
from amp_backends.precision.fp8 import engine as fp8_engine

from fp8_marks import needs_mx, needs_torchao

# float16 on a CPU without float16 matrix units warns that it is emulated; no figure here depends on it
pytestmark = pytest.mark.filterwarnings("ignore::amp_backends.PerformanceWarning")
FP16 = torch.float16
HAS_FLOAT8 = hasattr(torch, "float8_e4m3fn")


def _torchao(*names: str) -> list:
    """Names from torchao, imported quietly (its import logs about kernels this machine lacks)."""
    import importlib

    with fp8_engine._quiet_import():
        found = []
        for name in names:
            module, _, attr = name.rpartition(".")
            found.append(getattr(importlib.import_module(module), attr))
    return found


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN where NaN."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


# -- 1 and 11: inf/NaN that float32 has too ------------------------------------------------------
class Gained(nn.Module):
    """A Linear times a buffer; the buffer or the weight can hold inf/NaN (float32 fails alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("gain", torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.gain


class RootAtZero(nn.Module):
    """sqrt at 0 in the loss: its derivative there is inf, times 0 a NaN, in any precision."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h.mean() + (h[:, :1] * 0).sqrt().sum()


@pytest.mark.parametrize("what", ["buffer inf", "weight nan"])
def test_inf_or_nan_the_float32_model_holds_is_not_blamed_on_float16(what):
    """float16 check of a model whose float32 forward is inf/NaN already (an inf in a buffer, a NaN in a
    weight), against a plain float32 forward and the float16 forward run by hand: said to be float32's,
    not beyond scaling, and none of its infs counted over 65504 (by hand: every inf of the float16 output
    is inf in float32 too)."""
    torch.manual_seed(0)
    model, x = Gained(), torch.randn(8, 16)
    with torch.no_grad():
        if what == "buffer inf":
            model.gain[3] = float("inf")
        else:
            model.lin.weight[2, 2] = float("nan")
        fp32 = model(x)
        with torch.autocast("cpu", FP16):
            low = model(x)
    assert not torch.isfinite(fp32.mean())  # the model fails in float32
    by_hand = int(((low.float().abs() > 65504) & torch.isfinite(fp32)).sum())
    assert by_hand == 0
    report = amp_backends.check_model(model, x, "cpu", FP16, memory=False)
    assert not report.beyond_scaling and report.fp32_loss_finite is False
    assert report.outputs_over == by_hand and report.params_over == 0
    assert report.fp32_nonfinite_output == ("" if what == "buffer inf" else "lin")
    assert "non-finite in float32 too (not a precision problem)" in report.summary
    assert "no loss scale can save" not in report.summary, report.summary


def _grads_at(model: nn.Module, x: torch.Tensor, scale: float, dtype: torch.dtype | None) -> list[torch.Tensor]:
    """The unscaled gradients of the model's mean output, under autocast to ``dtype`` (None: float32)."""
    params = list(model.parameters())
    with torch.autocast("cpu", dtype or torch.float32, enabled=dtype is not None):
        loss = model(x).float().mean()
    return [g.float() / scale for g in torch.autograd.grad(loss * scale, params)]


def test_a_backward_nan_float32_has_too_is_told_apart_and_the_scales_judged_without_it():
    """sqrt at 0: float32's own gradients hold NaN (17, counted by hand). In float16 the report says so,
    is not beyond scaling, and its per-scale inf/NaN counts leave those out (by hand: inf/NaN in the
    float16 gradients at that scale where float32's are finite)."""
    torch.manual_seed(0)
    model, x = RootAtZero(), torch.randn(8, 16)
    ref = _grads_at(model, x, 1.0, None)
    ref_bad = sum(int((~torch.isfinite(g)).sum()) for g in ref)
    assert ref_bad == 17  # the weight's row 0 and the bias's element 0
    report = amp_backends.check_model(model, x, "cpu", FP16, memory=False)
    assert not report.beyond_scaling and report.fp32_grads_nonfinite == ref_bad
    assert report.fp32_nonfinite_grads == ["lin"]
    for s in (2.0**-10, 1.0, 2.0**10, 2.0**16):
        low = _grads_at(model, x, s, FP16)
        hand = sum(int((~torch.isfinite(a) & torch.isfinite(b)).sum()) for a, b in zip(low, ref))
        assert report.scales[s][0] == hand, s
    assert report.best_scales and "no loss scale can save" not in report.summary
    assert "17 gradient values non-finite in float32 too (not a precision problem" in report.summary


def test_a_model_float16_cannot_scale_is_still_beyond_scaling():
    """Deliberate guard: float32's gradients finite (2**60 times the loss's), float16's inf at every scale
    down to 2**-24 (by hand, at both ends): beyond scaling, with nothing said about float32."""

    class Steep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).float().sum() * 2.0**60

    torch.manual_seed(0)
    model, x = Steep(), torch.randn(4, 8)
    assert all(bool(torch.isfinite(g).all()) for g in _grads_at(model, x, 1.0, None))
    for s in (2.0**-24, 2.0**30):
        assert all(not bool(torch.isfinite(g).any()) for g in _grads_at(model, x, s, FP16)), s
    report = amp_backends.check_model(model, x, "cpu", FP16, memory=False)
    assert report.beyond_scaling and report.loss_finite and report.fp32_grads_nonfinite == 0
    assert "inf/NaN at every scale from 2**-24 to 2**30" in report.summary
    assert "float32 too" not in report.summary


def test_the_gradient_norm_is_what_clip_grad_norm_returns_and_the_nonfinite_ones_are_said():
    """bfloat16, sqrt at 0: the report's gradient norm against torch.nn.utils.clip_grad_norm_ on the same
    bfloat16 gradients (NaN), the norm of the finite values against a float64 computation, and the
    summary saying both, with the count."""
    torch.manual_seed(0)
    model, x = RootAtZero(), torch.randn(8, 16)
    low = _grads_at(model, x, 1.0, torch.bfloat16)
    holders = [nn.Parameter(torch.zeros_like(g)) for g in low]
    for h, g in zip(holders, low):
        h.grad = g.clone()
    clipped = float(torch.nn.utils.clip_grad_norm_(holders, max_norm=math.inf))
    finite = math.sqrt(sum(float(torch.where(torch.isfinite(g), g, 0).double().pow(2).sum()) for g in low))
    bad = sum(int((~torch.isfinite(g)).sum()) for g in low)
    report = amp_backends.check_model(model, x, "cpu", torch.bfloat16, memory=False)
    assert math.isnan(clipped) and math.isnan(report.grad_norm)
    assert report.grad_norm_finite == pytest.approx(finite, rel=1e-6) and report.grads_nonfinite == bad == 17
    assert f"gradient norm nan ({bad} inf/NaN gradient values; the norm of the finite ones {finite:.4g})" \
        in report.summary, report.summary
    assert "non-finite in float32 too (not a precision problem)" in report.summary


# -- 5: a value counted where it was produced ------------------------------------------------------
def test_an_output_passed_up_through_containers_is_counted_once():
    """Sequential(Sequential(Linear)) whose Linear overflows float16 in 4 values: the total over 65504
    equals the count by hand in the model's float16 output, all of it at the Linear."""
    lin = nn.Linear(16, 16)
    with torch.no_grad():
        lin.weight.zero_()
        lin.weight[0, 0] = 1e5
    model, x = nn.Sequential(nn.Sequential(lin)), torch.ones(4, 16)
    with torch.no_grad(), torch.autocast("cpu", FP16):
        by_hand = int((model(x).float().abs() > 65504).sum())
    report = amp_backends.check_model(model, x, "cpu", FP16, memory=False)
    rows = {r.name: r.outputs_over for r in report.rows}
    assert by_hand == 4 and report.outputs_over == by_hand
    assert rows == {"": 0, "0": 0, "0.0": by_hand}
    assert f"{by_hand} in outputs" in report.summary


def test_an_overflow_made_in_place_on_a_childs_output_counts_where_it_was_made():
    """Deliberate guard: a module scaling its child's output in place (the same storage, a residual
    ``out += x`` does the same) made those overflows; counted there, as many as by hand."""

    class Louder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return h.mul_(1e6)

    torch.manual_seed(0)
    model, x = Louder(), torch.randn(4, 16)
    with torch.no_grad(), torch.autocast("cpu", FP16):
        child = model.lin(x)
        made = int((child.float().abs() > 65504).sum())
        by_hand = int((model(x).float().abs() > 65504).sum())
    report = amp_backends.check_model(model, x, "cpu", FP16, memory=False)
    rows = {r.name: r.outputs_over for r in report.rows}
    assert made == 0 and by_hand > 0
    assert rows == {"": by_hand, "lin": 0} and report.outputs_over == by_hand


def test_the_chunks_of_one_tensor_a_module_makes_all_count():
    """Deliberate guard: a module returning two chunks of the tensor it made (one storage, two outputs):
    each chunk's overflows count, as many as by hand over both."""

    class Halves(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return (self.lin(x) * 1e6).chunk(2, dim=-1)

    torch.manual_seed(0)
    model, x = Halves(), torch.randn(4, 16)
    with torch.no_grad(), torch.autocast("cpu", FP16):
        by_hand = sum(int((h.float().abs() > 65504).sum()) for h in model(x))
    report = amp_backends.check_model(model, x, "cpu", FP16, loss_fn=lambda out: out[0].float().mean()
                                      + out[1].float().mean(), memory=False)
    assert by_hand > 8 and report.outputs_over == by_hand


# -- 10: strict JSON ------------------------------------------------------------------------------
def test_check_json_is_strict_json_for_a_forward_only_model(tmp_path, monkeypatch, capsys):
    """A frozen model (forward only: its gradient norm is NaN in the report) through ``amp-backends check
    --json``: a strict parser (no NaN/Infinity tokens) reads it, the norm as null."""
    (tmp_path / "frozen_target.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def make():\n    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(16, 16)).requires_grad_(False), torch.randn(4, 16)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("AMP_BACKEND", raising=False)
    from amp_backends.cli import main

    assert main(["check", "frozen_target:make", "--json", "--backend", "cpu", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out

    def refuse(token: str) -> None:
        raise ValueError(f"not JSON: {token}")

    data = json.loads(out, parse_constant=refuse)
    assert data["grad_norm"] is None and data["rows"][1]["name"] == "0"


# -- 2, 3, 4: quant_stats --------------------------------------------------------------------------
def test_quant_stats_survives_a_batch_of_no_tokens():
    """A step on 0 tokens runs as plain torch runs it (an empty output, a zero weight gradient): the
    input and gradient operands are skipped, the weight is measured (its numel counted by hand)."""
    model = nn.Sequential(nn.Linear(32, 32))
    stats = amp_backends.quant_stats(model, every=1, formats=["fp8_tensorwise", "mxfp8"])
    x = torch.randn(0, 32, requires_grad=True)
    out = model(x)
    out.sum().backward()
    assert out.shape == (0, 32) and torch.equal(model[0].weight.grad, torch.zeros(32, 32))
    ops = stats.read()[0]["0"]["operands"]
    assert set(ops) == {"fwd.weight", "dgrad.weight"}
    assert ops["fwd.weight"]["fp8_tensorwise"]["numel"] == 32 * 32


@needs_torchao
def test_a_layer_called_twice_in_a_step_has_figures_over_both_calls():
    """A shared Linear called on 64 and on 16 tokens: each operand's figures cover both calls, against
    torchao's tensorwise quantizer run on each call's tensor (numel and squared errors add, amax and the
    largest scale are the larger, the smallest scale the smaller)."""
    tensor_to_scale, to_fp8_saturated = _torchao("torchao.float8.float8_utils.tensor_to_scale",
                                                 "torchao.float8.float8_utils.to_fp8_saturated")
    torch.manual_seed(0)
    lin = nn.Linear(32, 32)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.lin(a).sum() + 2 * self.lin(b).sum()

    model, a, b = Twice(), torch.randn(64, 32), torch.randn(16, 32) * 1000
    stats = amp_backends.quant_stats(model, every=1, formats=["fp8_tensorwise"])
    model(a, b).backward()
    ops = stats.read()[0]["lin"]["operands"]
    grads = [torch.ones(64, 32), torch.full((16, 32), 2.0)]
    for operand, tensors, dtype in (("fwd.input", [a, b], torch.float8_e4m3fn),
                                    ("dgrad.grad_output", grads, torch.float8_e5m2)):
        figs = ops[operand]["fp8_tensorwise"]
        scales = [tensor_to_scale(t, dtype) for t in tensors]
        sse = sum(float(((to_fp8_saturated(t * s, dtype).float() / s).double() - t.double()).pow(2).sum())
                  for t, s in zip(tensors, scales))
        numel = sum(t.numel() for t in tensors)
        assert figs["numel"] == numel, operand
        assert figs["mse"] == pytest.approx(sse / numel, rel=1e-5), operand
        assert figs["amax"] == max(float(t.abs().max()) for t in tensors)
        assert figs["scale_min"] == pytest.approx(min(1 / float(s) for s in scales), rel=1e-6)
        assert figs["scale_max"] == pytest.approx(max(1 / float(s) for s in scales), rel=1e-6)
    assert ops["fwd.weight"]["fp8_tensorwise"]["numel"] == 2 * lin.weight.numel()


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_a_layer_converted_by_torchao_directly_reports_its_recipe(recipe):
    """convert_to_float8_training with torchao's recipe config: the format is that recipe's."""
    convert, config = _torchao("torchao.float8.convert_to_float8_training", "torchao.float8.Float8LinearConfig")
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    convert(model, config=dataclasses.replace(config.from_recipe_name(recipe), emulate=True))
    stats = amp_backends.quant_stats(model, every=1)
    model(torch.randn(32, 64, requires_grad=True)).sum().backward()
    got = stats.read()[0]
    assert {name: layer["format"] for name, layer in got.items()} == {"0": f"fp8_{recipe}", "1": f"fp8_{recipe}"}


@needs_mx
def test_torchaos_mx_layer_used_directly_reports_mxfp8():
    """torchao's MXFP8Linear (RCEIL), built directly: mxfp8, and with wgrad_with_hp mxfp8_with_gw_hp."""
    layer_cls, mode, kernel = _torchao("torchao.prototype.moe_training.mxfp8_linear.MXFP8Linear",
                                       "torchao.prototype.mx_formats.config.ScaleCalculationMode",
                                       "torchao.quantization.quantize_.common.KernelPreference")
    model = nn.Sequential(*(layer_cls(32, 32, bias=False, kernel_preference=kernel.EMULATED,
                                      scale_calculation_mode=mode.RCEIL, wgrad_with_hp=hp) for hp in (False, True)))
    stats = amp_backends.quant_stats(model, every=1)
    model(torch.randn(32, 32, requires_grad=True)).sum().backward()
    got = stats.read()[0]
    assert {name: layer["format"] for name, layer in got.items()} == {"0": "mxfp8", "1": "mxfp8_with_gw_hp"}


def test_check_model_is_no_training_step_for_quant_stats():
    """Statistics attached, then check_model (its runs are forwards of the model): no step counted,
    nothing measured; the next training step is step 0 (counted by hand: one forward)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    stats = amp_backends.quant_stats(model, every=100)
    amp_backends.check_model(model, torch.randn(32, 32), backend="cpu", dtype=FP16)
    assert stats.step == 0 and stats.read() == {}
    with torch.autocast("cpu", torch.bfloat16):
        model(torch.randn(32, 32)).float().sum().backward()
    got = stats.read()
    assert stats.step == 1 and list(got) == [0] and got[0]["0"]["format"] == "bf16"


# -- 6 and 7: the scales, bitwise, and what counts as an overflow ---------------------------------
def _amax_cases() -> torch.Tensor:
    """Random magnitudes over 35 decades each way, values at and next to 448 * 2**k and 57344 * 2**k,
    huge ones (above 8.5e37, where a reciprocal is subnormal), tiny ones below torchao's 1e-12."""
    g = torch.Generator().manual_seed(0)
    rand = torch.exp(torch.empty(200_000).uniform_(-80, 80, generator=g))
    edges = torch.cat([torch.tensor([448.0 * 2.0**k for k in range(-100, 120)]),
                       torch.tensor([57344.0 * 2.0**k for k in range(-110, 110)])])
    inf = torch.tensor(float("inf"))
    near = torch.cat([edges, torch.nextafter(edges, inf), torch.nextafter(edges, -inf),
                      torch.nextafter(torch.nextafter(edges, inf), inf)])
    huge = torch.exp(torch.empty(20_000).uniform_(math.log(8.5e37), math.log(3.4e38), generator=g))
    tiny = torch.tensor([0.0, 1e-45, 1e-30, 9.99e-13, 1e-12, 1.0000001e-12, float(torch.finfo().max)])
    return torch.cat([rand, near, huge, tiny]).float()


@needs_torchao
@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
def test_amax_to_scale_is_torchaos_bitwise(element, pow2):
    """Against torchao.float8.float8_utils.amax_to_scale on the same amax values, bitwise."""
    (ao_scale,) = _torchao("torchao.float8.float8_utils.amax_to_scale")
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[element]
    amax = _amax_cases()
    ours = quantize.amax_to_scale(amax, element, pow2)
    theirs = ao_scale(amax, dtype, round_scales_to_power_of_2=pow2)
    differ = (ours.view(torch.int32) != theirs.view(torch.int32)).nonzero().flatten()
    assert differ.numel() == 0, [(amax[i].item(), ours[i].item(), theirs[i].item()) for i in differ[:5].tolist()]


@needs_torchao
def test_a_huge_outlier_dequantizes_as_torchaos():
    """Tensorwise fp8 of a tensor holding 3e38 and -3.3e38: the dequantized values against torchao's
    tensor_to_scale + to_fp8_saturated, bitwise."""
    tensor_to_scale, to_fp8_saturated = _torchao("torchao.float8.float8_utils.tensor_to_scale",
                                                 "torchao.float8.float8_utils.to_fp8_saturated")
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    x[0, 0], x[1, 1] = 3e38, -3.3e38
    scale = tensor_to_scale(x, torch.float8_e4m3fn)
    ref = to_fp8_saturated(x * scale, torch.float8_e4m3fn).float() / scale
    assert _same(quantize.qdq(x, spec("fp8_tensorwise", "fwd.input"), -1)[0], ref)


def _cast_overflows(y: torch.Tensor, element: str) -> torch.Tensor:
    """Where torch's float8 cast, unsaturated, leaves the format. torch's e5m2 cast makes inf; its e4m3fn
    cast saturates (torch 2.13) or makes NaN (torch 2.11) far out, so it runs on y / 2 (exact), whose grid
    step past 224 is representable (240)."""
    if element == "e5m2":
        return torch.isinf(y.to(torch.float8_e5m2).float()) & torch.isfinite(y)
    half = (y / 2).to(torch.float8_e4m3fn).float()
    return half.isnan() | (half.abs() * 2 > 448)


@pytest.mark.skipif(not HAS_FLOAT8, reason="this torch has no float8 dtypes to compare with")
@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_an_overflow_is_a_value_the_cast_would_carry_out_of_range(element):
    """The overflow rule against torch's own float8 cast on values around the largest one and the
    boundary after it (448.00003 rounds to 448: no overflow)."""
    fmax = quantize.FP8[element][0]
    inf = torch.tensor(float("inf"))
    points = torch.tensor([fmax, 464.0, 480.0, 61440.0, 65536.0, 1e6])
    points = torch.cat([points, torch.nextafter(points, inf), torch.nextafter(points, -inf),
                        torch.linspace(fmax * 0.9, fmax * 1.2, 4001)])
    y = torch.cat([points, -points])
    assert torch.equal(quantize.beyond(y, element), _cast_overflows(y, element))


@pytest.mark.skipif(not HAS_FLOAT8, reason="this torch has no float8 dtypes to compare with")
def test_no_mx_overflow_is_counted_where_nothing_leaves_the_range():
    """Blocks whose amax sits just above 448 * 2**k (scaled by the block's power of two, 448.00003 in
    float32, which the cast rounds to 448): overflow counts against torch's cast of the scaled values."""
    for k in (0, 3, 10, 20, 40):
        a = torch.nextafter(torch.tensor(448.0 * 2.0**k), torch.tensor(float("inf")))
        x = torch.ones(2, 32)
        x[0, 0], x[1, 5] = a, -a
        _, over, scale = quantize.qdq(x, spec("mxfp8", "fwd.input"), -1)
        scaled = x.reshape(2, 1, 32) / scale  # a power of two: exact
        assert int(over.sum()) == int(_cast_overflows(scaled, "e4m3").sum()) == 0, k


@needs_torchao
def test_no_tensorwise_overflow_is_counted_where_nothing_leaves_the_range():
    """Random tensors, each scaled by its own amax: overflow counts against torch's cast of the values
    scaled by torchao's tensor_to_scale (none leaves the range; 448.00003 rounds to 448)."""
    (tensor_to_scale,) = _torchao("torchao.float8.float8_utils.tensor_to_scale")
    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        x = torch.randn(8, 32, generator=g) * float(torch.exp(torch.randn((), generator=g) * 5))
        _, over, _ = quantize.qdq(x, spec("fp8_tensorwise", "fwd.input"), -1)
        reference = _cast_overflows(x * tensor_to_scale(x, torch.float8_e4m3fn), "e4m3")
        assert int(over.sum()) == int(reference.sum()) == 0


# -- 8: errors of tiny and huge tensors -----------------------------------------------------------
@pytest.mark.parametrize("magnitude", [1e-21, 1e-23, 1e19])
def test_errors_of_tiny_and_huge_gradients_equal_a_float64_computation(magnitude):
    """A Linear's output gradient of magnitude 1e-21, 1e-23 and 1e19 (float32 squares underflow or
    overflow there): rel_error and mse in fp8 tensorwise, MXFP8 and bf16 against float64 sums of the
    quantized values (bf16: torch's cast)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32, bias=False))
    gy = torch.randn(64, 32) * magnitude
    stats = amp_backends.quant_stats(model, every=1, formats=["fp8_tensorwise", "mxfp8", "bf16"])
    model(torch.randn(64, 32, requires_grad=True)).backward(gy)
    figs = stats.read()[0]["0"]["operands"]["dgrad.grad_output"]
    exact = gy.double()
    for fmt in ("fp8_tensorwise", "mxfp8", "bf16"):
        deq = gy.bfloat16().double() if fmt == "bf16" else \
            quantize.qdq(gy, spec(fmt, "dgrad.grad_output"), AXIS["dgrad.grad_output"])[0].double()
        sse = float(((deq - exact) ** 2).sum())
        assert figs[fmt]["rel_error"] == pytest.approx(math.sqrt(sse / float((exact**2).sum())), rel=1e-5), fmt
        assert figs[fmt]["mse"] == pytest.approx(sse / gy.numel(), rel=1e-5), fmt
        assert figs[fmt]["rel_error"] > 0, fmt


# -- 9: the layers a policy converts take what a Linear takes -------------------------------------
def _policy_layer(recipe: str, layer: nn.Linear) -> nn.Module:
    model = nn.Sequential(layer)
    amp_backends.precision_policy(model, fp32=[], fp8=[nn.Linear], fp8_recipe=recipe, emulate=True, backend="cpu")
    return model


def _run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True) if x.is_contiguous() else x.detach().requires_grad_(True)
    out = model(x)
    out.sum().backward()
    grad = model[0].weight.grad.clone()
    model[0].weight.grad = None
    return out.detach(), x.grad, grad


@needs_mx
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_with_gw_hp"])
def test_mx_layers_take_strided_inputs_and_weights(recipe):
    """A transposed 2-D input, and a weight made from a transpose: outputs and gradients against
    torchao's MXFP8Linear (emulated, RCEIL) used directly on contiguous copies, bitwise."""
    layer_cls, mode, kernel = _torchao("torchao.prototype.moe_training.mxfp8_linear.MXFP8Linear",
                                       "torchao.prototype.mx_formats.config.ScaleCalculationMode",
                                       "torchao.quantization.quantize_.common.KernelPreference")
    torch.manual_seed(0)
    weight = torch.randn(64, 32).t()  # (32, 64) stored transposed
    ours = _policy_layer(recipe, nn.Linear(64, 32, bias=False))
    ours[0].weight = nn.Parameter(weight)
    ref = nn.Sequential(layer_cls(64, 32, bias=False, kernel_preference=kernel.EMULATED,
                                  scale_calculation_mode=mode.RCEIL, wgrad_with_hp=recipe.endswith("gw_hp")))
    ref[0].weight = nn.Parameter(weight.contiguous())
    x = torch.randn(64, 32).t()  # (32, 64), not contiguous
    got, want = _run(ours, x), _run(ref, x.contiguous())
    assert not ours[0].weight.is_contiguous() and all(_same(a, b) for a, b in zip(got, want))


@needs_torchao
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_layers_take_a_transposed_3d_input(recipe):
    """A (B, T, K) input made by a transpose: against torchao's Float8Linear (convert_to_float8_training,
    emulated) on the contiguous copy, bitwise."""
    convert, config = _torchao("torchao.float8.convert_to_float8_training", "torchao.float8.Float8LinearConfig")
    torch.manual_seed(0)
    base = nn.Linear(64, 64)
    ours = _policy_layer(recipe, nn.Linear(64, 64))
    ours[0].load_state_dict(base.state_dict())
    ref = nn.Sequential(nn.Linear(64, 64))
    ref[0].load_state_dict(base.state_dict())
    convert(ref, config=dataclasses.replace(config.from_recipe_name(recipe), emulate=True))
    x = torch.randn(2, 64, 16).transpose(1, 2)
    got, want = _run(ours, x), _run(ref, x.contiguous())
    assert all(_same(a, b) for a, b in zip(got, want))


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp",
                                    pytest.param("mxfp8", marks=needs_mx)])
def test_fp8_layers_take_a_batch_of_no_tokens(recipe):
    """0 tokens, plain and under bfloat16 autocast: as a plain Linear (an empty output of the dtype it
    gives, a zero weight gradient)."""
    ours, plain = _policy_layer(recipe, nn.Linear(64, 64)), nn.Sequential(nn.Linear(64, 64))
    for autocast in (False, True):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            got, want = ours(torch.randn(0, 64, requires_grad=True)), plain(torch.randn(0, 64, requires_grad=True))
        got.float().sum().backward()
        assert got.shape == want.shape == (0, 64) and got.dtype == want.dtype
        assert torch.equal(ours[0].weight.grad, torch.zeros(64, 64))


# -- 12: the break-even borrowed ------------------------------------------------------------------
@needs_torchao
def test_the_break_even_of_rowwise_with_gw_hp_is_said_to_be_rowwises():
    """torchao measured none for rowwise_with_gw_hp (its filter refuses the recipe); the decision is
    rowwise's (torchao's rowwise filter keeps the layer out too), and the words say it is borrowed."""
    (auto_filter,) = _torchao("torchao.float8.float8_linear_utils._auto_filter_for_recipe")
    with pytest.raises(NotImplementedError):
        auto_filter("rowwise_with_gw_hp", [])
    for shape in ((1024, 1024), (4096, 4096), (8192, 8192)):
        layer = nn.Linear(*shape)
        says = fp8_engine.too_small(layer, "rowwise_with_gw_hp")
        assert (says is not None) == (not auto_filter("rowwise", [])(layer, "x")), shape
        if says is not None:
            assert "break-even for rowwise (" in says and "borrowed for rowwise_with_gw_hp" in says
            assert "break-even for rowwise_with_gw_hp" not in says
