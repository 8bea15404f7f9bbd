"""The npu and musa backends on the simulated PrivateUse1 device with simulated torch_npu and
torch_musa (amp_backends.testing), and what every simulated extension shares (lazy import). No machine here has an Ascend NPU or a Moore Threads GPU:
these run the real plugin code against simulations that keep each extension's API, kernel
limits and overflow reporting. Each test runs in its own process: PrivateUse1 is renamed once."""

from __future__ import annotations

import pytest

from amp_backends.testing import SIMULATED, sim_packages_path

from conftest import run_json
from test_mlu import needs_sim_device

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
    assert out["dtypes"] == ["torch.float16", "torch.bfloat16"], "float32 from get_amp_supported_dtype is no autocast dtype"
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
@pytest.mark.parametrize(("capability", "dtypes"), [("2.2", ["torch.float16", "torch.bfloat16"]), ("2.1", ["torch.float16"])])
def test_musa_trains_and_bf16_follows_the_capability(capability, dtypes):
    out = run_json(LOOP % ("musa", "be.grad_scaler(init_scale=2.**10)"), MUSA, {"AMP_SIM_MUSA_CAPABILITY": capability})
    assert out["skipped"] == [False, False, False, True, False, False]
    assert out["finite_after_overflow"] == [False] and out["dist"] == "mccl" and out["built"] == "2.7.1"
    assert out["dtypes"] == dtypes and out["status_mode"] is False


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
        be.unscale_and_check_([ours], found, torch.full((), 0.5).to("musa"))
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
    )
    assert f"{module} is not installed" in out["err"] and out["best"] == "cpu" and not out["imported"]


@needs_sim_device
@pytest.mark.parametrize(("name", "module"), sorted(SIMULATED.items()))
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
