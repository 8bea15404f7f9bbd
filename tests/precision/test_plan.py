"""The per-layer precision plan (``amp_backends.plan_precision``, ``PrecisionPlan``,
``precision_policy(plan=...)``, ``amp-backends check --plan``).

The measured errors are pinned to torchao's own emulated layers run directly, the FLOP shares to a
direct count, the choices to the rule (the cheapest usable format within the budget), and the plan
trains a small model within its budget of the float32 loss."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn

import amp_backends
from amp_backends import PrecisionPlan, plan_precision, precision_policy
from amp_backends.precision.formats import COST_ORDER, RECIPE_OF
from amp_backends.precision.fp8 import engine as fp8_engine
from amp_backends.precision.planner import layer_error

from fp8_marks import NO_FP8, needs_mx, needs_torchao


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp_backends.PerformanceWarning)
        yield


@pytest.fixture
def one_thread():
    """Small matmuls on a shared CPU: one thread is fastest and steadiest."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 8))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """A teacher network's classes of Gaussian inputs: a task the model learns in a few hundred steps."""
    g = torch.Generator().manual_seed(1)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    x = torch.randn(2048, 32, generator=g)
    with torch.no_grad():
        return x, teacher(x).argmax(-1)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float(), y)


def test_choices_are_the_cheapest_usable_format_within_the_budget():
    """Runs everywhere (without torchao the 8-bit formats are measured, not chosen): every layer's
    format is the first of COST_ORDER it may use whose error is within the budget, float32 has error 0,
    and the model is left as it was (parameters, gradients, buffers)."""
    model = _model()
    x, y = _data()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plan = plan_precision(model, x[:64], lambda out: _loss(out, y[:64]), budget=0.05, emulate=True, backend="cpu")
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert list(plan.layers) == ["0", "2", "4", "6"]
    for name, layer in plan.layers.items():
        assert layer.errors["fp32"] == 0
        usable = [f for f in COST_ORDER if f in layer.errors and f not in layer.unavailable]
        assert layer.format == next(f for f in usable if layer.errors[f] <= 0.05), name
        assert layer.format in layer.reason or "cheapest" in layer.reason
    for name in ("0", "6"):  # the recipe's rules: first and last layers
        assert plan.layers[name].format not in RECIPE_OF
        assert "out of 8 bits" in plan.layers[name].unavailable["fp8_tensorwise"]
    assert "second autocast dtype" in plan.layers["2"].unavailable["fp16"]
    if NO_FP8 is None:
        assert {plan.layers[n].format for n in ("2", "4")} <= set(RECIPE_OF)  # 8 bits where it is within budget
    else:
        assert "torchao" in plan.layers["2"].unavailable["fp8_tensorwise"]
    tight = plan_precision(model, x[:64], lambda out: _loss(out, y[:64]), budget=1e-4, emulate=True, backend="cpu",
                           verify=False)
    assert {layer.format for layer in tight.layers.values()} == {"fp32"}
    assert "over 0.0001" in tight.layers["2"].reason


def test_flop_shares_are_the_layers_matmuls_over_the_steps():
    """2*M*K*N per matmul: forward, weight gradient, and input gradient where the input needs one
    (not for the first layer): shares of the step's total, which a Linear-only model exhausts."""
    model = _model()
    x, y = _data()
    plan = plan_precision(model, x[:64], lambda out: _loss(out, y[:64]), verify=False, backend="cpu")
    m = 64
    flops = {"0": 2 * 2 * m * 32 * 64, "2": 3 * 2 * m * 64 * 64, "4": 3 * 2 * m * 64 * 64, "6": 3 * 2 * m * 64 * 8}
    total = sum(flops.values())
    for name, layer in plan.layers.items():
        assert layer.flop_share == pytest.approx(flops[name] / total, rel=1e-12), name
        assert layer.shape == tuple(model.get_submodule(name).weight.shape) and layer.tokens == m


@needs_torchao
@pytest.mark.parametrize("fmt", [pytest.param("mxfp8", marks=needs_mx), "fp8_tensorwise", "fp8_rowwise"])
def test_measured_forward_error_equals_torchaos_layer_run_directly(fmt):
    """The plan's forward error of an 8-bit format is the relative error of torchao's own emulated layer's
    output (MXFP8Linear; Float8Linear), rounded to bf16 as autocast returns it: the same number."""
    with fp8_engine._quiet_import():
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=False)
    x = torch.randn(32, 64)
    x[3, 5] = 40.0  # an outlier: the formats' scales differ
    if fmt == "mxfp8":  # the MX layer's modules only where needs_mx found them (torchao 0.18+)
        with fp8_engine._quiet_import():
            from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
            from torchao.quantization.quantize_.common import KernelPreference
        ref = MXFP8Linear(64, 96, bias=False, kernel_preference=KernelPreference.EMULATED)
        ref.load_state_dict(lin.state_dict())
    else:
        config = Float8LinearConfig.from_recipe_name(RECIPE_OF[fmt])
        import dataclasses

        ref = Float8Linear.from_float(nn.Linear(64, 96, bias=False), config=dataclasses.replace(config, emulate=True))
        ref.load_state_dict(lin.state_dict())
    with torch.no_grad():
        out = ref(x).to(torch.bfloat16).double()
        exact = (x @ lin.weight.t()).double()
    direct = float((out - exact).norm() / exact.norm())
    assert layer_error(x, lin.weight.detach(), None, fmt, torch.bfloat16) == direct


def test_plan_round_trips_through_json_and_an_edit_applies(tmp_path):
    model = _model()
    x, y = _data()
    plan = plan_precision(model, x[:64], lambda out: _loss(out, y[:64]), verify=False, backend="cpu")
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["layers"]["2"]["errors"].keys() == plan.layers["2"].errors.keys()
    assert PrecisionPlan.load(path).to_dict() == plan.to_dict()
    data["layers"]["2"]["format"] = "fp32"
    data["layers"]["4"]["format"] = "bf16"
    path.write_text(json.dumps(data))
    policy = precision_policy(model, fp32=[], plan=str(path))
    assert set(policy.selected) == {"2"} and policy.fp8 == {}
    with torch.autocast("cpu", torch.bfloat16):
        h = model[1](model[0](x[:4]))
        assert model[2](h).dtype == torch.float32 and model[4](model[3](model[2](h))).dtype == torch.bfloat16
    policy.remove()


@needs_mx
def test_applied_plan_converts_each_layer_to_its_format_and_remove_undoes_it():
    model = _model()
    x, y = _data()
    plan = plan_precision(model, x[:64], lambda out: _loss(out, y[:64]), emulate=True, backend="cpu")
    plan.layers["2"].format, plan.layers["4"].format, plan.layers["6"].format = "mxfp8", "fp8_rowwise", "fp32"
    originals = [model[i] for i in (0, 2, 4, 6)]
    policy = precision_policy(model, fp32=[], plan=plan, emulate=True, backend="cpu")
    assert policy.fp8_recipes == {"2": "mxfp8", "4": "rowwise"} and set(policy.selected) == {"6"}
    assert type(model[2]).__name__ == "MxLinear" and getattr(model[4], "fp8_recipe", None) == "rowwise"
    assert type(model[4]).__name__ != "MxLinear" and fp8_engine.is_fp8(model[4]) and type(model[6]) is nn.Linear
    policy.remove()
    assert [model[i] for i in (0, 2, 4, 6)] == originals


def test_bad_plans_are_refused_and_nothing_changes(tmp_path):
    model = _model()
    x, y = _data()
    plan = plan_precision(model, x[:64], lambda out: _loss(out, y[:64]), verify=False, backend="cpu")
    before = list(model.children())

    def refused(p: object, match: str, **kw: object) -> None:
        with pytest.raises((ValueError, TypeError, amp_backends.AmpBackendsError), match=match):
            precision_policy(model, fp32=[], plan=p, **kw)
        assert list(model.children()) == before and not any("forward" in m.__dict__ for m in model.modules())

    other = PrecisionPlan.from_dict(plan.to_dict())
    other.layers["9"] = other.layers.pop("6")
    refused(other, "no layer '9'")
    wrong = PrecisionPlan.from_dict(plan.to_dict())
    wrong.layers["2"].shape = (32, 64)
    refused(wrong, "another model")
    half = PrecisionPlan.from_dict(plan.to_dict())
    half.layers["2"].format = "fp16"
    refused(half, "autocast runs one 16-bit dtype")
    refused(plan, "not both", fp8=[nn.Linear])
    refused(42, "PrecisionPlan or the path")
    eight = PrecisionPlan.from_dict(plan.to_dict())
    eight.layers["6"].format = "fp8_tensorwise"  # 8 outputs: not a multiple of 16
    if NO_FP8 is None:
        refused(eight, "'6' cannot train in tensorwise.*edit the plan", emulate=True, backend="cpu")
    refused(eight, "fp8", backend="cpu")  # not emulated on a CPU: no fp8 matmul
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 99}))
    refused(str(bad), "version 1")
    with pytest.raises(ValueError, match="unknown format 'fp4'"):
        PrecisionPlan.from_dict({**plan.to_dict(), "layers": {"2": {"format": "fp4"}}})
    with pytest.raises(ValueError, match="budget"):
        plan_precision(model, x[:64], budget=0)


@needs_mx
def test_the_plan_trains_within_its_budget_of_the_fp32_loss(one_thread):
    """300 steps of Adam, the plan (MXFP8 in the middle layers, bf16 at the ends, emulated) under bf16
    autocast against float32 from the same start: the 20-step running mean of the loss stays within the
    budget (relative to the starting loss) of float32's at every step, and both learn the task."""
    x, y = _data()
    budget = 0.05

    def train(model: nn.Module, amp: bool) -> list[float]:
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        losses = []
        for step in range(300):
            i = (torch.arange(64) + 64 * step) % len(x)
            with torch.autocast("cpu", torch.bfloat16, enabled=amp):
                loss = _loss(model(x[i]), y[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses).tolist()

    reference = train(_model(), False)
    model = _model()
    plan = plan_precision(model, x[:64], lambda out: _loss(out, y[:64]), budget=budget, emulate=True, backend="cpu")
    assert plan.by_format().get("mxfp8") == ["2", "4"]
    assert plan.end_to_end["grad_rel_error"] <= budget
    precision_policy(model, fp32=[], plan=plan, emulate=True, backend="cpu")
    planned = train(model, True)

    def running(losses: list[float], w: int = 20) -> list[float]:
        return [sum(losses[max(0, i - w + 1):i + 1]) / len(losses[max(0, i - w + 1):i + 1]) for i in range(len(losses))]

    gap = max(abs(a - b) for a, b in zip(running(reference), running(planned))) / reference[0]
    assert gap <= budget, gap
    assert running(planned)[-1] < 0.1 * reference[0] and math.isfinite(planned[-1])


def test_cli_check_plan_prints_reasons_and_json(tmp_path, capsys):
    from amp_backends.cli import main

    saved = tmp_path / "plan.json"
    argv = ["check", "--plan", "bench:mlp", "--backend", "cpu", "--budget", "0.01"]
    assert main([*argv, "--json", "--save", str(saved)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["budget"] == 0.01 and set(data["layers"]) == {"0", "2", "4"}
    for layer in data["layers"].values():
        assert {"fp32", "bf16", "fp16", "fp8_tensorwise", "fp8_rowwise"} <= set(layer["errors"])
        assert "mxfp8" in layer["errors"] or "blocks of 32" in layer["unavailable"]["mxfp8"]
        assert layer["format"] in ("bf16", "fp32") and layer["reason"]
        assert "fp8_tensorwise" in layer["unavailable"]  # the CPU runs no 8-bit matmul, and no --emulate
    assert json.loads(saved.read_text()) == data
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("precision plan: budget 0.01") and "the first Linear layer the model runs" in text
    assert main([*argv[:-1], "0"]) == 2
    err = capsys.readouterr().err
    assert "budget" in err and "Traceback" not in err
    assert main(["check", "bench:mlp", "--backend", "cpu", "--save", str(saved)]) == 2
    assert "go with --plan" in capsys.readouterr().err


@needs_torchao
def test_on_hardware_the_plan_keeps_layers_below_torchaos_break_even_out_of_fp8():
    """Planned for a device that runs fp8 (the CPU backend declaring fp8 matmuls, as an H100's does) and
    not emulated: a 64-wide layer is below torchao's break-even for tensorwise and rowwise, so it is not
    planned in them (MXFP8 has no published break-even table, and this device declares no MX)."""
    from amp_backends_plugins.cpu import CPUBackend

    class Fp8Cpu(CPUBackend):
        name = "cpu-fp8"

        def fp8_dtypes(self) -> tuple[torch.dtype, ...]:
            return (torch.float8_e4m3fn, torch.float8_e5m2)

    model = _model()
    x, y = _data()
    plan = plan_precision(model, x[:64], lambda out: _loss(out, y[:64]), budget=0.1, backend=Fp8Cpu(), verify=False)
    layer = plan.layers["2"]
    assert "break-even for tensorwise" in layer.unavailable["fp8_tensorwise"]
    assert "break-even for rowwise" in layer.unavailable["fp8_rowwise"]
    assert "MXFP8" in layer.unavailable["mxfp8"] and layer.format == "bf16"
