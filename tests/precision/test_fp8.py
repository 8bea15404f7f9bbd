"""fp8 training through a precision policy (``fp8=``), torchao's float8 training as the engine, on the
CPU by emulation (``emulate=True``: fp8's casts and scales, high-precision matmuls).

The oracle is torchao's own layer run by hand on the same inputs: the policy's layers give its
outputs and gradients bitwise. Where torchao cannot be used (the oldest torch leg), the refusal is
what is tested."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import amp_backends
from amp_backends import RECIPE, PrecisionPolicy, checkpoint, precision_policy
from amp_backends.precision.fp8 import engine as fp8_engine
from amp_backends.precision.fp8.engine import RECIPES, Fp8UnavailableError

from fp8_marks import NO_FP8, needs_torchao


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp_backends.PerformanceWarning)
        yield


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 48),
                         nn.LayerNorm(48), nn.Linear(48, 10))


def test_without_a_usable_torchao_fp8_is_refused_saying_what_to_install():
    """Runs everywhere: where torchao works, a missing one is simulated in a fresh interpreter."""
    from conftest import run_json

    code = """
    import json, sys, torch, amp_backends
    sys.modules["torchao"] = None   # not installed
    try:
        amp_backends.precision_policy(torch.nn.Sequential(torch.nn.Linear(16, 16)), fp8=[torch.nn.Linear], emulate=True)
        error = None
    except amp_backends.AmpBackendsError as exc:
        error = type(exc).__name__ + ": " + str(exc)
    print(json.dumps({"error": error, "reason": amp_backends.precision.fp8.engine.unavailable_reason()}))
    """
    out = run_json(code)
    assert out["error"].startswith("Fp8UnavailableError: fp8 training needs torchao, which is not installed")
    assert "pip install 'amp-backends[fp8]'" in out["error"] and out["reason"] in out["error"]
    if NO_FP8 is not None:  # this environment (torch 2.4's leg): the same refusal in process
        with pytest.raises(Fp8UnavailableError, match="torchao"):
            precision_policy(_mlp(), fp8=[nn.Linear], emulate=True)


def test_a_device_without_fp8_is_refused_naming_the_hardware_that_has_it():
    model = _mlp()
    with pytest.raises(Fp8UnavailableError) as info:
        precision_policy(model, fp8=[nn.Linear], backend="cpu")
    message = str(info.value)
    assert "backend 'cpu'" in message and "has no fp8 matmul" in message
    assert "compute capability 8.9" in message and "MI300" in message and "emulate=True" in message
    assert not any("forward" in m.__dict__ for m in model.modules()) and type(model[0]) is nn.Linear


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"fp8": [nn.Linear], "fp8_recipe": "fastest"}, ValueError, "fp8_recipe=...) takes one of 'tensorwise'"),
    ({"fp8": [nn.Linear], "emulate": "yes"}, TypeError, "emulate must be True or False"),
    ({"emulate": True}, ValueError, "fp8_recipe, emulate and fp8_all_gather apply to the layers fp8= selects"),
    ({"fp8_all_gather": True}, ValueError, "fp8_recipe, emulate and fp8_all_gather apply to the layers fp8="),
    ({"fp8": [nn.Linear], "fp8_all_gather": "on", "emulate": True}, TypeError, "fp8_all_gather must be True or"),
    ({"fp8": [nn.Linear], "fp8_recipe": "rowwise", "fp8_all_gather": True, "emulate": True}, ValueError,
     "fp8_all_gather=True needs fp8_recipe='tensorwise'"),
    ({"fp8": ["no_such_layer"], "emulate": True}, ValueError, "precision_policy(fp8=...): 'no_such_layer' selects no"),
    ({"fp8": 42, "emulate": True}, TypeError, "precision_policy(fp8=...) takes module classes"),
])
def test_bad_fp8_arguments_are_refused_and_change_nothing(kwargs, error, words):
    model = _mlp()
    if NO_FP8 is not None and "fp8" in kwargs and error is ValueError and "selects no" in words:
        error, words = Fp8UnavailableError, "torchao"
    with pytest.raises(error) as info:
        precision_policy(model, **kwargs)
    assert words in str(info.value)
    assert all(type(m) is not nn.Module and "forward" not in m.__dict__ for m in model.modules())
    assert [type(m).__name__ for m in model] == ["Linear", "GELU", "Linear", "GELU", "Linear", "LayerNorm", "Linear"]


@needs_torchao
def test_the_layers_converted_and_those_left_with_why():
    model = _mlp()
    x = torch.randn(8, 32)
    policy = precision_policy(model, fp8=[nn.Linear, "1", "5"], emulate=True, example_inputs=x)
    assert policy.fp8 == {"0": "Linear", "2": "Linear", "4": "Linear"}
    assert policy.fp8_skipped == {
        "1": "not an nn.Linear (GELU): fp8 training converts Linear layers",
        "5": "float32 by this policy, itself or a module holding it (float32 beats fp8)",  # the recipe's norm
        "6": "float32 by this policy, itself or a module holding it (float32 beats fp8)",  # the recipe's head
    }
    assert policy.selected == {"5": "recipe: LayerNorm", "6": "recipe: the final classifier / head"}
    assert repr(policy) == "<PrecisionPolicy fp32: 5, 6; fp8 (tensorwise): 0, 2, 4>"
    odd = precision_policy(nn.Sequential(nn.Linear(30, 64)), fp32=(), fp8=[nn.Linear], emulate=True)
    assert odd.fp8 == {} and "in_features=30, out_features=64: fp8 matmuls need both to be multiples of 16" in \
        odd.fp8_skipped["0"]


@needs_torchao
def test_the_recipe_keeps_the_first_and_last_layers_and_the_small_ones():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 2048),
                          nn.ReLU(), nn.Linear(2048, 64), nn.ReLU(), nn.Linear(64, 16))
    policy = precision_policy(model, fp32=(), fp8=RECIPE, emulate=True, example_inputs=torch.randn(2, 64))
    assert policy.fp8 == {"2": "recipe: a Linear layer", "4": "recipe: a Linear layer"}
    assert policy.fp8_skipped["0"].startswith("the first Linear layer the model runs")
    assert policy.fp8_skipped["8"].startswith("the last Linear layer the model runs")
    assert policy.fp8_skipped["6"].startswith("N=64, K=2048: below torchao's measured break-even for tensorwise")


def _by_hand(module: nn.Linear, recipe: str, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """torchao's Float8Linear run by hand, as on CUDA: the input in the autocast dtype, autocast off."""
    float8 = fp8_engine.engine()
    layer = float8.float8_linear.Float8Linear.from_float(copy.deepcopy(module), config=fp8_engine.config(recipe, True))
    with torch.autocast("cpu", enabled=False):
        out = layer(x.to(torch.bfloat16))
    out.float().square().sum().backward()
    return out, [layer.weight.grad, layer.bias.grad]


@needs_torchao
@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_gives_torchaos_layer_bitwise(recipe):
    torch.manual_seed(1)
    layer = nn.Linear(32, 64)
    x = torch.randn(16, 32)
    expected, grads = _by_hand(layer, recipe, x)
    model = nn.Sequential(layer)
    precision_policy(model, fp32=(), fp8=[nn.Linear], fp8_recipe=recipe, emulate=True)
    with torch.autocast("cpu", torch.bfloat16):
        out = model(x)
    out.float().square().sum().backward()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert torch.equal(layer.weight.grad, grads[0]) and torch.equal(layer.bias.grad, grads[1])
    assert not torch.equal(out.float(), nn.functional.linear(x, layer.weight, layer.bias)), "not the plain Linear"


@needs_torchao
def test_remove_restores_the_original_layers_with_the_trained_weights_and_hooks():
    model = _mlp()
    originals = list(model)
    seen = []
    model[2].register_forward_hook(lambda m, i, o: seen.append("before"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)   # built before the conversion
    policy = precision_policy(model, fp8=[nn.Linear], emulate=True)
    model[2].register_forward_hook(lambda m, i, o: seen.append("after"))
    keys = list(model.state_dict())
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(torch.randn(8, 32)).float().square().mean()
        loss.backward()
        opt.step()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    assert seen == ["before", "after"] * 3
    policy.remove()
    assert all(a is b for a, b in zip(model, originals)), "the very modules the model had"
    assert list(model.state_dict()) == keys and all(torch.equal(trained[k], v) for k, v in model.state_dict().items())
    model(torch.randn(2, 32))
    assert seen[-2:] == ["before", "after"], "hooks registered on either module stay"
    assert repr(policy).endswith("(removed)>") and policy.fp8 == {}


@needs_torchao
def test_a_checkpoint_moves_between_fp8_and_bf16_runs(tmp_path):
    fp8_model = _mlp(1)
    precision_policy(fp8_model, fp8=[nn.Linear], emulate=True)
    plain = _mlp(2)
    assert list(fp8_model.state_dict()) == list(plain.state_dict())
    checkpoint.save(tmp_path / "a.ckpt", {"model": fp8_model.state_dict()}, kind="t")
    plain.load_state_dict(checkpoint.load(tmp_path / "a.ckpt", kind="t")["model"])
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), fp8_model.state_dict().values()))
    back = _mlp(3)
    precision_policy(back, fp8=[nn.Linear], emulate=True)
    back.load_state_dict(plain.state_dict())
    x = torch.randn(4, 32)
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(back(x), fp8_model(x))


@needs_torchao
def test_fp8_all_gather_in_one_process_trains_as_without_it_and_saves_plain_tensors(tmp_path):
    """fp8_all_gather=True wraps each fp8 weight in torchao's cast-on-all-gather tensor; outside FSDP2
    the training is bitwise that without it, the checkpoint holds plain tensors under the same keys
    (loadable with weights_only), and remove() leaves the original Linear holding the trained weight."""
    def train(all_gather: bool) -> tuple[nn.Sequential, PrecisionPolicy]:
        model = _mlp(4)
        policy = precision_policy(model, fp32=(), fp8=[nn.Linear], emulate=True, fp8_all_gather=all_gather)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)   # built after the conversion
        for step in range(3):
            opt.zero_grad()
            g = torch.Generator().manual_seed(step)
            with torch.autocast("cpu", torch.bfloat16):
                loss = model(torch.randn(8, 32, generator=g)).float().square().mean()
            loss.backward()
            opt.step()
        return model, policy

    gathered, policy = train(True)
    plain, _ = train(False)
    assert type(gathered[0].weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    assert type(plain[0].weight) is nn.Parameter
    state = gathered.state_dict()
    assert list(state) == list(plain.state_dict())
    assert all(type(v) is torch.Tensor for v in state.values()), {k: type(v) for k, v in state.items()}
    assert all(torch.equal(a, b) for a, b in zip(state.values(), plain.state_dict().values()))
    checkpoint.save(tmp_path / "g.ckpt", {"model": state}, kind="t")
    fresh = _mlp(9)
    fresh.load_state_dict(checkpoint.load(tmp_path / "g.ckpt", kind="t")["model"])
    trained = gathered[0].weight.detach().clone()
    policy.remove()
    assert type(gathered[0]) is nn.Linear and type(gathered[0].weight) is nn.Parameter
    assert torch.equal(gathered[0].weight, trained) and torch.equal(fresh[0].weight, trained)


@needs_torchao
def test_fp8_trains_close_to_bf16_on_a_small_model():
    """A regression task, AdamW, 60 steps under bf16 autocast: fp8 (emulated, tensorwise) takes the loss
    down at least 95% as far as bf16 does (measured here: 0.767 -> 0.128 against 0.766 -> 0.116; fp8's
    noise floor is higher once the loss nears zero)."""
    torch.manual_seed(0)
    x = torch.randn(256, 32)
    y = torch.sin(x @ torch.randn(32, 10))

    def train(use_fp8: bool) -> tuple[float, float]:
        model = _mlp(5)
        if use_fp8:
            precision_policy(model, fp32=(), fp8=[nn.Linear], emulate=True)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for step in range(60):
            opt.zero_grad()
            with torch.autocast("cpu", torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses[0], sum(losses[-5:]) / 5

    start8, end8 = train(True)
    start16, end16 = train(False)
    assert end8 < 0.5 * start8 and end16 < 0.5 * start16
    assert start8 - end8 >= 0.95 * (start16 - end16), (start8, end8, start16, end16)


@needs_torchao
def test_gradients_accumulate_as_the_sum_of_the_micro_batches():
    model = _mlp()
    precision_policy(model, fp32=(), fp8=[nn.Linear], emulate=True)
    batches = [torch.randn(8, 32) for _ in range(2)]
    singles = []
    for x in batches:
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            model(x).float().sum().backward()
        singles.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    for x in batches:
        with torch.autocast("cpu", torch.bfloat16):
            model(x).float().sum().backward()
    for p, a, b in zip(model.parameters(), *singles):
        assert torch.allclose(p.grad, a + b, rtol=1e-6, atol=1e-6)


@needs_torchao
def test_under_torch_compile_the_fp8_layers_give_the_eager_result():
    model = _mlp()
    precision_policy(model, fp8=[nn.Linear], emulate=True)
    twin = copy.deepcopy(model)
    assert type(twin[0]).__name__ == "Fp8Linear" and twin[0].weight is not model[0].weight
    compiled = torch.compile(twin, backend="aot_eager")
    x = torch.randn(8, 32)
    with torch.autocast("cpu", torch.bfloat16):
        eager, out = model(x), compiled(x)
    eager.float().sum().backward()
    out.float().sum().backward()
    assert torch.equal(eager, out) and out.dtype == eager.dtype == torch.float32  # the head in float32
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad), name


@needs_torchao
def test_a_whole_model_pickle_keeps_the_fp8_layers():
    model = _mlp()
    precision_policy(model, fp8=[nn.Linear], emulate=True)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(3, 32)
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(loaded(x), model(x))


@needs_torchao
def test_a_float32_policy_over_an_fp8_layer_is_refused():
    model = _mlp()
    precision_policy(model, fp32=(), fp8=[nn.Linear], emulate=True)
    with pytest.raises(ValueError, match="'2' trains in fp8 by another policy; float32 beats fp8"):
        precision_policy(model, fp32=["2"])
    assert "forward" not in model[5].__dict__


@needs_torchao
def test_a_vendor_fp8_layer_through_the_backend_hook():
    """A vendor's own fp8 layer (Backend.fp8_linear): installed, reported, removed; one that drops the
    Linear's parameters is refused with nothing changed."""
    cpu = type(amp_backends.get("cpu"))

    class VendorFp8(nn.Module):
        is_fp8 = True

        def __init__(self, linear: nn.Linear) -> None:
            super().__init__()
            self.weight, self.bias = linear.weight, linear.bias

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(x, self.weight, self.bias) * 2

    class Vendor(cpu):
        name = "cpu-fp8-vendor"

        def fp8_dtypes(self):
            return (torch.float8_e4m3fn,)

        def fp8_linear(self, linear, config):
            return VendorFp8(linear)

    class Broken(Vendor):
        name = "cpu-fp8-broken"

        def fp8_linear(self, linear, config):
            return VendorFp8(nn.Linear(linear.in_features, linear.out_features))

    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    with pytest.raises(TypeError, match="fp8_linear must return an nn.Module holding the Linear's own"):
        precision_policy(model, fp32=(), fp8=[nn.Linear], backend=Broken())
    assert [type(m) for m in model] == [nn.Linear, nn.Linear]
    policy = precision_policy(model, fp32=(), fp8=[nn.Linear], backend=Vendor())
    assert [type(m).__name__ for m in model] == ["VendorFp8", "VendorFp8"] and list(policy.fp8) == ["0", "1"]
    policy.remove()
    assert [type(m) for m in model] == [nn.Linear, nn.Linear]


@needs_torchao
@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_two_ranks_train_fp8_exactly_as_the_steps_computed_by_hand(tmp_path, wrap):
    """DDP and FSDP2 (2 CPU ranks, gloo) over the policy's fp8 layers: after 4 AdamW steps the parameters
    equal, bitwise, those of one fp8 model stepped with the ranks' gradients averaged by hand."""
    import json

    from torchrun import TESTS as HERE, torchrun

    proc = torchrun(HERE / "fp8_dist_worker.py", "--wrap", wrap, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["layers"] == ["Fp8Linear", "GELU", "Fp8Linear", "GELU", "Fp8Linear"] and r["converted"] == ["0", "2", "4"]
        assert r["grad_type"] == ("DTensor" if wrap == "fsdp2" else "Tensor")
        assert r["equal_to_reference"], r["max_diff"]
        assert r["identical_across_ranks"]


@needs_torchao
def test_fsdp2_gathers_the_fp8_weights_in_fp8_and_trains_as_by_hand(tmp_path):
    """fp8_all_gather=True under FSDP2 (2 CPU ranks): every gather of an fp8 layer's weight carries
    float8_e4m3fn (torchao's pre-all-gather hook, recorded), and after 4 steps the parameters equal,
    bitwise, the model stepped by hand without sharding."""
    import json

    from torchrun import TESTS as HERE, torchrun

    proc = torchrun(HERE / "fp8_dist_worker.py", "--wrap", "fsdp2", "--all-gather", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in (json.loads((tmp_path / f"rank{n}.json").read_text()) for n in range(2)):
        assert r["gathered_dtypes"] == ["torch.float8_e4m3fn"] and r["gathers"] >= 3 * 4, r
        assert r["equal_to_reference"], r["max_diff"]
        assert r["identical_across_ranks"]


# -- the inspector ----------------------------------------------------------------------------------
def test_the_inspector_says_per_linear_whether_fp8_can_take_it():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    report = amp_backends.check_model(model, torch.randn(4, 32), "cpu", torch.bfloat16)
    rows = {r.name: r for r in report.rows}
    assert rows["0"].fp8 == "eligible"
    assert rows["2"].fp8 == "in_features=64, out_features=10: fp8 matmuls need both to be multiples of 16"
    assert rows["1"].fp8 is None and report.fp8_flops == 0


@needs_torchao
def test_the_inspector_reports_fp8_layers_and_their_share_of_flops():
    from torch.utils.flop_counter import FlopCounterMode

    model = _mlp()
    x = torch.randn(16, 32)
    with FlopCounterMode(display=False) as counter:
        model(x)
    per_layer = {name: 2 * 16 * m.in_features * m.out_features for name, m in model.named_children()
                 if isinstance(m, nn.Linear)}
    assert sum(per_layer.values()) == counter.get_total_flops()
    precision_policy(model, fp8=[nn.Linear], emulate=True)
    report = amp_backends.check_model(model, x, "cpu", torch.bfloat16)
    rows = {r.name: r for r in report.rows}
    for name in ("0", "2", "4"):
        assert rows[name].fp8 == "fp8 (tensorwise, emulated)" and rows[name].compute == "float8 (emulated)"
        assert rows[name].flops == per_layer[name] and rows[name].fp32_reason is None
    assert rows["6"].fp8 == "float32 by a precision policy (float32 beats fp8)"
    assert report.fp8_flops == sum(per_layer[n] for n in ("0", "2", "4")) and report.low_flops == 0
    share = round(100 * report.fp8_flops / report.total_flops)
    assert report.summary.startswith(f"{share}% of matmul FLOPs in fp8 (emulated), 0% in bfloat16")
    assert [type(m).__name__ for m in model][:1] == ["Fp8Linear"], "the model keeps its fp8 layers"
    assert rows["0"].output_error > 0, "judged against a true float32 run, not fp8's"


@needs_torchao
def test_the_check_command_with_fp8(tmp_path, monkeypatch, capsys):
    import json

    from amp_backends.cli import main

    (tmp_path / "fp8_target.py").write_text(
        "import torch\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))\n"
        "    return model, torch.randn(8, 32)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check", "fp8_target:make", "--backend", "cpu", "--dtype", "bfloat16", "--fp8", "rowwise", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in data["rows"]}
    assert rows["0"]["fp8"] == "fp8 (rowwise, emulated)" and rows["2"]["fp8"].startswith("in_features=64, out_features=10")
    assert any("fp8 emulated: backend 'cpu' has no fp8 matmul" in n for n in data["notes"])
    assert data["fp8_flops"] == 2 * 8 * 32 * 64


# -- the bench --------------------------------------------------------------------------------------
@pytest.fixture
def cpu_with_fp8():
    """The CPU declared as an fp8 device: torch's CPU _scaled_mm runs torchao's fp8 layers (slowly),
    which exercises the bench's fp8 rows on a machine without an fp8 GPU."""
    cpu = type(amp_backends.get("cpu"))

    class CpuFp8(cpu):
        name = "cpu-fp8-test"
        priority = 0

        def fp8_dtypes(self):
            return (torch.float8_e4m3fn, torch.float8_e5m2)

    class Plugin:
        @amp_backends.hookimpl
        def amp_backends_register_backends(self, register):
            register(CpuFp8())

    amp_backends.register_plugin(Plugin(), name="cpu-fp8-test-plugin")
    yield "cpu-fp8-test"
    amp_backends.registry.default_registry().unregister_plugin("cpu-fp8-test-plugin")


@needs_torchao
def test_the_bench_measures_fp8_through_the_policy_and_torchao_directly(cpu_with_fp8, monkeypatch):
    from amp_backends.cli import bench, bench_fp8

    monkeypatch.setattr(bench_fp8, "SELECTION", [nn.Linear])  # the toy's layers are below the recipe's sizes
    monkeypatch.setattr(bench, "HOST_BOUND_MS", 1e9)  # every step host-bound, as on a fast CPU
    result = bench.run(cpu_with_fp8, ["mlp"], rounds=2, warmup=0)
    rows = {r["mode"]: r for r in result["rows"]}
    for mode in ("amp-fp8", "torchao-fp8", "bf16-fp8-baseline"):
        assert rows[mode]["step_ms"] > 0 and rows[mode]["rounds"] == 2 and rows[mode]["peak_mem_bytes"] > 0
        assert rows[mode]["compiled"] is False, "a CPU runs the fp8 rows eagerly"
    assert rows["amp-fp8"]["overhead_vs_torchao"] > 0 and "overhead_vs_torchao" not in rows["torchao-fp8"]
    for mode in ("amp-fp8", "torchao-fp8"):  # measured against bf16, but eager: no verdict, and it says why
        assert rows[mode]["speedup_vs_bf16"] > 0 and rows[mode]["verdict"].startswith("eager: no fp8 verdict")
    assert rows["bf16-fp8-baseline"]["verdict"] == "the fp8 rows' baseline"
    assert all(r["verdict"] == "host-bound: no verdict" for m, r in rows.items() if "fp8" not in m and r["step_ms"])
    assert "fp8" not in result["recommendation"][0] or not result["recommendation"][0]["fp8"]["compiled"]
    assert "fp8" in bench.render(result)


@needs_torchao
def test_a_model_the_fp8_recipe_leaves_whole_gets_a_row_saying_so(cpu_with_fp8):
    from amp_backends.cli import bench

    result = bench.run(cpu_with_fp8, ["mlp"], rounds=1, warmup=0)
    rows = {r["mode"]: r for r in result["rows"]}
    assert rows["amp-fp8"]["step_ms"] is None
    assert rows["amp-fp8"]["unavailable"].startswith("no Linear layer of this model passes the tensorwise recipe")


# -- the frameworks that take a model ---------------------------------------------------------------
def _fp8_net() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    precision_policy(net, fp32=(), fp8=[nn.Linear], emulate=True)
    return net


def _fp8_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)) for _ in range(4)]


def _by_hand_fp8() -> list[torch.Tensor]:
    net = _fp8_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for x, y in _fp8_batches():
        opt.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            loss = nn.functional.mse_loss(net(x).float(), y)
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


@needs_torchao
def test_lightning_trains_a_policys_fp8_layers_as_the_loop_by_hand():
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _fp8_net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    module = Module()
    loader = torch.utils.data.DataLoader(_fp8_batches(), batch_size=None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        L.Trainer(accelerator="cpu", devices=1, max_epochs=1, precision="bf16-mixed", logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module, loader)
    assert type(module.net[0]).__name__ == "Fp8Linear"
    for a, b in zip(module.net.parameters(), _by_hand_fp8()):
        assert torch.equal(a, b)


@needs_torchao
def test_accelerate_trains_a_policys_fp8_layers_as_the_loop_by_hand():
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        acc = Accelerator(cpu=True, mixed_precision="bf16")
        net = _fp8_net()
        model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05))
        for x, y in _fp8_batches():
            opt.zero_grad()
            with acc.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            acc.backward(loss)
            opt.step()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    for a, b in zip(acc.unwrap_model(model).parameters(), _by_hand_fp8()):
        assert torch.equal(a, b)
