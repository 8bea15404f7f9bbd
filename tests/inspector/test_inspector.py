"""The inspector (check_model, detect_nonfinite) against models with known answers and independent
references: torch's FlopCounterMode, direct scaled backwards, float32 runs; and the model left exactly
as it was (buffers, gradients, hooks, optimizer, RNG)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import amp_backends
from amp_backends import check_model
from amp_backends.testing import sim_packages_path

from conftest import cpu_only_env, run_json
from sim_marks import needs_sim_device

pytestmark = pytest.mark.filterwarnings("ignore::amp_backends.PerformanceWarning")
FP16 = torch.float16


class TwoHeads(nn.Module):
    """Gradients of known size: `quiet`'s output gradient is 2**-30 (float16 keeps it from scale 2**6),
    `loud`'s 2**-10 on a batch of 4 (its weight gradient overflows float16 from scale 2**24)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.quiet = nn.Linear(8, 8)
        self.loud = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quiet(x).float().sum() * 2.0**-30 + self.loud(x).float().sum() * 2.0**-10


def _scalar(out: torch.Tensor) -> torch.Tensor:
    return out


def test_the_loss_scale_range_is_measured_and_right():
    report = check_model(TwoHeads(), torch.ones(4, 8), "cpu", FP16, loss_fn=_scalar)
    assert report.safe_scales == (2.0**6, 2.0**23)
    assert report.scales[2.0**24] == (72, 0), "loud's 64 + 8 gradient values overflow at 2**24"
    assert report.scales[2.0**5][1] == 72 and report.scales[2.0**6][1] == 0, "quiet's 72 values lost below 2**6"
    assert sorted(report.scales) == [2.0**k for k in range(-24, 31)], "every power of two from 2**-24 to 2**30"
    assert report.backwards_run == 55, "one backward per scale; the one at 2**16 is the check's own"
    assert report.best_scales == [2.0**k for k in range(6, 24)]
    assert "best loss scales 2**6..2**23" in report.summary and "scaled backward passes" in report.summary
    low = check_model(TwoHeads(), torch.ones(4, 8), "cpu", FP16, loss_fn=_scalar, loss_scale=2.0**5)
    rows = {r.name: r for r in low.rows}
    assert rows["quiet"].grads_underflow == 72 and rows["loud"].grads_underflow == 0 and low.grads_underflow == 72


def test_the_lost_values_are_those_a_direct_scaled_backward_loses():
    """An independent count: one fp16 backward at the scale, element by element against float32."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    x = torch.randn(8, 16) * 1e-3
    scale = 2.0**2
    report = check_model(model, x, "cpu", FP16, loss_scale=scale)
    params = list(model.parameters())
    with torch.autocast("cpu", dtype=FP16):
        loss = model(x).float().mean()
    low = torch.autograd.grad(loss * scale, params)
    ref = torch.autograd.grad(model(x).float().mean(), params)
    expected = sum(int(((a == 0) & (b != 0)).sum()) for a, b in zip(low, ref))
    assert expected > 0 and report.grads_underflow == expected


def test_a_tied_parameter_is_counted_once():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(2)
            self.emb = nn.Embedding(16, 8)
            self.mid = nn.Linear(8, 8)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(torch.tanh(self.mid(self.emb(ids))), self.emb.weight)  # a tied head

    model = Tied()
    ids = torch.randint(0, 16, (4, 6))
    report = check_model(model, ids, "cpu", FP16, loss_scale=1.0)
    grads = torch.autograd.grad(model(ids).float().mean(), list(model.parameters()))
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    assert report.grad_norm == pytest.approx(norm, rel=2e-2), "every parameter once in the total norm"
    assert report.head == "", "the head is a tied F.linear in the model's own forward"


class Exploding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.blow = Scale(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.blow(self.proj(x)), dim=-1)


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def test_the_first_op_that_overflowed_is_named_and_no_scale_can_save_it():
    torch.manual_seed(3)
    model = Exploding()
    with torch.no_grad():
        model.proj.weight.fill_(1.0)
        model.proj.bias.zero_()
    report = check_model(model, torch.ones(2, 4), "cpu", FP16)
    bad = report.first_nonfinite_forward
    assert (bad.module, bad.op, bad.dtype, bad.shape, bad.count, bad.backward) == ("blow", "mul", "float16", (2, 4), 8,
                                                                                  False)
    assert report.beyond_scaling and report.safe_scales is None
    assert "no loss scale can save this model" in report.summary and "mul in blow" in report.summary
    assert report.to_dict()["first_nonfinite_forward"]["module"] == "blow"


def test_the_first_op_that_overflowed_in_the_backward_is_named():
    model = TwoHeads()
    report = check_model(model, torch.ones(4, 8), "cpu", FP16, loss_fn=_scalar, loss_scale=2.0**26)
    bad = report.first_nonfinite_backward
    # loud's output gradient, 2**-10 * 2**26 = 65536, overflows where it is cast to float16: in the
    # backward of the model's own `.float()`, before loud's matmuls run
    assert (bad.module, bad.op, bad.dtype, bad.shape, bad.count, bad.backward) == ("", "_to_copy", "float16", (4, 8),
                                                                                  32, True)
    assert report.first_nonfinite_forward is None and report.grads_nonfinite == 72


def test_detect_nonfinite_in_a_training_step():
    model = Exploding()
    with torch.no_grad():
        model.proj.weight.fill_(1.0)
    scaler = amp_backends.GradScaler("cpu", init_scale=4.0)
    with amp_backends.detect_nonfinite(model) as found:
        with torch.autocast("cpu", dtype=FP16):
            loss = model(torch.ones(2, 4)).float().sum()
        scaler.scale(loss).backward()
    assert found.forward.module == "blow" and found.forward.op == "mul" and "forward: mul in blow" in str(found)
    with amp_backends.detect_nonfinite(nn.Linear(2, 2)) as clean:
        nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()
    assert clean.forward is None and clean.backward is None and str(clean) == "no inf/NaN in the step"


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.lin = nn.Linear(16, 24)
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)

    def forward(self, x: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y = self.up(self.grouped(self.conv(img)))
        return h.float().mean() + y.float().mean() + torch.bmm(h.unsqueeze(0), h.t().unsqueeze(0)).float().mean()


def test_flops_are_torchs_flop_counter_forward_and_backward():
    """FlopCounterMode's own count of the same forward and backward (ConvTranspose included, which the
    previous inspector overcounted by a third)."""
    model = Mixed()
    args = (torch.randn(6, 16), torch.randn(2, 4, 8, 8))
    report = check_model(model, args, "cpu", torch.bfloat16)
    with FlopCounterMode(display=False) as counter:
        model(*args).backward()
    total = counter.get_total_flops()
    assert report.total_flops + report.backward_flops == total
    per_module = counter.get_flop_counts()
    rows = {r.name: r for r in report.rows}
    for name in ("lin", "conv", "grouped", "up"):
        forward = sum(v for op, v in per_module[f"Mixed.{name}"].items())
        assert rows[name].flops <= forward, name
    with FlopCounterMode(display=False) as forward_only, torch.no_grad():
        model(*args)
    forward = forward_only.get_flop_counts()
    for name in ("lin", "conv", "grouped", "up"):
        assert rows[name].flops == sum(forward[f"Mixed.{name}"].values()), name
    # the backward per module, by hand: lin's input needs no gradient, so only its weight gradient runs
    # (2*24*16*6); FlopCounterMode's module tracker puts that matmul under `conv`, the last module it saw
    assert rows["lin"].backward_flops == 2 * 24 * 16 * 6
    assert rows["up"].compute == "bfloat16" and rows["up"].backward_compute == "bfloat16", "dgrad/wgrad dtype"


def test_attention_and_the_ops_torchs_counter_skips_are_counted():
    """SDPA on CPU runs a kernel FlopCounterMode has no formula for: counted as the math decomposition
    (bmm) counts it; mv and dot by the stated formulas."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    class Attention(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return nn.functional.scaled_dot_product_attention(q, k, v)

    class Vec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(12, 10))

        def forward(self, v: torch.Tensor) -> torch.Tensor:
            return torch.mv(self.w, v).dot(torch.ones(12))

    q = k = v = torch.randn(2, 4, 16, 8)
    report = check_model(Attention(), (q, k, v), "cpu", torch.bfloat16, loss_fn=lambda out: out.float().sum())
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        Attention()(q, k, v)
    assert report.total_flops == counter.get_total_flops() == 2 * 2 * 2 * 4 * 16 * 16 * 8
    vec = check_model(Vec(), torch.randn(10), "cpu", torch.bfloat16, loss_fn=lambda out: out.float())
    assert vec.total_flops == 2 * 12 * 10 + 2 * 12


def test_grouped_convolutions_are_judged_per_group():
    class Convs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.eight = nn.Conv2d(16, 16, 3, groups=2)   # 8 channels per group: aligned
            self.four = nn.Conv2d(16, 16, 3, groups=4)    # 4 per group: not

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.four(self.eight(x))

    report = check_model(Convs(), torch.randn(8, 16, 12, 12), "cpu", FP16, loss_scale=1.0)
    rows = {r.name: r for r in report.rows}
    assert not rows["eight"].misaligned and rows["four"].misaligned == ["conv 16->16 k3x3 g4"]


def test_float32_reasons_and_the_comparison_with_float32():
    torch.manual_seed(5)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    policy = amp_backends.precision_policy(model, fp32=["1"])
    try:
        report = check_model(model, torch.randn(8, 16), "cpu", FP16, loss_scale=2.0**8)
    finally:
        policy.remove()
    rows = {r.name: r for r in report.rows}
    assert rows["0"].fp32_reason == "float32 input", "a LayerNorm fed float32 is no autocast decision"
    assert rows["1"].fp32_reason == "precision policy" and rows["1"].compute == "float32"
    assert rows["2"].fp32_reason == "float32 input", "after a float32 layer the input is float32"
    assert rows["3"].compute == "float16" and rows["3"].fp32_reason is None
    assert rows["0"].output_error == 0.0, "the first layer sees the same inputs in both runs: exact"
    assert rows["3"].output_error > 0 and rows["3"].grad_error is not None


def test_the_model_is_left_exactly_as_it_was():
    """BatchNorm's running statistics and counter, dropout's RNG, an optimizer stepping in a
    post-accumulate-grad hook, a logging backward hook, a tensor hook, existing gradients, an input that
    requires grad, the training mode: none changed or observed."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepped, logged, hooked = [], [], []

    def step_in_backward(p: torch.Tensor) -> None:  # PyTorch's optimizer-in-backward pattern
        stepped.append(1)
        opt.step()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_in_backward)
    model[3].register_full_backward_hook(lambda m, gi, go: logged.append(1))
    model[0].weight.register_hook(lambda g: hooked.append(1))
    model[3].bias.grad = torch.full((2,), 7.0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(16, 8, requires_grad=True)
    rng = torch.get_rng_state()
    report = check_model(model, x, "cpu", FP16, loss_scale=2.0**10)
    assert report.backwards_run >= 1
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items()), "weights and buffers as before"
    assert torch.equal(torch.get_rng_state(), rng), "the global RNG as before"
    assert stepped == [] and logged == [] and hooked == [], "no user hook or optimizer saw the check's backward"
    assert torch.equal(model[3].bias.grad, torch.full((2,), 7.0)) and model[0].weight.grad is None
    assert x.grad is None and model.training
    loss = model(x).sum()
    loss.backward()
    assert stepped and logged and hooked, "the user's hooks are still in place"


def test_bad_input_is_refused_clearly_and_changes_nothing():
    model = nn.Linear(4, 2)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        check_model("not a model", torch.ones(1))
    with pytest.raises(TypeError, match="loss_scale must be a positive number.*got str 'abc'"):
        check_model(model, torch.ones(1, 4), "cpu", FP16, loss_scale="abc")
    with pytest.raises(TypeError, match="got bool True"):
        check_model(model, torch.ones(1, 4), "cpu", FP16, loss_scale=True)
    with pytest.raises(ValueError, match="positive finite"):
        check_model(model, torch.ones(1, 4), "cpu", loss_scale=-1.0)
    with pytest.raises(amp_backends.UnsupportedDtypeError):
        check_model(model, torch.ones(1, 4), "cpu", dtype=torch.float64)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        check_model(model, torch.ones(1, 4), "cpu", loss_fn="mean")
    with pytest.raises(ValueError, match="scalar tensor, got one of shape \\(1, 2\\)"):
        check_model(model, torch.ones(1, 4), "cpu", loss_fn=lambda out: out)
    with pytest.raises(ValueError, match="scalar tensor, got float"):
        check_model(model, torch.ones(1, 4), "cpu", loss_fn=lambda out: 1.0)
    with pytest.raises(ValueError, match="inputs hold 1 inf/NaN"):
        check_model(model, torch.tensor([[1.0, float("nan"), 0.0, 1.0]]), "cpu", FP16)
    assert model.weight.grad is None


def test_what_runs_without_gradients_or_matmuls_is_said_plainly():
    frozen = nn.Linear(4, 4).requires_grad_(False)
    report = check_model(frozen, torch.ones(2, 4), "cpu", FP16)
    assert "forward only" in report.summary and report.backwards_run == 0
    with torch.no_grad():  # called under no_grad: the check still takes its gradients
        assert check_model(nn.Linear(4, 4), torch.ones(2, 4), "cpu", FP16).backwards_run >= 1
    bare = check_model(nn.ReLU(), torch.ones(2, 4, requires_grad=True), "cpu", FP16,
                       loss_fn=lambda out: (out * nn.Parameter(torch.ones(()))).sum())
    assert bare.summary.startswith("no matmul or convolution ran")


def test_keyword_inputs_and_sparse_gradients():
    class Keyed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8, sparse=True)
            self.lin = nn.Linear(8, 3)

        def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.lin(self.emb(ids)) * scale

    report = check_model(Keyed(), {"ids": torch.tensor([[1, 2, 2]]), "scale": torch.ones(())}, "cpu", FP16)
    rows = {r.name: r for r in report.rows}
    assert rows["emb"].grad_norm is not None and rows["lin"].compute == "float16"


def test_the_recipe_finds_the_head_by_running_the_model():
    class ClassifierFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.classifier = nn.Linear(8, 3)   # registered first, called last
            self.body = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.classifier(self.body(x))

    model = ClassifierFirst()
    guessed = amp_backends.precision_policy(model)
    assert "body.0" in guessed.selected and "classifier" not in guessed.selected, "without inputs: a guess"
    guessed.remove()
    found = amp_backends.precision_policy(model, example_inputs=torch.ones(2, 4))
    assert set(found.selected) == {"classifier", "body.1"} and "last matmul" in found.head_found_by
    found.remove()

    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.hidden = nn.Linear(8, 8)
            self.norm = nn.LayerNorm(8)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(self.norm(self.hidden(self.emb(ids))), self.emb.weight)

    with pytest.warns(RuntimeWarning, match="head is not selected: the last matmul ran in '\\(model\\)'"):
        model = TiedLM()  # kept: a policy holds its model weakly
        tied = amp_backends.precision_policy(model, example_inputs=torch.zeros(1, 3, dtype=torch.long))
    assert set(tied.selected) == {"norm"}, "no hidden layer taken for the head"


# -- amp-backends check: what a target can do wrong is one line and status 2 -----------------------
TARGETS = '''
import sys, torch
from torch import nn

def make():
    print("building the model")  # a chatty factory: its words must not reach --json's stdout
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8)), torch.randn(2, 4)

def keyed():
    class Keyed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)
        def forward(self, x, scale):
            return self.lin(x) * scale
    return Keyed(), {"x": torch.randn(2, 4), "scale": torch.ones(())}

def exits():
    sys.exit(0)

def bad_loss():
    return nn.Linear(4, 2), torch.randn(2, 4), "mean"

def not_a_model():
    return "model", torch.randn(2, 4)
'''


@pytest.fixture
def check_targets(tmp_path, monkeypatch):
    (tmp_path / "targets_mod.py").write_text(TARGETS)
    (tmp_path / "script_mod.py").write_text("import sys\nprint('training...')\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("AMP_BACKEND", raising=False)


def _check_cli(capsys, *argv: str) -> tuple[int, str, str]:
    from amp_backends.cli import main

    code = main(["check", *argv, "--backend", "cpu", "--dtype", "bfloat16"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_check_command_keeps_json_clean_and_takes_keyword_inputs(check_targets, capsys):
    code, out, err = _check_cli(capsys, "targets_mod:make", "--json")
    assert code == 0 and "building the model" in err
    assert json.loads(out)["dtype"] == "bfloat16", "stdout is the JSON alone"
    code, out, err = _check_cli(capsys, "targets_mod:keyed", "--json")
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)["rows"]}
    assert rows["lin"]["compute"] == "bfloat16", "the keyword inputs reached forward(x, scale)"


@pytest.mark.parametrize(("target", "words"), [
    ("script_mod:make", "importing 'script_mod' exited the process (sys.exit(0))"),
    ("targets_mod:exits", "targets_mod:exits exited the process (sys.exit(0))"),
    ("targets_mod:bad_loss", "loss_fn must be callable"),
    ("targets_mod:not_a_model", "must return (model, example_inputs)"),
    ("targets_mod:nothing", "has no callable 'nothing'"),
])
def test_a_target_that_cannot_be_checked_is_one_line_and_status_2(check_targets, capsys, target, words):
    code, out, err = _check_cli(capsys, target)
    assert code == 2 and out == "", "nothing on stdout: a CI step reading it gets no report"
    last = err.strip().splitlines()[-1]
    assert last.startswith("amp-backends check: error:") and words in last and "Traceback" not in err, err


@needs_sim_device
def test_a_model_left_on_another_device_than_the_backends_is_refused():
    """On a simulated mlu: a model and inputs still on the CPU would run without the mlu's autocast (every
    layer in float32); the check refuses, naming the device and the way out, and checks once moved."""
    code = """
    import json, torch, amp_backends
    from amp_backends import check_model
    be = amp_backends.get("mlu")
    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    try:
        check_model(model, x, be)
        refusal = None
    except amp_backends.AmpBackendsError as exc:
        refusal = str(exc)
    report = check_model(model.to(be.device()), x.to(be.device()), be)
    print(json.dumps({"refusal": refusal, "summary": report.summary, "grad": model.weight.grad is None}))
    """
    out = run_json(code, [sim_packages_path("mlu")], cpu_only_env())
    assert out["refusal"] and "'cpu'" in out["refusal"] and ".to(amp_backends.get('mlu').device())" in out["refusal"]
    assert "100% of matmul FLOPs in float16" in out["summary"] and out["grad"]
