"""MXFP8 training through a precision policy (``fp8_recipe="mxfp8"``), torchao's MX layer as the
engine, on the CPU by emulation (``emulate=True``: torchao's MX casts, high-precision matmuls).

The oracle is torchao used directly on the same inputs: its ``MXFP8Linear`` and ``quantize_`` with
``MXFP8TrainingOpConfig`` (whose weight wrapper drops ``F.linear``'s bias in torchao 0.18, so it is
compared on bias-free layers, and with the bias added by hand). Where torchao cannot be used (the
oldest torch leg), the refusal is what is tested."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import amp_backends
from amp_backends import RECIPE, precision_policy
from amp_backends.precision.fp8 import engine as fp8_engine
from amp_backends.precision.fp8.engine import Fp8UnavailableError

from fp8_marks import NO_MX, needs_mx


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp_backends.PerformanceWarning)
        yield


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: dtype, shape and every bit (NaN payloads and signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def _mlp(seed: int = 0, bias: bool = True) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64, bias=bias), nn.GELU(), nn.Linear(64, 128, bias=bias), nn.GELU(),
                         nn.Linear(128, 64, bias=bias), nn.GELU(), nn.Linear(64, 10, bias=bias))


def _torchao_quantized(model: nn.Module) -> nn.Module:
    with fp8_engine._quiet_import():
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization import quantize_
    quantize_(model, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL),
              filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and m.out_features % 32 == 0)
    return model


def _step(model: nn.Module, x: torch.Tensor, gy: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = model(x)
    y.backward(gy.to(y.dtype))
    return y.detach(), x.grad


@needs_mx
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_policy_layers_equal_torchao_quantize_bitwise(autocast):
    """Bias-free layers: the policy's MX layers against torchao's quantize_ on a copy, outputs and every
    gradient bitwise. Under autocast the policy's layer takes the bf16 input (what a Linear's matmul
    takes) and returns bf16; torchao's wrapper, which runs before autocast, is given that input."""
    ours, ref = _mlp(bias=False), _mlp(bias=False)
    policy = precision_policy(ours, fp32=[], fp8=[nn.Linear], fp8_recipe="mxfp8", emulate=True, backend="cpu")
    assert set(policy.fp8) == {"0", "2", "4"} and "6" in policy.fp8_skipped  # 10 outputs: not a multiple of 32
    _torchao_quantized(ref)
    torch.manual_seed(1)
    x, gy = torch.randn(64, 64), torch.randn(64, 10)
    y, gx = _step(ours, x, gy, autocast)
    if autocast:  # the reference, by hand: bf16-rounded activations between layers, as autocast makes them
        xr = x.clone().requires_grad_(True)
        h = xr.bfloat16()
        with torch.autocast("cpu", torch.bfloat16):
            for i, layer in enumerate(ref):
                h = layer(h.float()).bfloat16() if i in (0, 2, 4) else layer(h)
        h.backward(gy.bfloat16())
        y_ref, gx_ref = h.detach(), xr.grad
    else:
        y_ref, gx_ref = _step(ref, x, gy, False)
    assert y.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert _bits(y, y_ref) and _bits(gx, gx_ref)
    for name, p in ours.named_parameters():
        assert _bits(p.grad, dict(ref.named_parameters())[name].grad), name


@needs_mx
def test_bias_equals_torchao_mx_layer_and_quantize_plus_bias():
    """With a bias: torchao's own MXFP8Linear holding copies of the parameters gives the same output and
    gradients; quantize_'s wrapper drops the bias (pytorch/ao#4846), so it matches with the bias added."""
    with fp8_engine._quiet_import():
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
        from torchao.quantization.quantize_.common import KernelPreference
    torch.manual_seed(0)
    lin = nn.Linear(64, 96)
    ref = MXFP8Linear(64, 96, kernel_preference=KernelPreference.EMULATED)
    ref.load_state_dict(lin.state_dict())
    model = nn.Sequential(lin)
    precision_policy(model, fp32=[], fp8=[nn.Linear], fp8_recipe="mxfp8", emulate=True, backend="cpu")
    x, gy = torch.randn(32, 64), torch.randn(32, 96)
    y, gx = _step(model, x, gy, False)
    y_ref, gx_ref = _step(ref, x, gy, False)
    assert _bits(y, y_ref) and _bits(gx, gx_ref)
    assert _bits(lin.weight.grad, ref.weight.grad) and _bits(lin.bias.grad, ref.bias.grad)
    wrapped = _torchao_quantized(nn.Linear(64, 96))
    wrapped.load_state_dict(ref.state_dict())
    with torch.no_grad():
        assert _bits(y, wrapped(x) + ref.bias.detach())


@needs_mx
def test_weight_gradient_in_high_precision_matches_torchao():
    """``mxfp8_with_gw_hp``: torchao's ``wgrad_with_hp``; the tokens need not be a multiple of 32."""
    with fp8_engine._quiet_import():
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
        from torchao.quantization.quantize_.common import KernelPreference
    torch.manual_seed(0)
    lin = nn.Linear(32, 64)
    ref = MXFP8Linear(32, 64, kernel_preference=KernelPreference.EMULATED, wgrad_with_hp=True)
    ref.load_state_dict(lin.state_dict())
    model = nn.Sequential(lin)
    policy = precision_policy(model, fp32=[], fp8=[nn.Linear], fp8_recipe="mxfp8_with_gw_hp", emulate=True,
                              backend="cpu")
    assert policy.fp8_recipe == "mxfp8_with_gw_hp"
    x, gy = torch.randn(8, 32), torch.randn(8, 64)
    y, gx = _step(model, x, gy, False)
    y_ref, gx_ref = _step(ref, x, gy, False)
    assert _bits(y, y_ref) and _bits(gx, gx_ref) and _bits(lin.weight.grad, ref.weight.grad)
    assert _bits(lin.weight.grad, gy.t() @ x)  # the weight gradient unquantized


@needs_mx
def test_recipe_skips_and_shape_rules():
    """The recipe's skips as fp8's (first and last Linear, the head), and MX's own shape rules, with reasons."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 64), nn.GELU(),
                          nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))
    policy = precision_policy(model, fp32=[], fp8=RECIPE, fp8_recipe="mxfp8", emulate=True, backend="cpu",
                              example_inputs=torch.randn(32, 64))
    assert set(policy.fp8) == {"6"}
    skipped = policy.fp8_skipped
    assert "first" in skipped["0"] and ("last" in skipped["8"] or "head" in skipped["8"])
    assert "multiples of 32" in skipped["2"] and "multiples of 32" in skipped["4"]
    assert type(model[6]).__name__ == "MxLinear" and type(model[2]) is nn.Linear
    half = nn.Sequential(nn.Linear(64, 64).half())
    policy = precision_policy(half, fp32=[], fp8=[nn.Linear], fp8_recipe="mxfp8", emulate=True, backend="cpu")
    assert policy.fp8 == {} and "float16" in policy.fp8_skipped["0"] and "bfloat16" in policy.fp8_skipped["0"]


@needs_mx
def test_remove_restores_the_linear_with_its_trained_parameters():
    model = _mlp()
    originals = [model[i] for i in (0, 2, 4, 6)]
    params = {name: p for name, p in model.named_parameters()}
    before = {name: p.detach().clone() for name, p in params.items()}
    policy = precision_policy(model, fp32=[], fp8=[nn.Linear], fp8_recipe="mxfp8", emulate=True, backend="cpu")
    assert {name: p for name, p in model.named_parameters()} == params  # the same parameter objects
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(2)
    for _ in range(3):
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(torch.randn(32, 64)).float().square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    policy.remove()
    assert [model[i] for i in (0, 2, 4, 6)] == originals and all(type(m) is nn.Linear for m in originals)
    assert {name: p for name, p in model.named_parameters()} == params
    assert all(not torch.equal(before[n], params[n]) for n in ("0.weight", "2.weight", "4.weight", "2.bias"))
    assert policy.fp8 == {}


@needs_mx
def test_tokens_not_a_multiple_of_32_are_refused_with_the_way_out():
    model = nn.Sequential(nn.Linear(32, 32))
    precision_policy(model, fp32=[], fp8=[nn.Linear], fp8_recipe="mxfp8", emulate=True, backend="cpu")
    with pytest.raises(ValueError, match="multiple of 32.*mxfp8_with_gw_hp"):
        model(torch.randn(5, 32))
    with torch.no_grad():  # inference: no weight gradient, any batch
        assert model(torch.randn(5, 32)).shape == (5, 32)


def test_mxfp8_on_a_device_without_mx_is_refused_naming_the_hardware():
    model = _mlp()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    be = amp_backends.get("cpu")
    assert be.mx_formats() == ()
    with pytest.raises(Fp8UnavailableError) as info:
        precision_policy(model, fp32=[], fp8=[nn.Linear], fp8_recipe="mxfp8", backend="cpu")
    message = str(info.value)
    assert "'cpu'" in message and "compute capability 10.x" in message and "emulate=True" in message
    assert all(type(model[i]) is nn.Linear for i in (0, 2, 4, 6))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_unknown_recipe_lists_the_mx_recipes():
    with pytest.raises(ValueError, match="'mxfp8', 'mxfp8_with_gw_hp'"):
        precision_policy(_mlp(), fp32=[], fp8=[nn.Linear], fp8_recipe="mxfp4", emulate=True, backend="cpu")


def test_without_torchao_mxfp8_is_refused_saying_what_to_install():
    """Runs everywhere: where torchao works, a missing one is simulated in a fresh interpreter."""
    from conftest import run_json

    code = """
    import json, sys, torch, amp_backends
    sys.modules["torchao"] = None   # not installed
    try:
        amp_backends.precision_policy(torch.nn.Sequential(torch.nn.Linear(32, 32)), fp32=[], fp8=[torch.nn.Linear],
                                      fp8_recipe="mxfp8", emulate=True, backend="cpu")
        error = None
    except amp_backends.AmpBackendsError as exc:
        error = type(exc).__name__ + ": " + str(exc)
    print(json.dumps({"error": error, "reason": amp_backends.precision.fp8.engine.mx_unavailable_reason()}))
    """
    out = run_json(code)
    assert out["error"].startswith("Fp8UnavailableError: fp8 training needs torchao, which is not installed")
    assert out["reason"] in out["error"]
    if NO_MX is not None:  # this environment (torch 2.4's leg): the same refusal in process
        with pytest.raises(Fp8UnavailableError, match="torchao"):
            precision_policy(_mlp(), fp32=[], fp8=[nn.Linear], fp8_recipe="mxfp8", emulate=True, backend="cpu")


def test_importing_the_package_imports_no_torchao():
    from conftest import run_json

    out = run_json("""
    import json, sys, amp_backends
    amp_backends.get("cpu").mx_formats()
    print(json.dumps({"torchao": "torchao" in sys.modules}))
    """)
    assert out == {"torchao": False}


# -- what each device declares (the device facts from torch's and torchao's sources) ---------------
@pytest.mark.parametrize(("capability", "name", "said"), [
    ((9, 0), "NVIDIA H100", "compute capability 9.0"), ((8, 9), "NVIDIA L4", "compute capability 8.9"),
    ((12, 0), "NVIDIA GeForce RTX 5090", "compute capability 12.0"),
])
def test_cuda_declares_no_mxfp8_outside_compute_capability_10(monkeypatch, capability, name, said):
    from fake_gpus import patch_nvidia

    from amp_backends_plugins import cuda as cuda_plugin

    patch_nvidia(monkeypatch, capability, name)
    be = cuda_plugin.CUDABackend()
    assert be.mx_formats() == () and said in be.mx_unavailable_reason() and "10.x" in be.mx_unavailable_reason()
    with pytest.raises(Fp8UnavailableError, match=rf"backend 'cuda' \({name} .*{said}.*emulate=True"):
        fp8_engine.check_device(be, "mxfp8", emulate=False)
    fp8_engine.check_device(be, "mxfp8", emulate=True)  # emulated: any device


def test_cuda_on_compute_capability_10_needs_torchaos_mx_kernels(monkeypatch):
    """A B200 as torch reports it, with this machine's torchao (no CUDA build of its MX kernels, or none
    at all): MXFP8 is not declared, and the reason names what the installed torchao lacks."""
    from fake_gpus import patch_nvidia

    from amp_backends_plugins import cuda as cuda_plugin

    patch_nvidia(monkeypatch, (10, 0), "NVIDIA B200")
    be = cuda_plugin.CUDABackend()
    why = be.mx_unavailable_reason()
    assert be.mx_formats() == () and why.startswith("cannot run torchao's MXFP8 layer")
    assert ("mxfp8_quantize_cuda" in why and "Triton" in why) if NO_MX is None else "torchao" in why


@pytest.mark.parametrize(("arch", "said"), [("gfx942:sramecc+:xnack-", "gfx942"), ("gfx90a", "gfx90a")])
def test_rocm_declares_no_mxfp8_before_gfx950(monkeypatch, arch, said):
    from fake_gpus import patch_rocm

    from amp_backends_plugins import cuda as cuda_plugin

    patch_rocm(monkeypatch, arch=arch)
    be = cuda_plugin.CUDABackend()
    assert be.mx_formats() == () and said in be.mx_unavailable_reason() and "gfx950" in be.mx_unavailable_reason()


def test_a_torchao_without_the_mx_layer_is_refused_naming_the_version_to_install():
    """A torchao whose MXFP8Linear cannot be imported (older than 0.18), simulated in a fresh
    interpreter where torchao is installed."""
    if fp8_engine.unavailable_reason() is not None:
        pytest.skip(f"needs a usable torchao to hide its MX layer: {fp8_engine.unavailable_reason()}")
    if fp8_engine.too_old_reason("mxfp8", fp8_engine.torchao_version()) is not None:
        pytest.skip("the installed torchao is older than the MX layer: the test below runs it as it is")
    from conftest import run_json

    out = run_json("""
    import json, sys, torch, amp_backends
    sys.modules["torchao.prototype.moe_training.mxfp8_linear"] = None   # an older torchao
    try:
        amp_backends.precision_policy(torch.nn.Sequential(torch.nn.Linear(32, 32)), fp32=[], fp8=[torch.nn.Linear],
                                      fp8_recipe="mxfp8", emulate=True, backend="cpu")
        error = None
    except amp_backends.AmpBackendsError as exc:
        error = type(exc).__name__ + ": " + str(exc)
    fp8 = amp_backends.precision.fp8.engine.unavailable_reason()
    print(json.dumps({"error": error, "fp8": fp8}))
    """)
    assert out["error"].startswith("Fp8UnavailableError: MXFP8 training needs torchao's MXFP8Linear")
    assert "pip install 'torchao>=0.18'" in out["error"] and out["fp8"] is None  # float8 still works


def test_each_feature_names_the_torchao_it_needs():
    assert fp8_engine.NEEDS_TORCHAO == {"fp8": "0.17", "mxfp8": "0.18"}
    for version in ("0.17.0", "0.17.1+cu130", "0.10.0"):
        assert "pip install 'torchao>=0.18'" in fp8_engine.too_old_reason("mxfp8", version)
        assert f"the installed torchao is {version}" in fp8_engine.too_old_reason("mxfp8", version)
    for version in ("0.18.0", "0.18.0rc1", "0.19.0.dev20261101", "1.0", None, "?"):
        assert fp8_engine.too_old_reason("mxfp8", version) is None, version
    assert "fp8 training needs torchao 0.17 or newer" in fp8_engine.too_old_reason("fp8", "0.16.1")
    assert fp8_engine.too_old_reason("fp8", "0.17.0") is None


def test_a_torchao_older_than_the_mx_layer_trains_fp8_and_refuses_only_mx():
    """On the installed torchao as it is (torchao 0.17 has float8 training and no MX layer): the float8
    recipes work; MXFP8 is refused naming the release to install."""
    too_old = fp8_engine.too_old_reason("mxfp8", fp8_engine.torchao_version())
    if too_old is None or fp8_engine.unavailable_reason() is not None:
        pytest.skip(f"needs a torchao with float8 training and without the MX layer (installed: "
                    f"{fp8_engine.torchao_version()})")
    assert fp8_engine.mx_unavailable_reason() == too_old
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    with pytest.raises(Fp8UnavailableError, match=r"pip install 'torchao>=0\.18'"):
        precision_policy(model, fp32=[], fp8=[nn.Linear], fp8_recipe="mxfp8", emulate=True, backend="cpu")
    assert not any(type(m) is not nn.Linear for m in model if isinstance(m, nn.Linear)), "nothing converted"
    policy = precision_policy(model, fp32=[], fp8=[nn.Linear], fp8_recipe="tensorwise", emulate=True, backend="cpu")
    assert len(policy.fp8) == 2
    policy.remove()


@needs_mx
def test_compiled_model_with_emulated_mx_layers_equals_eager_bitwise():
    """torchao 0.18 does not support compiling its emulated MX path (compiled, its casts give other
    values); the policy's emulated layers run eagerly inside the compiled model, so the compiled model
    gives the eager outputs and gradients bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    precision_policy(model, fp32=[], fp8=[nn.Linear], fp8_recipe="mxfp8", emulate=True, backend="cpu")
    x = torch.randn(32, 64)

    def run(fn):
        for p in model.parameters():
            p.grad = None
        with torch.autocast("cpu", torch.bfloat16):
            y = fn(x)
        y.float().sum().backward()
        return y.detach(), [p.grad.clone() for p in model.parameters()]

    y0, g0 = run(model)
    y1, g1 = run(torch.compile(model))
    assert _bits(y0, y1) and all(_bits(a, b) for a, b in zip(g0, g1))


@needs_mx
def test_check_with_fp8_mxfp8_reports_the_mx_layers(capsys):
    import json

    from amp_backends.cli import main

    assert main(["check", "bench:mlp", "--backend", "cpu", "--dtype", "bfloat16", "--fp8", "mxfp8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {row["name"]: row for row in data["rows"]}
    assert rows["0"]["type"] == "MxLinear" and rows["0"]["fp8"] == "fp8 (mxfp8, emulated)"
    assert rows["4"]["type"] == "Linear"  # 10 outputs
    assert any("MXFP8 emulated: backend 'cpu' has no MXFP8 matmul" in n for n in data["notes"])
    assert not any("in the float32 reference too" in n for n in data["notes"]), "the reference runs them as Linear"
    assert rows["0"]["output_error"] > 0, "against float32, the MX layer's own rounding shows"


@needs_mx
@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_mx_layers_train_under_ddp_and_fsdp2_as_by_hand(tmp_path, wrap):
    """2 CPU ranks over gloo (tests/fp8_dist_worker.py with an MX recipe): after 4 AdamW steps the
    parameters equal, bitwise, one MX model stepped with the ranks' gradients averaged by hand. The
    batches are 8 tokens, so the recipe keeps the weight gradient in high precision; the 16-wide last
    layer is left (MX blocks of 32)."""
    import json

    from torchrun import TESTS as HERE, torchrun

    proc = torchrun(HERE / "fp8_dist_worker.py", "--wrap", wrap, "--recipe", "mxfp8_with_gw_hp", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in (json.loads((tmp_path / f"rank{n}.json").read_text()) for n in range(2)):
        assert r["layers"] == ["MxLinear", "GELU", "MxLinear", "GELU", "Linear"] and r["converted"] == ["0", "2"]
        assert r["grad_type"] == ("DTensor" if wrap == "fsdp2" else "Tensor")
        assert r["equal_to_reference"], r["max_diff"]
        assert r["identical_across_ranks"]
