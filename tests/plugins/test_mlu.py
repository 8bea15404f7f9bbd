"""The mlu plugin on the simulated PrivateUse1 "mlu" device and a simulated torch_mlu.

No machine here has an MLU; these run the real plugin code against a faithful simulation
(amp_backends.testing). Each test runs in its own process: PrivateUse1 is renamed once.
"""

from __future__ import annotations

import pytest

from amp_backends.testing import sim_packages_path

from conftest import cpu_only_env, run_json
from sim_marks import needs_sim_device

SIM = [sim_packages_path("mlu")]

SAME_LOOP = """
import json, math, warnings, torch, amp_backends
warnings.simplefilter("error")  # no deprecation warning may come from our side
be = amp_backends.get("mlu")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(be.device())
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(128, 8).to(be.device())
y = (x.cpu()[:, :2].sum(1, keepdim=True)).to(be.device())
scaler = be.grad_scaler()
losses, dtypes, skipped = [], set(), []
for step in range(40):
    opt.zero_grad()
    with be.autocast():
        out = model(x)
        dtypes.add(str(out.dtype))
        loss = torch.nn.functional.mse_loss(out, y)
    scaler.scale(loss).backward()
    if step == 10:
        from amp_backends.testing.simdevice import raw_of
        raw_of(model[0].weight.grad)[0, 0] = math.inf
    before = [p.detach().cpu().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    after = [p.detach().cpu() for p in model.parameters()]
    if scaler.last_step_skipped:
        skipped.append((step, all(torch.equal(a, b) for a, b in zip(before, after))))
    losses.append(loss.item())
print(json.dumps({"device": str(next(model.parameters()).device), "dtypes": sorted(dtypes),
                  "first": losses[0], "last": losses[-1], "skipped": skipped, "scale": scaler.get_scale(),
                  "loss_dtype": str(loss.dtype), "dist": be.dist_backend,
                  "autocast_type": type(be.autocast()).__module__ + "." + type(be.autocast()).__qualname__}))
"""


@pytest.mark.parametrize("chip", ["MLU370", "MLU590"])
@needs_sim_device
def test_same_loop_trains_on_simulated_mlu(chip):
    out = run_json(SAME_LOOP, SIM, {"AMP_SIM_MLU_CHIP": chip})
    assert out["device"] == "mlu:0" and out["dist"] == "cncl"
    assert out["dtypes"] == ["torch.float16"] and out["loss_dtype"] == "torch.float32"
    assert out["last"] < 0.1 * out["first"], "loss falls under fp16 autocast with the scaler"
    assert [10, True] in out["skipped"], "the step with injected inf is skipped, parameters unchanged"
    assert out["autocast_type"] == "torch.amp.autocast_mode.autocast", "torch_mlu's autocast is torch's"


@needs_sim_device
def test_simulated_torch_mlu_keeps_the_real_kernels_limits_and_the_scaler_routes_around_them():
    """bf16 gradients (MLU590) and tensors over the op's size limit: torch's own scaler fails on the
    simulated torch_mlu as on the real one; ours gives torch's CPU results."""
    out = run_json(
        """
        import json, torch, amp_backends
        be = amp_backends.get("mlu")
        res = {}
        g = (torch.randn(1000) * 100).bfloat16()
        try:
            torch._amp_foreach_non_finite_check_and_unscale_([g.to("mlu")], torch.zeros(()).to("mlu"), torch.full((), 0.25).to("mlu"))
        except RuntimeError as e:
            res["torch_bf16"] = str(e)
        big = torch.randn(300)
        try:
            torch._amp_foreach_non_finite_check_and_unscale_([big.to("mlu")], torch.zeros(()).to("mlu"), torch.full((), 0.25).to("mlu"))
        except RuntimeError as e:
            res["torch_size"] = str(e)
        type(be).max_tensor_elements = 256  # the declared limit, as low as the simulated op's here
        ref = [g.clone(), big.clone()]
        torch._amp_foreach_non_finite_check_and_unscale_(ref, torch.zeros(()), torch.full((), 0.25))
        grads = [g.to("mlu"), big.to("mlu")]
        found = torch.zeros(()).to("mlu")
        amp_backends.testing.grad_op_(be, grads, found, torch.full((), 0.25).to("mlu"))
        res["same"] = all(torch.equal(a.cpu(), b) for a, b in zip(grads, ref))
        res["found"] = found.item()
        print(json.dumps(res))
        """,
        SIM,
        {"AMP_SIM_MLU_MAX_ELEMENTS": "256"},
    )
    # csrc/aten/operators/bang/amp_unscale.cpp's own texts
    assert out["torch_bf16"] == ("Currently amp_unscale only support float32 and float16 dtype, "
                                 "not implemented for BFloat16")
    assert out["torch_size"] == "Not implemented large tensor."
    assert out["same"] and out["found"] == 0.0


@needs_sim_device
def test_torch_mlu_autocast_policy_bce_banned_norm_in_float32():
    out = run_json(
        """
        import json, torch, torch.nn.functional as F, amp_backends
        be = amp_backends.get("mlu")
        x = torch.randn(4, 8).to("mlu")
        res = {}
        with be.autocast():
            h = x @ torch.randn(8, 8).to("mlu")
            res["norm"] = str(torch.linalg.vector_norm(h).dtype)
            try:
                F.binary_cross_entropy(torch.sigmoid(h), torch.rand(4, 8).to("mlu"))
            except RuntimeError as e:
                res["bce"] = str(e)
            res["bce_logits"] = str(F.binary_cross_entropy_with_logits(h, torch.rand(4, 8).to("mlu")).dtype)
        print(json.dumps(res))
        """,
        SIM,
    )
    assert out["norm"] == "torch.float32" and out["bce_logits"] == "torch.float32"
    assert "unsafe to autocast" in out["bce"] and "binary_cross_entropy_with_logits" in out["bce"]


@needs_sim_device
def test_autocast_policy_and_dtypes_on_simulated_mlu():
    out = run_json(
        """
        import json, torch, torch.nn.functional as F, amp_backends
        be = amp_backends.get("mlu")
        x = torch.randn(4, 8).to("mlu"); w = torch.randn(8, 8).to("mlu")
        res = {}
        for dtype in be.supported_dtypes():
            with be.autocast(dtype):
                mm = x @ w
                res[str(dtype)] = [str(mm.dtype), str(F.linear(x, w).dtype), str(F.softmax(mm, -1).dtype),
                                   str(F.mse_loss(mm, x).dtype), str(F.cross_entropy(mm, torch.zeros(4, dtype=torch.long).to("mlu")).dtype)]
                with be.autocast(enabled=False):
                    res[str(dtype)].append(str((x @ w).dtype))
        try:
            be.autocast(torch.float64)
        except amp_backends.UnsupportedDtypeError as e:
            res["error"] = str(e)
        res["supported"] = [str(d) for d in be.supported_dtypes()]
        print(json.dumps(res))
        """,
        SIM,
    )
    assert out["supported"] == ["torch.float16", "torch.bfloat16"]
    for low in ("torch.float16", "torch.bfloat16"):
        assert out[low] == [low, low, "torch.float32", "torch.float32", "torch.float32", "torch.float32"]
    assert "does not support autocast dtype float64" in out["error"]


@needs_sim_device
def test_bf16_only_where_the_chip_supports_it():
    """MLU370 (major 3): fp16 only, although torch_mlu's get_amp_supported_dtype lists bf16."""
    out = run_json(
        """
        import json, torch, amp_backends
        be = amp_backends.get("mlu")
        try:
            be.autocast(torch.bfloat16)
            err = ""
        except amp_backends.UnsupportedDtypeError as e:
            err = str(e)
        print(json.dumps({"supported": [str(d) for d in be.supported_dtypes()], "err": err,
                          "listed": [str(d) for d in torch.mlu.get_amp_supported_dtype()]}))
        """,
        SIM,
        {"AMP_SIM_MLU_CHIP": "MLU370"},
    )
    assert out["supported"] == ["torch.float16"] and "supported: float16" in out["err"]
    assert out["listed"] == ["torch.float16", "torch.bfloat16"]


@pytest.mark.parametrize(
    ("mode", "paths", "reason"),
    [
        ("new", [], "torch_mlu is not installed"),
        ("broken", SIM, "torch_mlu is installed but failed to import: ImportError: libcnnl.so"),
        pytest.param("nodevice", SIM, "no MLU device visible", marks=needs_sim_device),
    ],
)
def test_each_unavailable_reason(mode, paths, reason):
    out = run_json(
        """
        import json, amp_backends
        try:
            amp_backends.get("mlu"); err = ""
        except amp_backends.BackendUnavailableError as e:
            err = str(e)
        print(json.dumps({"err": err, "available": amp_backends.available(), "best": amp_backends.get().name}))
        """,
        paths,
        {"AMP_SIM_MLU": mode, **cpu_only_env()},
    )
    assert reason in out["err"] and "mlu" not in out["available"] and out["best"] == "cpu"


@needs_sim_device
def test_no_device_hint_names_the_variable_that_decides():
    code = """
        import json, amp_backends
        try:
            amp_backends.get("mlu"); err = ""
        except amp_backends.BackendUnavailableError as e:
            err = str(e)
        print(json.dumps(err))
        """
    both = run_json(code, SIM, {"CN_VISIBLE_DEVICES": "", "MLU_VISIBLE_DEVICES": "0,1"})
    assert "CN_VISIBLE_DEVICES=''" in both and "MLU_VISIBLE_DEVICES is ignored while it is set" in both
    assert "cnmon" in both
    assert "MLU_VISIBLE_DEVICES=''" in run_json(code, SIM, {"MLU_VISIBLE_DEVICES": ""})
    ok = run_json(code.replace('amp_backends.get("mlu"); err = ""', 'err = str(amp_backends.get("mlu").device(1))'),
                  SIM, {"MLU_VISIBLE_DEVICES": "0,1", "AMP_SIM_MLU_DEVICES": "2"})
    assert ok == "mlu:1"
    # torch_mlu reads CUDA_VISIBLE_DEVICES when neither of its own variables is set
    cuda = run_json(code, SIM, {"CUDA_VISIBLE_DEVICES": ""})
    assert "CUDA_VISIBLE_DEVICES=''" in cuda


@needs_sim_device
@pytest.mark.parametrize(("env", "count"), [
    ({}, 2),
    ({"CN_VISIBLE_DEVICES": "1"}, 1),
    ({"MLU_VISIBLE_DEVICES": "0, 1, 0"}, 0),  # a repeated ordinal: no devices
    ({"MLU_VISIBLE_DEVICES": "0,-1,1"}, 1),  # a negative ordinal ends the list
    ({"MLU_VISIBLE_DEVICES": "1,two,0"}, 1),  # so does anything not a number
    ({"MLU_VISIBLE_DEVICES": "0,7"}, 1),  # cut at the first ordinal the machine lacks
    ({"CUDA_VISIBLE_DEVICES": "1,0"}, 2),
    ({"CUDA_VISIBLE_DEVICES": "0", "MLU_VISIBLE_DEVICES": ""}, 0),  # MLU_VISIBLE_DEVICES wins
])
def test_visible_devices_parse_as_torch_mlu_does(env, count):
    """torch_mlu ``mlu/__init__.py`` ``_parse_visible_devices`` and ``_device_count_cndev``, on a
    simulated machine with two MLUs."""
    out = run_json("import json, torch, torch_mlu; print(json.dumps(torch.mlu.device_count()))", SIM,
                   {"AMP_SIM_MLU_DEVICES": "2", **env})
    assert out == count


@needs_sim_device
def test_auto_picks_the_simulated_mlu_over_cpu():
    out = run_json("import json, amp_backends; print(json.dumps(amp_backends.get().name))", SIM, cpu_only_env())
    assert out == "mlu"


@needs_sim_device
def test_torch_grad_scaler_on_simulated_device_agrees_with_ours():
    """Our scaler and torch.amp.GradScaler('mlu') give the same trajectory on the simulated device."""
    out = run_json(
        """
        import json, math, torch, amp_backends
        import torch_mlu  # as users do on a Cambricon machine
        from amp_backends.testing.simdevice import raw_of
        def run(make):
            torch.manual_seed(0)
            m = torch.nn.Linear(6, 2).to("mlu")
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            s = make(); scales = []
            x = torch.randn(16, 6).to("mlu")
            for i in range(6):
                with torch.autocast("mlu", dtype=torch.float16):
                    loss = m(x).float().pow(2).mean()
                s.scale(loss).backward()
                if i == 2:
                    raw_of(m.bias.grad)[1] = math.nan
                s.step(opt); s.update(); opt.zero_grad(); scales.append(s.get_scale())
            return [p.detach().cpu().tolist() for p in m.parameters()], scales
        ours = run(lambda: amp_backends.GradScaler("mlu", growth_interval=2))
        ref = run(lambda: torch.amp.GradScaler("mlu", growth_interval=2))
        print(json.dumps({"same": ours == ref, "scales": ours[1]}))
        """,
        SIM,
    )
    assert out["same"] and out["scales"][2] < out["scales"][1]


MLU_FALLBACK = """
import json, math, warnings, torch, amp_backends
from torch import nn
warnings.simplefilter("always")
be = amp_backends.get("mlu")
out = {"fp8": [str(d) for d in be.fp8_dtypes()], "reason": be.fp8_unavailable_reason()}
try:
    amp_backends.precision_policy(nn.Sequential(nn.Linear(32, 32)).to(be.device()), fp8=[nn.Linear], backend=be)
except Exception as exc:
    out["policy"] = str(exc)
with warnings.catch_warnings(record=True) as caught:
    try:
        one = torch.ones((), device=be.device())
        a = torch.ones(16, 32).to(torch.float8_e4m3fn).to(be.device())
        torch._scaled_mm(a, a.t(), one, one, out_dtype=torch.bfloat16)
        out["scaled_mm"] = "ran"
    except Exception as exc:
        out["scaled_mm"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
out["scaled_mm_warned"] = [str(w.message) for w in caught if "_scaled_mm" in str(w.message)]

def train(dev, kw, scaler):
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(dev)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1, **kw)
    for i, poison in enumerate((False, True, False, False)):
        opt.zero_grad()
        loss = (model(torch.linspace(-1, 1, 12, device=dev).reshape(3, 4) * (i + 1)) ** 2).sum()
        if poison:
            loss = loss * torch.full((), math.inf, device=dev)
        scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    return [p.detach().cpu() for p in model.parameters()]

with warnings.catch_warnings(record=True) as caught:
    try:
        ours = train(be.device(), {"fused": True}, be.grad_scaler(init_scale=2.**8))
        oracle = train("cpu", {"fused": False, "foreach": False}, torch.amp.GradScaler("cpu", init_scale=2.**8))
        out["adagrad"] = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ours, oracle))
    except Exception as exc:
        out["adagrad"] = f"{type(exc).__name__}: {exc}"
out["adagrad_warned"] = [str(w.message) for w in caught if "_fused_adagrad_" in str(w.message)]
print(json.dumps(out))
"""


@needs_sim_device
@pytest.mark.parametrize("fallback", [None, "0"], ids=["cpu-fallback", "ENABLE_FALLBACK_TO_CPU=0"])
def test_what_torch_mlu_has_no_kernel_for_runs_on_its_cpu_fallback_or_is_refused(fallback):
    """torch_mlu r2.4 registers neither _fused_adagrad_ nor _scaled_mm (codegen/mlu_functions.yaml);
    its CPU fallback (csrc/aten/MLUFallback.cpp, on by default) runs them on the CPU after its warning.
    Fused Adagrad there trains as torch's scaler with the unfused Adagrad on the CPU (the oracle);
    _scaled_mm fails, as torch 2.4 has no CPU kernel for it, and fp8 is refused for the MLU saying so.
    With ENABLE_FALLBACK_TO_CPU=0 both raise torch_mlu's NotImplementedError and the scaler refuses
    fused Adagrad before anything changes. Read from torch_mlu's source; not run on an MLU."""
    out = run_json(MLU_FALLBACK, SIM, {"ENABLE_FALLBACK_TO_CPU": fallback} if fallback else {})
    assert out["fp8"] == [] and "torch_mlu registers no _scaled_mm" in out["reason"]
    assert "backend 'mlu'" in out["policy"] and out["reason"] in out["policy"]
    if fallback is None:
        assert out["adagrad"] is True
        assert out["adagrad_warned"] == ["The operator 'aten::_fused_adagrad_' is not currently supported on the MLU "
                                         "backend and will fall back to run on the CPU. This may have performance "
                                         "implications."]
        assert out["scaled_mm"] == ("NotImplementedError: Could not run 'aten::_scaled_mm' with arguments from the "
                                    "'CPU' backend. This could be because the operator doesn't exist for this backend, "
                                    "or was omitted during the selective/custom build process (if using custom build).")
        assert len(out["scaled_mm_warned"]) == 1 and "fall back to run on the CPU" in out["scaled_mm_warned"][0]
    else:
        assert out["adagrad"].startswith("RuntimeError: Adagrad(fused=True) cannot run on 'mlu' (absent)")
        assert "ENABLE_FALLBACK_TO_CPU=0" in out["adagrad"]
        assert out["scaled_mm"].startswith("NotImplementedError: The operator 'aten::_scaled_mm' is not currently "
                                           "implemented for the MLU device.")
        assert out["adagrad_warned"] == out["scaled_mm_warned"] == []
