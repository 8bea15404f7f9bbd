"""Fused optimizers and found_inf: what a device's kernel does is declared or probed
(amp_backends.devices.fused), and the scaler hands found_inf only to a kernel that honours it. The vendor
simulations do what their real kernels do (op-plugin's Ascend _fused_adamw_ ignores found_inf;
torch_musa refuses fused Adam and AdamW), checked against torch's own scaler, which trusts them."""

from __future__ import annotations

import math

import pytest
import torch

import amp_backends
from amp_backends.devices import fused
from amp_backends.testing import sim_packages_path

from conftest import run_json
from test_mlu import needs_sim_device

NPU = [sim_packages_path("npu")]
MUSA = [sim_packages_path("musa")]


class IgnoringAdam(torch.optim.Adam):
    """Takes grad_scale and found_inf, reads neither (op-plugin's _fused_adamw_ in Python)."""

    def step(self, closure=None):
        handed = {k: self.__dict__.pop(k) for k in ("grad_scale", "found_inf") if k in self.__dict__}
        try:
            return super().step(closure)
        finally:
            self.__dict__.update(handed)


class AssertingAdam(torch.optim.Adam):
    """Refuses to be handed them, steps without (fused Adam when it first came to mps)."""

    def step(self, closure=None):
        assert getattr(self, "found_inf", None) is None and getattr(self, "grad_scale", None) is None
        return super().step(closure)


class AbsentAdam(torch.optim.Adam):
    def step(self, closure=None):
        raise NotImplementedError("Could not run 'aten::_fused_adam_' with arguments from the 'PrivateUse1' backend.")


class RefusedAdam(torch.optim.Adam):
    def step(self, closure=None):
        raise RuntimeError("torch.optim.Adam(fused=True) is not supported, try the vendor's FusedAdam instead")


def _opt(cls, params=None):
    return cls(params if params is not None else [torch.nn.Parameter(torch.ones(3))], lr=0.1, fused=True)


@pytest.mark.parametrize("cls,status", [(torch.optim.Adam, fused.HONOURS), (torch.optim.AdamW, fused.HONOURS),
                                        (IgnoringAdam, fused.IGNORES), (AssertingAdam, fused.REJECTS),
                                        (AbsentAdam, fused.ABSENT), (RefusedAdam, fused.REFUSED)],
                         ids=["adam", "adamw", "ignores", "rejects", "absent", "refused"])
def test_the_probe_tells_each_behaviour_apart(cls, status):
    kernel = fused.probe(_opt(cls), torch.device("cpu"))
    assert kernel.status == status, kernel
    assert "probed on cpu" in kernel.note
    if status == fused.REFUSED:
        assert "vendor's FusedAdam" in kernel.note, "the extension's own message is kept"


def test_the_probe_also_covers_sgd_with_momentum_and_vendor_optimizers():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9, fused=True)
    assert fused.probe(sgd, torch.device("cpu")).status == fused.HONOURS
    assert fused.kind_of(sgd) == "sgd" and fused.kind_of(_opt(torch.optim.AdamW)) == "adamw"
    assert fused.kind_of(_opt(IgnoringAdam)) == "adam", "a subclass of Adam is an Adam"
    with pytest.raises(ValueError, match="one of honours, ignores"):
        fused.FusedKernel("trusted")


def _backend(**declared):
    cpu = type(amp_backends.get("cpu"))

    class Declaring(cpu):
        name = "cpu-declaring"
        fused_found_inf = declared or None

    return Declaring()


def _overflow_step(scaler, model, opt):
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 3)).sum() * torch.tensor(math.inf)).backward()
    return scaler.step(opt)


@pytest.mark.parametrize("cls", [IgnoringAdam, AssertingAdam], ids=["ignores", "rejects"])
def test_an_untrusted_kernel_is_skipped_from_the_host_probed_or_declared(cls):
    for be in (_backend(), _backend(adam=fused.IGNORES)):  # probed on the device, then declared
        model = torch.nn.Linear(3, 1)
        opt = _opt(cls, model.parameters())
        before = [p.detach().clone() for p in model.parameters()]
        scaler = amp_backends.GradScaler(be, init_scale=16.0)
        _overflow_step(scaler, model, opt)
        scaler.update()
        assert scaler.last_step_skipped and not opt.state, "skipped: the optimizer never ran"
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before)), "the weights did not move"
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 3)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert not scaler.last_step_skipped and not all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
        assert "found_inf" not in vars(opt) and "grad_scale" not in vars(opt)


def test_torchs_own_scaler_trusts_the_ignoring_kernel_ours_does_not():
    """The oracle for the defect: torch.amp.GradScaler hands found_inf to a kernel that ignores it,
    and the overflowed step moves the weights (to NaN here); ours skips it."""
    results = {}
    for kind, scaler in (("torch", torch.amp.GradScaler("cpu", init_scale=16.0)),
                         ("ours", amp_backends.GradScaler(_backend(adam=fused.IGNORES), init_scale=16.0))):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = _opt(IgnoringAdam, model.parameters())
        _overflow_step(scaler, model, opt)
        results[kind] = bool(torch.isfinite(model.weight).all())
    assert results == {"torch": False, "ours": True}


@pytest.mark.parametrize("cls,status", [(AbsentAdam, fused.ABSENT), (RefusedAdam, fused.REFUSED)],
                         ids=["absent", "refused"])
def test_a_kernel_the_device_cannot_run_is_refused_before_anything_changes(cls, status):
    model = torch.nn.Linear(3, 1)
    opt = _opt(cls, model.parameters())
    scaler = amp_backends.GradScaler(_backend(), init_scale=16.0)
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    scaled = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=rf"{cls.__name__}\(fused=True\) cannot run on 'cpu-declaring' \({status}\)"):
        scaler.step(opt)
    assert all(torch.equal(a, p.grad) for a, p in zip(scaled, model.parameters())), "nothing unscaled"
    assert scaler._per_optimizer_states[id(opt)]["stage"].name == "READY"


def test_the_probe_runs_once_per_class_and_defaults():
    be = _backend()
    calls = []
    original = fused.probe

    def counting(optimizer, device):
        calls.append(type(optimizer))
        return original(optimizer, device)

    fused.probe, saved = counting, fused.probe
    try:
        for _ in range(3):
            fused.kernel_of(be, _opt(torch.optim.Adam))
        fused.kernel_of(be, torch.optim.Adam([torch.nn.Parameter(torch.ones(2))], lr=0.5, fused=True))
    finally:
        fused.probe = saved
    assert calls == [torch.optim.Adam, torch.optim.Adam], "cached per class and defaults"


def test_the_builtin_declarations_name_their_sources():
    from amp_backends_plugins.musa import MUSABackend
    from amp_backends_plugins.npu import NPUBackend

    npu, musa = NPUBackend(), MUSABackend()
    assert {k: v[0] for k, v in npu.fused_found_inf.items()} == {"adamw": "ignores", "adam": "absent", "sgd": "honours"}
    assert "FusedAdamWKernelNpuOpApi.cpp" in npu.fused_found_inf["adamw"][1]
    assert {k: v[0] for k, v in musa.fused_found_inf.items()} == {"adam": "refused", "adamw": "refused", "sgd": "honours"}
    from amp_backends_plugins.cpu import CPUBackend
    from amp_backends_plugins.cuda import CUDABackend
    from amp_backends_plugins.mlu import MLUBackend

    for cls in (CPUBackend, CUDABackend, MLUBackend):  # torch's own kernels, torch_mlu's BANG kernels
        assert {k: v[0] for k, v in cls.fused_found_inf.items()} == dict.fromkeys(("adam", "adamw", "sgd"), "honours")


# -- the simulations are no kinder than the devices ------------------------------------------------
NPU_ADAMW = """
import json, math, torch, amp_backends
be = amp_backends.get("npu")
out = {}
for name in ("torch", "ours"):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(be.device())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("npu", init_scale=2.**8) if name == "torch" else be.grad_scaler(init_scale=2.**8)
    before = [p.detach().cpu().clone() for p in model.parameters()]
    loss = model(torch.ones(3, 4, device=be.device())).float().sum() * torch.full((), math.inf, device=be.device())
    scaler.scale(loss).backward()
    scaler.step(opt); scaler.update()
    moved = not all(torch.equal(a, p.detach().cpu()) for a, p in zip(before, model.parameters()))
    out[name] = {"moved": moved, "finite": all(bool(torch.isfinite(p.detach().cpu()).all()) for p in model.parameters())}
    if name == "ours":
        out[name]["skipped"] = scaler.last_step_skipped
        opt.zero_grad()
        scaler.scale(model(torch.ones(3, 4, device=be.device())).float().sum()).backward()
        scaler.step(opt); scaler.update()
        out[name]["clean_step_moves"] = not all(torch.equal(a, p.detach().cpu()) for a, p in zip(before, model.parameters()))
for kind in ("adam", "sgd0"):
    try:
        model = torch.nn.Linear(4, 2).to(be.device())
        opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True) if kind == "adam" else \\
            torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
        scaler = be.grad_scaler(init_scale=2.**8)
        scaler.scale(model(torch.ones(3, 4, device=be.device())).float().sum()).backward()
        scaler.step(opt)
        out[kind] = "ran"
    except Exception as exc:
        out[kind] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@needs_sim_device
@pytest.mark.parametrize("inf_nan", ["1", "0"])
def test_npu_fused_adamw_ignores_found_inf_in_the_simulation_as_on_ascend(inf_nan):
    """op-plugin's _fused_adamw_ never reads found_inf: torch's scaler, trusting it, applies the
    overflowed step (the weights move, to NaN with inf/NaN mode); ours skips it from the host. Fused
    Adam has no NPU kernel; fused SGD without momentum is refused by op-plugin."""
    out = run_json(NPU_ADAMW, NPU, {"AMP_SIM_NPU_INF_NAN": inf_nan})
    assert out["torch"]["moved"], "the simulation is no kinder than Ascend: torch's scaler steps"
    if inf_nan == "1":
        assert not out["torch"]["finite"], "overflowed gradients went into the weights"
    assert out["ours"] == {"moved": False, "finite": True, "skipped": True, "clean_step_moves": True}
    assert out["adam"].startswith("RuntimeError: Adam(fused=True) cannot run on 'npu' (absent)")
    assert "op-plugin registers no _fused_adam_" in out["adam"]
    assert out["sgd0"] == "RuntimeError: momentum must be positive, but got 0.0"


MUSA_ADAM = """
import json, torch, amp_backends
be = amp_backends.get("musa")
out = {}
for cls in ("Adam", "AdamW"):
    model = torch.nn.Linear(4, 2).to(be.device())
    opt = getattr(torch.optim, cls)(model.parameters(), lr=0.1, fused=True)
    try:
        opt.step()  # no gradients: the kernel is never reached, torch returns early
        model(torch.ones(2, 4, device=be.device())).sum().backward()
        opt.step()
        out[cls + "-direct"] = "ran"
    except RuntimeError as exc:
        out[cls + "-direct"] = str(exc)
    scaler = be.grad_scaler(init_scale=4.)
    try:
        scaler.scale(model(torch.ones(2, 4, device=be.device())).sum()).backward()
        scaler.step(opt)
    except RuntimeError as exc:
        out[cls] = str(exc)
sgd_model = torch.nn.Linear(4, 2).to(be.device())
opt = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9, fused=True)
scaler = be.grad_scaler(init_scale=4.)
scaler.scale(sgd_model(torch.ones(2, 4, device=be.device())).sum()).backward()
scaler.step(opt); scaler.update()
out["sgd"] = scaler.last_step_skipped
print(json.dumps(out))
"""


@needs_sim_device
def test_musa_refuses_fused_adam_and_adamw_as_torch_musa_does():
    out = run_json(MUSA_ADAM, MUSA)
    assert out["Adam-direct"] == "torch.optim.Adam(fused=True) is not supported, try torch_musa.optim.FusedAdam instead"
    assert out["AdamW-direct"] == "torch.optim.AdamW(fused=True) is not supported, try torch_musa.optim.FusedAdamW instead"
    assert out["Adam"].startswith("Adam(fused=True) cannot run on 'musa' (refused): ") and "FusedAdam" in out["Adam"]
    assert "torch_musa.optim.FusedAdamW" in out["AdamW"]
    assert out["sgd"] is False, "fused SGD runs"
