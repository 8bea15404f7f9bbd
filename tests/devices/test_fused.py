"""Fused optimizers and found_inf: what a device's kernel does is declared or probed
(amp_backends.devices.fused), and the scaler hands found_inf only to a kernel that honours it. The vendor
simulations do what their real kernels do (op-plugin's Ascend _fused_adamw_ ignores found_inf;
torch_musa refuses fused Adam and AdamW), checked against torch's own scaler, which trusts them."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import amp_backends
from amp_backends.devices import fused
from amp_backends.scaler.treatment import Treatment
from amp_backends.testing import sim_packages_path

from conftest import run_json
from sim_marks import needs_sim_device

NPU = [sim_packages_path("npu")]
MUSA = [sim_packages_path("musa")]
#: Whether this torch's Adagrad(fused=True) takes part in the grad_scale/found_inf protocol (2.13 does,
#: 2.11 does not: its scaler steps it as a plain optimizer).
def _fused_adagrad() -> torch.optim.Adagrad | None:
    try:
        return torch.optim.Adagrad([torch.zeros(1, requires_grad=True)], fused=True)
    except (TypeError, RuntimeError):  # a torch without fused Adagrad
        return None


ADAGRAD_TAKES_FOUND_INF = bool(getattr(_fused_adagrad(), "_step_supports_amp_scaling", False))


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


class _ScaleBlind:
    """Honours found_inf, never divides by grad_scale: a kernel that skips on the device and steps on
    the gradients as they are (the defect torch's scaler cannot see)."""

    _step_supports_amp_scaling = True

    def step(self, closure=None):
        handed = {k: self.__dict__.pop(k) for k in ("grad_scale", "found_inf") if k in self.__dict__}
        try:
            found_inf = handed.get("found_inf")
            if found_inf is not None and float(found_inf.item()) == 1:
                return None
            return super().step(closure)
        finally:
            self.__dict__.update(handed)


class ScaleBlindSGD(_ScaleBlind, torch.optim.SGD):
    pass


class ScaleBlindAdam(_ScaleBlind, torch.optim.Adam):
    pass


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


@pytest.mark.parametrize("make,status", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True), fused.HONOURS),
    (lambda p: torch.optim.SGD(p, lr=0.1, fused=True), fused.HONOURS),
    (lambda p: torch.optim.Adagrad(p, lr=0.1, fused=True), fused.HONOURS),
    (lambda p: ScaleBlindSGD(p, lr=0.1), fused.SCALE_BLIND),
    (lambda p: ScaleBlindSGD(p, lr=0.1, momentum=0.9), fused.SCALE_BLIND),
    # Adam's step on a parameter barely depends on the gradient's scale: the probe compares its state too
    (lambda p: ScaleBlindAdam(p, lr=0.1), fused.SCALE_BLIND),
], ids=["sgd-momentum", "sgd", "adagrad", "scale-blind-sgd", "scale-blind-sgd-momentum", "scale-blind-adam"])
def test_the_probe_tells_a_kernel_that_skips_and_divides_from_one_that_only_skips(make, status):
    """Handed found_inf = 0 and grad_scale = 1024 with the gradient multiplied by it, torch's fused
    kernels step as the unfused optimizer does on the unscaled gradient; a kernel that skips on found_inf
    but never divides steps on the scaled one. The probe of torch's own kernels here is the reference."""
    kernel = fused.probe(make([torch.nn.Parameter(torch.ones(3))]), torch.device("cpu"))
    assert kernel.status == status, kernel
    if status == fused.SCALE_BLIND:
        assert "steps on the gradient still multiplied by grad_scale" in kernel.note


def test_the_probe_also_covers_sgd_with_momentum_and_vendor_optimizers():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9, fused=True)
    assert fused.probe(sgd, torch.device("cpu")).status == fused.HONOURS
    assert fused.kind_of(sgd) == "sgd" and fused.kind_of(_opt(torch.optim.AdamW)) == "adamw"
    assert fused.kind_of(_opt(torch.optim.Adagrad)) == "adagrad"
    assert fused.kind_of(_opt(IgnoringAdam)) == "adam", "a subclass of Adam is an Adam"
    with pytest.raises(ValueError, match="one of honours, ignores"):
        fused.FusedOptimizerKernel("trusted")


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


def _train(scaler, opt, model, steps=(False, True, False, False, True, False)):
    """Steps on fixed data, the loss made inf on the steps marked True; the parameters after each."""
    seen = []
    for i, poison in enumerate(steps):
        opt.zero_grad()
        loss = (model(torch.linspace(-1, 1, 6).reshape(2, 3) * (i + 1)) ** 2).sum()
        if poison:
            loss = loss * torch.tensor(math.inf)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        seen.append([p.detach().clone() for p in model.parameters()])
    return seen


@pytest.mark.parametrize("cls,unfused", [(ScaleBlindSGD, {"momentum": 0.9}), (ScaleBlindSGD, {}),
                                         (ScaleBlindAdam, {})],
                         ids=["sgd-momentum", "sgd", "adam"])
def test_a_scale_blind_kernel_trains_as_torchs_scaler_with_the_unfused_optimizer(cls, unfused):
    """The oracle: torch.amp.GradScaler with the unfused optimizer. Ours probes the stand-in (it skips
    on found_inf, never divides by grad_scale), unscales its gradients first and hands it found_inf with
    grad_scale None: the parameters after every step, skipped ones too, are torch's. torch's own scaler,
    handing it grad_scale, trains on gradients multiplied by the loss scale."""
    base = (torch.optim.Adam if cls is ScaleBlindAdam else torch.optim.SGD)
    runs = {}
    for name in ("oracle", "ours", "torch"):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        if name == "oracle":
            opt = base(model.parameters(), lr=0.1, foreach=False, **unfused)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        else:
            opt = cls(model.parameters(), lr=0.1, foreach=False, **unfused)
            scaler = (amp_backends.GradScaler(_backend(), init_scale=2.0**10) if name == "ours" else
                      torch.amp.GradScaler("cpu", init_scale=2.0**10))
        runs[name] = _train(scaler, opt, model)
        if name == "ours":
            assert scaler._treatment(opt) is Treatment.UNSCALED_FUSED, scaler._treatment(opt)
            assert fused.fused_kernel_of(scaler.backend, opt).status is fused.FusedStatus.SCALE_BLIND
            assert "found_inf" not in vars(opt) and "grad_scale" not in vars(opt)
    for step, (ours, oracle) in enumerate(zip(runs["ours"], runs["oracle"])):
        assert all(torch.equal(a, b) for a, b in zip(ours, oracle)), f"step {step}: {ours} != {oracle}"
    final = zip(runs["torch"][-1], runs["oracle"][-1])
    assert not all(torch.allclose(a, b, rtol=1e-3) for a, b in final), "torch's scaler trusts the kernel with grad_scale"


def test_a_scale_blind_declaration_unscales_first_and_gives_torchs_fused_result():
    """Declared scale_blind, torch's own fused Adam (which would divide) is handed found_inf with
    grad_scale None after the scaler unscaled: torch's result with the kernel dividing, bitwise (the
    scale is a power of two: dividing and multiplying by the inverse agree)."""
    runs = {}
    for name, scaler in (("torch", lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10)),
                         ("ours", lambda: amp_backends.GradScaler(_backend(adam=fused.SCALE_BLIND), init_scale=2.0**10))):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        runs[name] = _train(scaler(), _opt(torch.optim.Adam, model.parameters()), model)
    for ours, theirs in zip(runs["ours"], runs["torch"]):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_a_grad_scale_set_on_an_optimizer_whose_kernel_ignores_it_is_refused():
    model = torch.nn.Linear(3, 1)
    opt = ScaleBlindSGD(model.parameters(), lr=0.1)
    scaler = amp_backends.GradScaler(_backend(sgd=fused.SCALE_BLIND), init_scale=16.0)
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    scaler.unscale_(opt)
    opt.grad_scale = torch.tensor(2.0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"does not divide by grad_scale .*multiply the gradients yourself"):
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_the_conformance_suite_catches_a_kernel_declared_to_divide_that_does_not(monkeypatch):
    """torch's fused SGD made scale-blind (it skips on found_inf, drops grad_scale): a backend declaring
    it ``honours`` fails both conformance checks, saying what to declare; one declaring it
    ``scale_blind`` passes them (the scaler unscales first)."""
    from amp_backends.testing import test_conformance_backend as suite

    real = torch._fused_sgd_

    def scale_blind(*args, grad_scale=None, found_inf=None, **kwargs):
        if found_inf is not None and float(found_inf.item()) == 1:
            return None
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_sgd_", scale_blind)
    honest, wrong = _backend(sgd=fused.SCALE_BLIND), _backend(sgd=fused.HONOURS)
    suite.test_fused_kernels_do_what_the_backend_declares(honest, "sgd")
    suite.test_a_skipped_fused_step_leaves_the_weights_alone(honest, "sgd")
    with pytest.raises(AssertionError, match="declare {'sgd': 'scale_blind'}"):
        suite.test_fused_kernels_do_what_the_backend_declares(wrong, "sgd")
    with pytest.raises(AssertionError, match="the weights differ from the unfused optimizer's"):
        suite.test_a_skipped_fused_step_leaves_the_weights_alone(wrong, "sgd")


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


@pytest.mark.skipif(_fused_adagrad() is None, reason="this torch has no Adagrad(fused=True)")
def test_a_fused_optimizer_outside_the_protocol_steps_plainly_or_is_refused():
    """torch 2.11's Adagrad(fused=True) sets no _step_supports_amp_scaling: torch's scaler unscales and steps it
    as a plain optimizer. Ours does the same where the device has the kernel, and refuses it, before anything
    changes, where the device declares none (rather than torch's dispatcher error after the unscale)."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1, fused=True)
    opt._step_supports_amp_scaling = False  # as torch 2.11 builds it
    assert fused.runs_fused_kernel(opt) and not fused.runs_fused_kernel(torch.optim.Adagrad(model.parameters()))
    absent = amp_backends.GradScaler(_backend(adagrad=fused.ABSENT), init_scale=16.0)
    absent.scale(model(torch.ones(2, 3)).sum()).backward()
    scaled = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"Adagrad\(fused=True\) cannot run on 'cpu-declaring' \(absent\)"):
        absent.step(opt)
    assert all(torch.equal(a, p.grad) for a, p in zip(scaled, model.parameters())), "nothing unscaled"
    # where the kernel exists: torch's own scaler on the same optimizer is the reference
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.Adagrad(reference.parameters(), lr=0.1, fused=True)
    ref_opt._step_supports_amp_scaling = False
    for m, o, scaler in ((model, opt, amp_backends.GradScaler(_backend(), init_scale=16.0)),
                         (reference, ref_opt, torch.amp.GradScaler("cpu", init_scale=16.0))):
        o.zero_grad()
        scaler.scale(m(torch.ones(2, 3)).sum()).backward()
        scaler.step(o)
        scaler.update()
    assert amp_backends.GradScaler(_backend(), init_scale=16.0)._treatment(opt) is Treatment.PLAIN
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


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
            fused.fused_kernel_of(be, _opt(torch.optim.Adam))
        fused.fused_kernel_of(be, torch.optim.Adam([torch.nn.Parameter(torch.ones(2))], lr=0.5, fused=True))
    finally:
        fused.probe = saved
    assert calls == [torch.optim.Adam, torch.optim.Adam], "cached per class and defaults"


def test_the_builtin_declarations_name_their_sources(monkeypatch):
    from amp_backends_plugins.cpu import CPUBackend
    from amp_backends_plugins.cuda import CUDABackend
    from amp_backends_plugins.mlu import MLUBackend
    from amp_backends_plugins.musa import MUSABackend
    from amp_backends_plugins.npu import NPUBackend

    for var in ("TORCH_NPU_FALLBACK_CPU_DISABLE", "ENABLE_FALLBACK_TO_CPU"):
        monkeypatch.delenv(var, raising=False)
    def statuses(be):
        return {k: v[0] for k, v in be.fused_found_inf.items()}

    npu, musa = NPUBackend(), MUSABackend()
    assert statuses(npu) == {"adamw": "ignores", "adam": "honours", "sgd": "scale_blind", "adagrad": "honours"}
    assert "FusedAdamWKernelNpuOpApi.cpp" in npu.fused_found_inf["adamw"][1]
    assert "aclnnFusedSgd" in npu.fused_found_inf["sgd"][1] and "npu_cpu_fallback" in npu.fused_found_inf["adam"][1]
    assert statuses(musa) == {"adam": "refused", "adamw": "refused", "sgd": "honours", "adagrad": "absent"}
    assert "musa_functions.yaml" in musa.fused_found_inf["adagrad"][1]
    # torch's own kernels, torch_mlu's BANG kernels (Adagrad: torch_mlu's CPU fallback runs torch's)
    kinds = ("adam", "adamw", "sgd", "adagrad")
    for be in (CPUBackend(), MLUBackend()):
        assert statuses(be) == dict.fromkeys(kinds, "honours"), be.name
    from amp_backends_plugins.cuda import torch_release

    assert statuses(CUDABackend()) == dict.fromkeys(kinds if torch_release() >= (2, 13) else kinds[:3], "honours")
    assert "fused_adagrad_utils.cuh" in CUDABackend().fused_found_inf.get("adagrad", ("", "fused_adagrad_utils.cuh"))[1]
    # the CPU fallback turned off: no kernel for what op-plugin and torch_mlu do not register
    monkeypatch.setenv("TORCH_NPU_FALLBACK_CPU_DISABLE", "1")
    monkeypatch.setenv("ENABLE_FALLBACK_TO_CPU", "off")
    assert statuses(npu) == {"adamw": "ignores", "adam": "absent", "sgd": "scale_blind", "adagrad": "absent"}
    assert "TORCH_NPU_FALLBACK_CPU_DISABLE" in npu.fused_found_inf["adagrad"][1]
    assert statuses(MLUBackend())["adagrad"] == "absent" and "ENABLE_FALLBACK_TO_CPU=0" in \
        MLUBackend().fused_found_inf["adagrad"][1]
    monkeypatch.setenv("TORCH_NPU_FALLBACK_CPU_DISABLE", "0")
    assert statuses(npu)["adam"] == "honours", "0 leaves torch_npu's fallback on (strtol, non-zero turns it off)"


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
for kind in ("adam", "adagrad", "sgd0"):
    try:
        model = torch.nn.Linear(4, 2).to(be.device())
        opt = (torch.optim.Adam if kind == "adam" else torch.optim.Adagrad if kind == "adagrad" else
               torch.optim.SGD)(model.parameters(), lr=0.1, fused=True)
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
    Adam and Adagrad have no NPU kernel and run on torch_npu's CPU fallback; fused SGD without momentum
    is refused by op-plugin."""
    out = run_json(NPU_ADAMW, NPU, {"AMP_SIM_NPU_INF_NAN": inf_nan})
    assert out["torch"]["moved"], "the simulation is no kinder than Ascend: torch's scaler steps"
    if inf_nan == "1":
        assert not out["torch"]["finite"], "overflowed gradients went into the weights"
    assert out["ours"] == {"moved": False, "finite": True, "skipped": True, "clean_step_moves": True}
    assert out["adam"] == out["adagrad"] == "ran"
    assert out["sgd0"] == "RuntimeError: momentum must be positive, but got 0.0"


NPU_FUSED = """
import json, math, warnings, torch, amp_backends, torch_npu
torch_npu.npu.set_option({"ACL_PRECISION_MODE": "must_keep_origin_dtype"})  # float32 in float32, as on the CPU
be = amp_backends.get("npu")
MAKE = {"adam": lambda p, **k: torch.optim.Adam(p, lr=0.1, **k),
        "adagrad": lambda p, **k: torch.optim.Adagrad(p, lr=0.1, **k),
        "sgd": lambda p, **k: torch.optim.SGD(p, lr=0.1, momentum=0.9, **k)}
def train(kind, dev, kw, scaler):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(dev)
    opt = MAKE[kind](model.parameters(), **kw)
    for i, poison in enumerate((False, True, False, False)):
        opt.zero_grad()
        loss = (model(torch.linspace(-1, 1, 12, device=dev).reshape(3, 4) * (i + 1)) ** 2).sum()
        if poison:
            loss = loss * torch.full((), math.inf, device=dev)
        scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    return [p.detach().cpu() for p in model.parameters()], opt
same = lambda a, b: all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))
out = {}
for kind in MAKE:
    oracle, _ = train(kind, "cpu", {"fused": False, "foreach": False}, torch.amp.GradScaler("cpu", init_scale=2.**8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            scaler = be.grad_scaler(init_scale=2.**8)
            ours, opt = train(kind, be.device(), {"fused": True}, scaler)
        except Exception as exc:
            out[kind] = f"{type(exc).__name__}: {exc}"
            continue
    trusting, _ = train(kind, be.device(), {"fused": True}, torch.amp.GradScaler("npu", init_scale=2.**8))
    out[kind] = {"ours_is_unfused": same(ours, oracle), "torch_scaler_is_unfused": same(trusting, oracle),
                 "treatment": scaler._treatment(opt).name,
                 "fell_back": sorted({str(w.message) for w in caught if "fall back to run on the CPU" in str(w.message)})}
try:
    p = torch.nn.Parameter(torch.ones(3, device=be.device()))
    p.grad = torch.ones(3, device=be.device())
    torch.optim.Adagrad([p], lr=0.1, fused=True).step()
    out["adagrad-direct"] = "ran"
except Exception as exc:
    out["adagrad-direct"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@needs_sim_device
def test_npu_fused_optimizers_through_the_scaler_train_as_the_unfused_ones_on_the_cpu():
    """The oracle: torch's scaler with the unfused optimizer on the CPU. On the simulated Ascend, ours
    matches it with every fused kind. op-plugin's _fused_sgd_ skips on found_inf and hands grad_scale to
    CANN, which the simulation (harsher than what op-plugin shows) never divides by: torch's scaler,
    handing it grad_scale, trains on scaled gradients; ours unscales first. Fused Adam and Adagrad run
    on torch_npu's CPU fallback, with its warning, and honour both."""
    out = run_json(NPU_FUSED, NPU)
    for kind in ("adam", "adagrad", "sgd"):
        assert out[kind]["ours_is_unfused"], (kind, out[kind])
    assert out["sgd"]["treatment"] == "UNSCALED_FUSED" and out["sgd"]["torch_scaler_is_unfused"] is False
    assert out["adam"]["treatment"] == "FUSED"
    # torch 2.11's Adagrad(fused=True) takes no grad_scale/found_inf (no _step_supports_amp_scaling): torch's scaler
    # unscales first and skips from the host, and so does ours
    assert out["adagrad"]["treatment"] == ("FUSED" if ADAGRAD_TAKES_FOUND_INF else "PLAIN")
    assert out["adam"]["torch_scaler_is_unfused"] and out["adagrad"]["torch_scaler_is_unfused"]
    for kind, op in (("adam", "_fused_adam_"), ("adagrad", "_fused_adagrad_")):
        assert out[kind]["fell_back"] == [f"CAUTION: The operator 'aten::{op}' is not currently supported on the NPU "
                                          "backend and will fall back to run on the CPU. This may have performance "
                                          "implications."]
    assert out["adagrad-direct"] == "ran"


@needs_sim_device
def test_npu_without_its_cpu_fallback_refuses_what_op_plugin_has_no_kernel_for():
    out = run_json(NPU_FUSED, NPU, {"TORCH_NPU_FALLBACK_CPU_DISABLE": "1"})
    for kind in ("adam", "adagrad"):
        assert out[kind].startswith(f"RuntimeError: {kind.title()}(fused=True) cannot run on 'npu' (absent)")
        assert "TORCH_NPU_FALLBACK_CPU_DISABLE" in out[kind]
    assert out["adagrad-direct"] == (
        "RuntimeError: The operator 'aten::_fused_adagrad_' would execute its main computation on CPU through "
        "dispatcher backend fallback because no kernel is registered for the NPU PrivateUse1 backend, but CPU fallback "
        "is disabled by TORCH_NPU_FALLBACK_CPU_DISABLE=1.")
    assert out["sgd"]["ours_is_unfused"], "op-plugin's own kernels are unaffected"


MUSA_ADAM = """
import json, torch, amp_backends
be = amp_backends.get("musa")
out = {}
for cls in ("Adam", "AdamW", "Adagrad"):
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
def test_musa_refuses_fused_adam_adamw_and_adagrad_as_torch_musa_does():
    out = run_json(MUSA_ADAM, MUSA)
    assert out["Adam-direct"] == "torch.optim.Adam(fused=True) is not supported, try torch_musa.optim.FusedAdam instead"
    assert out["AdamW-direct"] == "torch.optim.AdamW(fused=True) is not supported, try torch_musa.optim.FusedAdamW instead"
    assert out["Adam"].startswith("Adam(fused=True) cannot run on 'musa' (refused): ") and "FusedAdam" in out["Adam"]
    assert "torch_musa.optim.FusedAdamW" in out["AdamW"]
    # no _fused_adagrad_ in torch_musa and no CPU fallback: the dispatcher's error, refused by the scaler
    assert out["Adagrad-direct"].startswith("Could not run 'aten::_fused_adagrad_' with arguments from the")
    assert out["Adagrad"].startswith("Adagrad(fused=True) cannot run on 'musa' (absent): ")
    assert "torch_musa registers no _fused_adagrad_" in out["Adagrad"]
    assert out["sgd"] is False, "fused SGD runs"


def test_a_status_declared_as_a_string_is_the_enum_member_and_the_old_names_warn():
    """Plugins declare statuses as strings (``{"adam": "honours"}``): the same FusedStatus, compared
    and formatted as the string; the earlier names answer the new ones with a DeprecationWarning."""
    declared = fused.fused_kernel_of(_backend(adam="honours"), _opt(torch.optim.Adam))
    assert declared.status is fused.FusedStatus.HONOURS and declared.status == "honours"
    assert f"{declared.status}" == str(declared.status) == "honours"
    assert fused.HONOURS is fused.FusedStatus.HONOURS and set(fused.STATUSES) == set(fused.FusedStatus)
    scaler = amp_backends.GradScaler(_backend(adam="scale_blind"), init_scale=16.0)
    assert scaler._treatment(_opt(torch.optim.Adam)) is Treatment.UNSCALED_FUSED
    from amp_backends.gradients import executor

    for module, old, new in ((fused, "FusedKernel", fused.FusedOptimizerKernel),
                             (fused, "kernel_of", fused.fused_kernel_of),
                             (executor, "run_", executor.run_on_groups_)):
        with pytest.warns(DeprecationWarning, match=f"{old} is now {new.__name__}.*0.3.0"):
            assert getattr(module, old) is new
    with pytest.raises(AttributeError, match="no attribute 'kernel_off'"):
        fused.kernel_off  # noqa: B018 - the attribute access is what is tested
