"""The npu and musa backends on the simulated PrivateUse1 device with simulated torch_npu and
torch_musa (amp_backends.testing), and what every simulated extension shares (lazy import). No machine here has an Ascend NPU or a Moore Threads GPU:
these run the real plugin code against simulations that keep each extension's API, kernel
limits and overflow reporting. Each test runs in its own process: PrivateUse1 is renamed once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from amp_backends.testing import SIMULATED, sim_packages_path

from conftest import cpu_only_env, run_json
from sim_marks import needs_sim_device

NPU = [sim_packages_path("npu")]
MUSA = [sim_packages_path("musa")]

LOOP = """
import json, math, torch, amp_backends
NAME = %r
be = amp_backends.get(NAME)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(be.device())
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(64, 8).to(be.device()); y = x.cpu()[:, :1].to(be.device())
scaler = %s
skipped, finite = [], []
for step in range(6):
    opt.zero_grad()
    with torch.autocast(be.device_type, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    if step == 3:
        with torch.no_grad():
            model[2].weight.grad.mul_(torch.full((), 3e38, device=be.device())).mul_(1e10)  # overflows on the device
        finite.append(bool(torch.isfinite(model[2].weight.grad.cpu()).all()))
    scaler.step(opt); scaler.update()
    skipped.append(bool(scaler.last_step_skipped) if hasattr(scaler, "last_step_skipped") else None)
print(json.dumps({"skipped": skipped, "finite_after_overflow": finite, "status_mode": be.global_overflow_status,
                  "fp64": be.has_fp64, "dist": be.dist_backend, "built": be.built_for_torch,
                  "dtypes": [str(d) for d in be.supported_dtypes()], "scale": scaler.get_scale()}))
"""


@needs_sim_device
@pytest.mark.parametrize("inf_nan", ["1", "0"])
def test_npu_finds_overflow_in_both_modes(inf_nan):
    """Saturation mode: the gradients stay finite (saturated), only the status register knows."""
    out = run_json(LOOP % ("npu", "be.grad_scaler(init_scale=2.**10)"), NPU, {"AMP_SIM_NPU_INF_NAN": inf_nan})
    assert out["skipped"] == [False, False, False, True, False, False]
    assert out["status_mode"] is (inf_nan == "0")
    assert out["finite_after_overflow"] == [inf_nan == "0"]
    assert out["fp64"] is False and out["dist"] == "hccl"
    assert out["dtypes"] == ["torch.float16", "torch.bfloat16"][:2 if inf_nan == "1" else 1], \
        "float32 from get_amp_supported_dtype is no autocast dtype; an Ascend910A (saturation mode) has no bf16"
    assert out["built"] and out["scale"] == 512.0


@needs_sim_device
def test_saturation_mode_defeats_a_per_tensor_check():
    """The negative control: in saturation mode, inspecting the tensors (torch's CPU way) misses
    the overflow that the status register reports."""
    out = run_json(
        """
        import json, torch, torch_npu
        g = torch.ones(4).to("npu")
        torch_npu.npu.clear_npu_overflow_flag()
        g.mul_(torch.full((), 3e38).to("npu")).mul_(1e10)
        print(json.dumps({"finite": bool(torch.isfinite(g.cpu()).all()), "flag": torch_npu.npu.get_npu_overflow_flag(),
                          "check": torch_npu.npu.utils.npu_check_overflow(g)}))
        """,
        NPU,
        {"AMP_SIM_NPU_INF_NAN": "0"},
    )
    assert out == {"finite": True, "flag": True, "check": True}


@needs_sim_device
@pytest.mark.parametrize(("capability", "tensor", "dtypes", "native"), [
    ("2.2", "1", ["torch.float16", "torch.bfloat16"], ["torch.float16", "torch.bfloat16"]),
    ("2.1", "1", ["torch.float16", "torch.bfloat16"], ["torch.float16"]),  # bf16 emulated
    ("2.1", "0", ["torch.float16"], ["torch.float16"]),  # no bf16 tensor on the device
])
def test_musa_trains_and_bf16_follows_torch_musas_rule(capability, tensor, dtypes, native):
    """torch_musa core/device.py: bf16 native from capability 2.2; below it supported (emulated)
    where a bf16 tensor can be made, and then not native."""
    out = run_json(LOOP.replace('"scale": scaler.get_scale()', '"scale": scaler.get_scale(), '
                                '"native": [str(d) for d in be.native_dtypes()]') % ("musa", "be.grad_scaler(init_scale=2.**10)"),
                   MUSA, {"AMP_SIM_MUSA_CAPABILITY": capability, "AMP_SIM_MUSA_BF16_TENSOR": tensor})
    assert out["skipped"] == [False, False, False, True, False, False]
    assert out["finite_after_overflow"] == [False] and out["dist"] == "mccl" and out["built"] == "2.7.1"
    assert out["dtypes"] == dtypes and out["native"] == native and out["status_mode"] is False


@needs_sim_device
def test_musa_bf16_gradients_go_around_cudas_op():
    out = run_json(
        """
        import json, torch, amp_backends
        be = amp_backends.get("musa")
        g = (torch.randn(100) * 50).bfloat16()
        res = {}
        try:
            torch._amp_foreach_non_finite_check_and_unscale_([g.to("musa")], torch.zeros(()).to("musa"), torch.full((), 0.5).to("musa"))
        except RuntimeError as e:
            res["torch"] = str(e)
        ref = g.clone(); torch._amp_foreach_non_finite_check_and_unscale_([ref], torch.zeros(()), torch.full((), 0.5))
        ours = g.to("musa"); found = torch.zeros(()).to("musa")
        amp_backends.testing.grad_op_(be, [ours], found, torch.full((), 0.5).to("musa"))
        res["same"] = torch.equal(ours.cpu(), ref)
        print(json.dumps(res))
        """,
        MUSA,
    )
    assert "not implemented for 'BFloat16'" in out["torch"] and out["same"]


@pytest.mark.parametrize(("name", "module"), [("npu", "torch_npu"), ("musa", "torch_musa")])
def test_not_installed_says_so_and_nothing_is_imported(name, module):
    out = run_json(
        f"""
        import json, sys, amp_backends
        try:
            amp_backends.get({name!r}); err = ""
        except amp_backends.BackendUnavailableError as e:
            err = str(e)
        print(json.dumps({{"err": err, "imported": {module!r} in sys.modules, "best": amp_backends.get().name}}))
        """,
        env=cpu_only_env(),
    )
    assert f"{module} is not installed" in out["err"] and out["best"] == "cpu" and not out["imported"]


@needs_sim_device
@pytest.mark.parametrize(("name", "module"), sorted((n, m) for n, m in SIMULATED.items() if n != "generic"))
def test_extension_imported_only_when_asked_for(name, module):
    out = run_json(
        f"""
        import json, sys, amp_backends
        amp_backends.get("cpu"); amp_backends.names()
        before = {module!r} in sys.modules
        amp_backends.get({name!r})
        print(json.dumps([before, {module!r} in sys.modules]))
        """,
        [sim_packages_path(name)],
    )
    assert out == [False, True]


def _two_ranks(tmp_path, backend: str, env: dict[str, str], *extra: str) -> list[dict]:
    here = Path(__file__).resolve().parents[1]  # tests/: the workers
    full = {k: v for k, v in os.environ.items() if not k.startswith(("AMP_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    full.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **env})
    full["PYTHONPATH"] = os.pathsep.join([str(p) for p in NPU] + [full.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(here / "status_dist_worker.py"), "--backend", backend, "--out", str(tmp_path), *extra],
        capture_output=True, text=True, env=full, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize(("backend", "inf_nan"), [
    pytest.param("npu", "0", marks=needs_sim_device, id="npu-saturation"),
    pytest.param("npu", "1", marks=needs_sim_device, id="npu-inf-nan"),
    pytest.param("cpu", "1", id="cpu"),
])
def test_an_overflow_on_one_rank_skips_the_step_on_both(tmp_path, backend, inf_nan):
    """torch_npu's _sync_dist_overflow_count: in saturation mode only the rank whose backward
    overflowed has the status set; the scaler agrees on it over the default group, so both ranks
    skip step 1, back off, and keep identical parameters."""
    ranks = _two_ranks(tmp_path, backend, {"AMP_SIM_NPU_INF_NAN": inf_nan})
    assert ranks[0]["status_mode"] is (backend == "npu" and inf_nan == "0")
    for r in ranks:
        assert [e["skipped"] for e in r["record"]] == [False, True, False, False]
        assert [e["scale"] for e in r["record"]] == [256.0, 128.0, 128.0, 128.0]
    assert ranks[0]["params"] == ranks[1]["params"]


@needs_sim_device
def test_a_rank_without_gradients_still_agrees_on_the_status(tmp_path):
    """Saturation mode, a second optimizer whose parameter only rank 0 uses: rank 1 has no gradient
    for it, and still takes part in the status all-reduce the other rank waits in (torch_npu always
    all-reduces); no hang, no error, the same steps skipped on both ranks."""
    ranks = _two_ranks(tmp_path, "npu", {"AMP_SIM_NPU_INF_NAN": "0"}, "--extra")
    for r in ranks:
        assert [e["skipped"] for e in r["record"]] == [False, True, False, False]
    assert ranks[0]["params"] == ranks[1]["params"]
    assert ranks[1]["extra"] == [1.0, 1.0, 1.0] and ranks[0]["extra"] != [1.0, 1.0, 1.0]


@needs_sim_device
@pytest.mark.parametrize(("inf_nan", "bf16"), [("0", "1"), ("1", "1"), ("1", "0")])
def test_simulated_torch_npu_follows_its_source(inf_nan, bf16):
    """torch_npu/npu/utils.py: the status functions raise (get) and warn (clear) with inf/NaN
    mode; autocast_utils: bf16 listed only where the chip has it; op-plugin's unscale op in
    saturation mode: on overflow found_inf is set and the gradients stay scaled."""
    out = run_json(
        """
        import json, warnings, torch, torch_npu
        res = {"dtypes": [str(d) for d in torch.npu.get_amp_supported_dtype()]}
        try:
            res["get"] = torch_npu.npu.get_npu_overflow_flag()
        except RuntimeError as exc:
            res["get"] = "raises: " + str(exc)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch_npu.npu.clear_npu_overflow_flag()
        res["clear_warns"] = [str(w.message) for w in caught]
        g = torch.full((3,), 8.0).to("npu")
        found = torch.zeros(()).to("npu")
        inv = torch.full((), 0.25).to("npu")
        torch._amp_foreach_non_finite_check_and_unscale_([g], found, inv)
        res["clean"] = [found.item(), g.cpu().tolist()]
        g.mul_(torch.full((), 3e38).to("npu")).mul_(1e10)  # overflows: saturates, or inf
        before = g.cpu().clone()
        torch._amp_foreach_non_finite_check_and_unscale_([g], found, inv)
        res["overflow"] = [found.item(), torch.equal(g.cpu(), before) or not bool(torch.isfinite(before).all())]
        res["after_read"] = None if torch_npu.INF_NAN else torch_npu.npu.get_npu_overflow_flag()
        print(json.dumps(res))
        """,
        NPU,
        {"AMP_SIM_NPU_INF_NAN": inf_nan, "AMP_SIM_NPU_BF16": bf16},
    )
    has_bf16 = bf16 == "1" and inf_nan == "1"  # AMP_SIM_NPU_INF_NAN=0 alone: an Ascend910A, without bf16
    assert out["dtypes"] == (["torch.float16", "torch.bfloat16", "torch.float32"] if has_bf16
                             else ["torch.float16", "torch.float32"])
    if inf_nan == "1":
        assert out["get"].startswith("raises: Unsupported api when soc_version >= Ascend910B1")
        assert out["clear_warns"] and "useless" in out["clear_warns"][0]
        assert out["after_read"] is None
    else:
        assert out["get"] is False and out["clear_warns"] == []
        assert out["after_read"] is False, "the op read and reset the status"
    assert out["clean"] == [0.0, [2.0, 2.0, 2.0]]
    assert out["overflow"] == [1.0, True], "found, and (saturation mode) the gradients left scaled"


PRECISION = """
import json, warnings, torch, torch_npu, amp_backends
be = amp_backends.get("npu")
torch.manual_seed(0)
a, b = torch.randn(64, 64), torch.randn(64, 64)
exact = a @ b
as_fp16 = (a.half() @ b.half()).float()
def on_npu():
    return (a.to(be.device()) @ b.to(be.device())).cpu()
out = {"mode": be.precision_mode(), "note": be.fp32_note(), "default_same_as_fp16": bool(torch.equal(on_npu(), as_fp16)),
       "default_exact": bool(torch.equal(on_npu(), exact)), "info": be.describe()}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    amp_backends.precision_policy(torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 2)), backend=be)
out["policy_warning"] = [str(w.message) for w in caught if "precision_policy" in str(w.message)]
try:
    torch_npu.npu.set_option({"ACL_PRECISION_MODE": "allow_fp32_to_fp32"})
except ValueError as exc:
    out["bad_value"] = str(exc)
torch_npu.npu.set_option({"ACL_PRECISION_MODE": "must_keep_origin_dtype"})
out.update(kept_mode=be.precision_mode(), kept_note=be.fp32_note(), kept_exact=bool(torch.equal(on_npu(), exact)))
print(json.dumps(out))
"""


@needs_sim_device
@pytest.mark.parametrize(("inf_nan", "soc"), [("0", None), ("1", None), ("0", "Ascend910B1")])
def test_the_ascend_precision_mode_is_modelled_and_said(inf_nan, soc):
    """torch_npu's ACL_PRECISION_MODE: allow_fp32_to_fp16 by default on the chips below Ascend910B1,
    so a float32 matmul on the device gives float16's result there (the simulation no kinder than the
    chip); info, the backend and a precision policy say so and name the option that keeps float32. The
    chip decides, not its inf/NaN mode: a 910B forced into saturation mode keeps float32."""
    out = run_json(PRECISION, NPU, {"AMP_SIM_NPU_INF_NAN": inf_nan, **({"AMP_SIM_NPU_SOC": soc} if soc else {})})
    saturation = inf_nan == "0" and soc is None  # an Ascend910A
    assert out["mode"] == ("allow_fp32_to_fp16" if saturation else "must_keep_origin_dtype")
    assert out["default_same_as_fp16"] is saturation and out["default_exact"] is not saturation
    if saturation:
        assert "must_keep_origin_dtype" in out["note"] and "float16" in out["info"]
        assert len(out["policy_warning"]) == 1 and "may run in float16" in out["policy_warning"][0]
    else:
        assert out["note"] is None and out["policy_warning"] == []
    assert out["bad_value"] == ("value of ACL_PRECISION_MODE should be in ['allow_fp32_to_fp16', "
                                "'must_keep_origin_dtype'] but got allow_fp32_to_fp32")
    assert out["kept_mode"] == "must_keep_origin_dtype" and out["kept_note"] is None and out["kept_exact"]


CHECKPOINTS = """
import json, torch, amp_backends
from torch_npu.npu.amp import GradScaler as NPUScaler
be = amp_backends.get("npu")
ours = be.grad_scaler(init_scale=2.**10, growth_interval=7)
model = torch.nn.Linear(3, 1).to(be.device()); opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad(); ours.scale(model(torch.ones(2, 3, device=be.device())).sum()).backward(); ours.step(opt); ours.update()
saved = ours.state_dict()
theirs = NPUScaler(init_scale=1.0)
theirs.load_state_dict(saved)                         # torch_npu's scaler requires "dynamic"
static = NPUScaler(init_scale=64.0, growth_interval=5, dynamic=False)
back = be.grad_scaler()
back.load_state_dict(static.state_dict())            # and the other way, its mode taken
plain = torch.amp.GradScaler("npu"); plain.load_state_dict(saved)
try:
    NPUScaler().load_state_dict({k: v for k, v in saved.items() if k != "dynamic"})
    refused = None
except KeyError as exc:
    refused = str(exc)
print(json.dumps({"keys": sorted(saved), "theirs": theirs.state_dict(), "ours": saved,
                  "back": back.state_dict(), "back_dynamic": back._dynamic, "plain_scale": plain.get_scale(),
                  "refused": refused}))
"""


@needs_sim_device
def test_a_checkpoint_moves_between_our_scaler_and_torch_npus_both_ways():
    out = run_json(CHECKPOINTS, NPU)
    assert out["keys"] == ["_growth_tracker", "backoff_factor", "dynamic", "growth_factor", "growth_interval", "scale"]
    assert out["theirs"] == out["ours"], "torch_npu's scaler loads ours and saves the same state"
    assert out["back"]["scale"] == 64.0 and out["back"]["growth_interval"] == 5 and out["back_dynamic"] is False
    assert out["plain_scale"] == out["ours"]["scale"], "torch's own scaler ignores the extra key"
    assert out["refused"] == "'dynamic'", "without it torch_npu's loader fails: the key set is the real one"


AUTOCAST_LISTS = """
import json, torch, amp_backends
be = amp_backends.get(%r)
x = torch.randn(1, 2, 4, 4).to(be.device())
with torch.autocast(be.device_type, dtype=torch.float16):
    up = torch.nn.functional.interpolate(x.half(), scale_factor=2, mode="bilinear")
    norm = torch.norm(x.half())
    mm = x.view(8, 4) @ x.view(8, 4).t()
print(json.dumps({"upsample": str(up.dtype), "norm": str(norm.dtype), "mm": str(mm.dtype)}))
"""


@needs_sim_device
def test_the_npu_simulation_autocasts_by_torch_npus_lists_not_cudas():
    """torch_npu's AutoCastOps.cpp has no upsampling in float32 (CUDA's has) and puts norm in float32."""
    npu = run_json(AUTOCAST_LISTS % "npu", NPU)
    musa = run_json(AUTOCAST_LISTS % "musa", MUSA)  # CUDA's lists
    assert npu == {"upsample": "torch.float16", "norm": "torch.float32", "mm": "torch.float16"}
    assert musa["upsample"] == "torch.float32" and musa["mm"] == "torch.float16"


# -- fp8: torch._scaled_mm by chip, as each extension's source has it ----------------------------------
FP8 = """
import json, sys, warnings, torch, amp_backends
from torch import nn
from amp_backends.precision.fp8 import engine
warnings.simplefilter("ignore")
be = amp_backends.get(sys.argv[1] if len(sys.argv) > 1 else %r)
dev = be.device()
out = {"dtypes": [str(d) for d in be.fp8_dtypes()], "recipes": list(be.fp8_recipes()),
       "reason": be.fp8_unavailable_reason()}

def run(recipe, emulate):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).to(dev)
    x = torch.randn(16, 32).to(dev)
    policy = amp_backends.precision_policy(model, fp32=(), fp8=[nn.Linear], fp8_recipe=recipe, emulate=emulate,
                                           backend=be)
    assert sorted(policy.fp8) == ["0", "2"], policy.fp8_skipped
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:  # the dispatcher's record
        y = model(x)
        y.float().pow(2).sum().backward()
    policy.remove()
    calls = sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_mm")
    return y.detach().cpu().float(), model[0].weight.grad.cpu().float(), calls

for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
    try:
        y, g, n = run(recipe, False)
    except engine.Fp8UnavailableError as exc:
        out[recipe] = str(exc)
        continue
    y_ref, g_ref, _ = run(recipe, True)  # torchao's emulation: high-precision matmuls of the same fp8 values
    # within fp8's rounding (torchao's rowwise path rounds outputs to bf16 first, and e4m3 steps are 1/8)
    out[recipe] = {"scaled_mm_calls": n, "close_to_emulation": bool(
        (y - y_ref).norm() <= 0.01 * y_ref.norm() and (g - g_ref).norm() <= 0.05 * g_ref.norm())}

e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
a, b = torch.randn(16, 32), torch.randn(32, 16)
one = torch.ones((), device=dev)
cases = {"tensorwise e4m3 x e4m3": (e4, e4, one, one), "tensorwise e5m2 x e4m3": (e5, e4, one, one),
         "tensorwise e5m2 x e5m2": (e5, e5, one, one),
         "rowwise e4m3 x e4m3": (e4, e4, torch.ones(16, 1, device=dev), torch.ones(1, 16, device=dev)),
         "rowwise e5m2 x e4m3": (e5, e4, torch.ones(16, 1, device=dev), torch.ones(1, 16, device=dev))}
for name, (da, db, sa, sb) in cases.items():
    try:
        mb = b.t().contiguous().to(db).to(dev).t()  # column-major, as cuBLASLt and the vendors ask
        got = torch._scaled_mm(a.to(da).to(dev), mb, sa, sb, out_dtype=torch.bfloat16)
        want = (a.to(da).float() @ b.to(db).float()).to(torch.bfloat16)
        out[name] = "ok" if torch.allclose(got.cpu().float(), want.float(), rtol=1e-2, atol=1e-2) else "wrong values"
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
print(json.dumps(out))
"""

_RAN = {"scaled_mm_calls": 6, "close_to_emulation": True}


@needs_sim_device
@pytest.mark.parametrize(("backend", "env", "runs"), [
    ("npu", {"AMP_SIM_NPU_SOC": "Ascend950"}, True), ("npu", {"AMP_SIM_NPU_SOC": "Ascend910B1"}, False),
    ("musa", {"AMP_SIM_MUSA_CAPABILITY": "3.1"}, True), ("musa", {"AMP_SIM_MUSA_CAPABILITY": "2.2"}, False),
], ids=["ascend950", "ascend910b1", "musa-3.1", "musa-2.2"])
def test_fp8_runs_on_the_chips_whose_extension_has_scaled_mm_and_is_refused_below(backend, env, runs):
    """Both sides of each line, on the simulated extensions (their _scaled_mm keeps the vendor's checks,
    in its words: op-plugin's ScaledMmKernelNpuOpApi.cpp, torch_musa's Matmul.cpp ScaledMatmulOut).
    Where the backend declares fp8, every torchao recipe trains through torch._scaled_mm on the device
    (6 calls: two layers, forward and two backward matmuls; 4 with the weight gradient in high precision),
    close to torchao's own emulation of the same fp8 values; where not, the policy is refused saying
    what the chip lacks. Read from the vendors' sources, not run on their hardware."""
    out = run_json(FP8 % backend, NPU if backend == "npu" else MUSA, env)
    if runs:
        assert out["dtypes"] == ["torch.float8_e4m3fn", "torch.float8_e5m2"] and out["reason"] is None
        assert out["recipes"] == ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
        assert out["tensorwise"] == out["rowwise"] == _RAN
        assert out["rowwise_with_gw_hp"] == {**_RAN, "scaled_mm_calls": 4}
        assert out["tensorwise e4m3 x e4m3"] == out["tensorwise e5m2 x e4m3"] == out["rowwise e4m3 x e4m3"] == "ok"
    else:
        assert out["dtypes"] == out["recipes"] == []
        for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
            assert f"backend '{backend}'" in out[recipe] and "has no fp8 matmul" in out[recipe]
            assert out["reason"] in out[recipe] and "emulate=True" in out[recipe]
    if backend == "npu":
        if runs:  # op-plugin: not both e5m2; rowwise scales recognised for e4m3fn x e4m3fn only
            assert out["tensorwise e5m2 x e5m2"] == "RuntimeError: Multiplication of two Float8_e5m2 matrices is not supported"
            assert out["rowwise e5m2 x e4m3"].startswith("RuntimeError: the simulated op-plugin takes one-element")
        else:
            assert "below Ascend950" in out["reason"] and "ScaledMmKernelNpuOpApi.cpp" in out["reason"]
            assert {v for k, v in out.items() if " x " in k} == {
                "RuntimeError: _scaled_mm is supported only on the Ascend950 platform and after."}
    else:
        if runs:  # torch_musa checks float8 operands and scale sizes, nothing about e5m2 pairs
            assert out["tensorwise e5m2 x e5m2"] == out["rowwise e5m2 x e4m3"] == "ok"
        else:
            assert "compute capability 2.2" in out["reason"] and "3.1 (MP31)" in out["reason"]
            assert {v for k, v in out.items() if " x " in k} == {
                "RuntimeError: scaled_gemm is only supported for MUSA_ARCH >= 310"}
