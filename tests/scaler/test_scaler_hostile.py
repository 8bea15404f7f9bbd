"""GradScaler against a hostile review: each case beside torch.amp.GradScaler("cpu") doing the same
thing (the independent reference) wherever torch behaves correctly. The cases: a grad_scale the user
sets on fused SGD with momentum, a disabled scaler for a device this machine lacks, process_group
"world" without torch.distributed, set_growth_interval below the tracker, optimizers that cannot be
weak keys, a probed subclass whose constructor needs more, and scales whose reciprocal overflows."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch.amp.grad_scaler import OptState

import amp_backends
from amp_backends import GradScaler, StateDictError
from amp_backends.testing import sim_packages_path

from conftest import cpu_only_env, run_json
from sim_marks import needs_sim_device

MakeScaler = Callable[..., torch.amp.GradScaler]
BOTH: dict[str, MakeScaler] = {"ours": GradScaler, "torch": torch.amp.GradScaler}


def _linear(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 2)


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _bitwise(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> bool:
    left, right = list(a), list(b)
    return len(left) == len(right) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(left, right))


def _backward(scaler: torch.amp.GradScaler, model: torch.nn.Module, step: int) -> None:
    """A fresh batch's scaled loss, backward (the same data for every scaler at ``step``)."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(100 + step))
    scaler.scale(model(x).pow(2).sum()).backward()


def _expected_scales(scale: float, tracker: int, interval: int, steps: int, growth: float = 2.0) -> list[float]:
    """The scale after each of ``steps`` clean steps, by hand: torch's update rule."""
    out = []
    for _ in range(steps):
        tracker += 1
        if tracker == interval:
            scale, tracker = scale * growth, 0
        out.append(scale)
    return out


# -- 1: a grad_scale the user sets holds for one step ---------------------------------------
def _fused_sgd_run(make: MakeScaler) -> tuple[list[list[torch.Tensor]], list[bool]]:
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    scaler = make("cpu", init_scale=64.0)
    trajectory, left_on = [], []
    for step in range(4):
        opt.zero_grad()
        _backward(scaler, model, step)
        if step == 0:  # the first step of fused SGD with momentum: no momentum buffer yet
            scaler.unscale_(opt)
            opt.grad_scale = torch.tensor(2.0)  # type: ignore[attr-defined]  # torch's fused protocol
        scaler.step(opt)
        scaler.update()
        trajectory.append(_params(model))
        left_on.append(hasattr(opt, "grad_scale") or hasattr(opt, "found_inf"))
    return trajectory, left_on


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 5),
                    reason="torch 2.4's scaler discards a grad_scale set after unscale_ (docs/scaler.md): no reference")
def test_user_grad_scale_on_fused_sgd_first_step_holds_for_that_step_only():
    """fused SGD + momentum, grad_scale set after unscale_ at step 0: 4 steps bitwise torch's, nothing left on."""
    ours, ours_left = _fused_sgd_run(GradScaler)
    ref, ref_left = _fused_sgd_run(torch.amp.GradScaler)
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert _bitwise(a, b), f"step {step} differs from torch's scaler"
    assert ours_left == [False] * 4 and ref_left == [False] * 4


# -- 2: a disabled scaler for a device this machine may lack --------------------------------
@pytest.mark.parametrize("build", [
    lambda kind: kind(device="cuda", enabled=False),
    lambda kind: kind("cuda", enabled=False),
], ids=["device-kwarg", "positional"])
def test_disabled_cuda_scaler_steps_as_torchs_disabled_scaler(build: Callable[[MakeScaler], Any]):
    """GradScaler("cuda", enabled=False) builds with or without CUDA and forwards as torch's disabled one."""
    runs = {}
    for name, kind in BOTH.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scaler = build(kind)
        assert not scaler.is_enabled(), name
        model = _linear()  # on the CPU: a disabled scaler only forwards
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(2):
            opt.zero_grad()
            _backward(scaler, model, step)
            scaler.step(opt)
            scaler.update()
        runs[name] = _params(model)
    assert _bitwise(runs["ours"], runs["torch"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here: an enabled cuda scaler is usable")
def test_enabled_cuda_scaler_without_cuda_is_refused():
    """An enabled GradScaler("cuda") on a machine without CUDA still names why (torch disables itself)."""
    with pytest.raises(amp_backends.BackendUnavailableError):
        GradScaler("cuda")


# -- 3: process_group "world" without torch.distributed -------------------------------------
def test_world_group_without_init_is_refused_before_any_gradient_changes():
    """unscale_ raises naming init_process_group, gradients bitwise unchanged, stage READY, twice."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=1024.0, process_group="world")
    reference = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _backward(scaler, model, 0)
    grads = [p.grad.clone() for p in model.parameters()]
    twin = _linear()
    _backward(reference, twin, 0)  # torch's scaled gradients: the same values
    assert _bitwise(grads, [p.grad for p in twin.parameters()])
    for _ in range(2):
        with pytest.raises(RuntimeError, match="init_process_group"):
            scaler.unscale_(opt)
        assert _bitwise([p.grad for p in model.parameters()], grads), "the gradients were divided"
        assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY


# -- 4: set_growth_interval below the tracker -----------------------------------------------
def _clean_steps(scaler: torch.amp.GradScaler, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 steps: int, start: int = 0) -> list[float]:
    scales = []
    for step in range(start, start + steps):
        opt.zero_grad()
        _backward(scaler, model, step)
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    return scales


def test_shorter_growth_interval_leaves_the_tracker_one_short_and_the_scale_grows():
    """set_growth_interval(3) after 5 clean steps: tracker 2, then the scale grows as torch's rule says."""
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradScaler("cpu", init_scale=1024.0, growth_interval=2000)
    assert _clean_steps(scaler, model, opt, 5) == [1024.0] * 5
    scaler.set_growth_interval(3)
    state = scaler.state_dict()
    assert state["_growth_tracker"] == 2 and state["growth_interval"] == 3
    expected = _expected_scales(1024.0, 2, 3, 7)
    assert expected == [2048.0, 2048.0, 2048.0, 4096.0, 4096.0, 4096.0, 8192.0]
    # torch's scaler, loaded with that state (a tracker below the interval), grows the same way
    reference = torch.amp.GradScaler("cpu")
    reference.load_state_dict(state)
    twin = _linear()
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.0)
    assert _clean_steps(reference, twin, twin_opt, 7, start=5) == expected
    assert _clean_steps(scaler, model, opt, 7, start=5) == expected


def test_shorter_growth_interval_before_the_first_step():
    """A tracker loaded before the first scale() and an interval set below it: one short, too."""
    scaler = GradScaler("cpu")
    scaler.load_state_dict({"scale": 16.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                            "growth_interval": 2000, "_growth_tracker": 5})
    scaler.set_growth_interval(3)
    assert scaler.state_dict()["_growth_tracker"] == 2
    model = _linear()
    assert _clean_steps(scaler, model, torch.optim.SGD(model.parameters(), lr=0.0), 4) == _expected_scales(16.0, 2, 3, 4)


def test_torch_state_dict_with_tracker_past_the_interval_loads_one_short():
    """torch's scaler after the same set_growth_interval saves tracker 5 >= 3: ours loads it as 2, warning."""
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    source = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2000)
    _clean_steps(source, model, opt, 5)
    source.set_growth_interval(3)
    saved = source.state_dict()
    assert saved["_growth_tracker"] >= saved["growth_interval"]  # what torch's setter leaves
    scaler = GradScaler("cpu")
    with pytest.warns(RuntimeWarning, match="_growth_tracker"):
        scaler.load_state_dict(saved)
    assert scaler.state_dict() == {**saved, "_growth_tracker": 2}
    assert _clean_steps(scaler, model, opt, 4, start=5) == _expected_scales(1024.0, 2, 3, 4)


# -- 5: optimizers that cannot be weak keys -------------------------------------------------
class EqSGD(torch.optim.SGD):
    """An SGD subclass defining __eq__ (Python sets __hash__ = None): two with equal defaults compare equal."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EqSGD) and self.defaults == other.defaults


class SlotOptimizer:
    """A duck-typed optimizer without __weakref__ (torch's scaler needs param_groups and step)."""

    __slots__ = ("inner", "param_groups")

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 0.1) -> None:
        self.inner = torch.optim.SGD(params, lr=lr, momentum=0.9)
        self.param_groups = self.inner.param_groups

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.step(*args, **kwargs)

    def zero_grad(self) -> None:
        self.inner.zero_grad()


def _two_optimizers_run(make: MakeScaler, make_opt: Callable[[list[torch.nn.Parameter]], Any]
                        ) -> tuple[list[list[torch.Tensor]], list[float]]:
    model = _linear()
    opts = [make_opt([model.weight]), make_opt([model.bias])]  # equal under __eq__, distinct objects
    scaler = make("cpu", init_scale=4.0)
    trajectory, scales = [], []
    for step in range(4):
        for opt in opts:
            opt.zero_grad()
        _backward(scaler, model, step)
        if step == 2:
            model.weight.grad[0, 1] = math.inf  # this step is skipped, the scale backs off
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        trajectory.append(_params(model))
        scales.append(float(scaler.get_scale()))
    return trajectory, scales


@pytest.mark.parametrize("make_opt", [lambda p: EqSGD(p, lr=0.1, momentum=0.9), SlotOptimizer],
                         ids=["sgd-subclass-with-eq", "duck-typed-slots"])
def test_optimizers_that_cannot_be_weak_keys_step_as_torch_steps_them(make_opt: Callable[[Any], Any]):
    """Unhashable / non-weak-referenceable optimizers: 4 steps (one with an inf) bitwise torch's."""
    ours, ours_scales = _two_optimizers_run(GradScaler, make_opt)
    ref, ref_scales = _two_optimizers_run(torch.amp.GradScaler, make_opt)
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert _bitwise(a, b), f"step {step} differs from torch's scaler"
    assert ours_scales == ref_scales == [4.0, 4.0, 2.0, 2.0]
    # found_inf is per optimizer, as torch keeps it: the weight's optimizer skips, the bias's steps
    assert _bitwise(ours[1][:1], ours[2][:1]) and not _bitwise(ours[1][1:], ours[2][1:])


# -- 6: a probed subclass whose constructor needs more -------------------------------------
SIM_CUSTOM_INIT = """
import json, math, torch, amp_backends
from amp_backends import GradScaler
be = amp_backends.get(); dev = be.device()

class ScheduledAdamW(torch.optim.AdamW):
    def __init__(self, params, schedule_name, lr=1e-3):
        super().__init__(params, lr=lr, fused=True)
        self.schedule_name = schedule_name

def run(make):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(dev)
    opt = ScheduledAdamW(model.parameters(), "cosine", lr=0.01)
    scaler, out = make(), []
    for step in range(3):
        opt.zero_grad()
        loss = model(torch.randn(3, 4).to(dev)).pow(2).sum()
        if step == 1:
            loss = loss * torch.full((), math.inf, device=dev)
        scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
        out.append([p.detach().cpu().reshape(-1).tolist() for p in model.parameters()] + [scaler.get_scale()])
    return out

try:
    ours, error = run(lambda: GradScaler(be, init_scale=2.0**10)), None
except Exception as exc:
    ours, error = None, f"{type(exc).__name__}: {exc}"
ref = run(lambda: torch.amp.GradScaler(dev.type, init_scale=2.0**10))
print(json.dumps({"backend": be.name, "ours": ours, "torch": ref, "error": error}))
"""


@needs_sim_device
@pytest.mark.skipif(not hasattr(torch, "accelerator"), reason="the generic backend needs torch.accelerator (2.6+)")
def test_fused_adamw_subclass_with_extra_constructor_argument_on_the_generic_backend():
    """On the simulated 'sim' device: AdamW(fused=True) subclass taking a schedule name steps as torch's."""
    out = run_json(SIM_CUSTOM_INIT, [sim_packages_path("generic")], cpu_only_env())
    assert out["backend"] == "sim"
    assert out["error"] is None, out["error"]
    assert out["ours"] == out["torch"], "parameters or scales differ from torch's scaler"
    assert [row[-1] for row in out["ours"]] == [1024.0, 512.0, 512.0]


# -- 7: scales whose float32 reciprocal overflows ------------------------------------------
def test_init_scale_with_an_overflowing_reciprocal_is_refused():
    """init_scale=1e-40 (float32 subnormal, 1/scale inf) is a ValueError (torch takes it)."""
    for value in (1e-40, torch.tensor(1e-40)):
        with pytest.raises(ValueError, match="reciprocal|does not fit a float32|> 0"):
            GradScaler("cpu", init_scale=value)
    torch.amp.GradScaler("cpu", init_scale=1e-40)  # torch builds it; its unscale would multiply by inf


@pytest.mark.parametrize("value", [1e-40, torch.tensor(1e-40)], ids=["float", "tensor"])
def test_update_to_a_scale_with_an_overflowing_reciprocal_is_refused(value: Any):
    """update(1e-40) is a ValueError and the scale stays; a plain update() then matches torch's."""
    runs = {}
    for name, kind in BOTH.items():
        model = _linear()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = kind("cpu", init_scale=8.0)
        _backward(scaler, model, 0)
        scaler.step(opt)
        if name == "ours":
            with pytest.raises(ValueError, match="reciprocal|does not fit a float32|> 0"):
                scaler.update(value)
            assert scaler.get_scale() == 8.0
        scaler.update()
        runs[name] = (float(scaler.get_scale()), _params(model))
    assert runs["ours"][0] == runs["torch"][0] == 8.0
    assert _bitwise(runs["ours"][1], runs["torch"][1])


def test_state_dict_scale_with_an_overflowing_reciprocal_is_refused():
    """load_state_dict of scale 1e-40 is a StateDictError and changes nothing (torch takes it)."""
    scaler = GradScaler("cpu", init_scale=16.0)
    before = scaler.state_dict()
    with pytest.raises(StateDictError):
        scaler.load_state_dict({**before, "scale": 1e-40})
    assert scaler.state_dict() == before


def test_a_scale_backs_off_no_further_than_a_finite_reciprocal():
    """backoff 2**-4 from 2**-100 by 7 NaN steps would reach 2**-128 (1/scale inf in float32): ours stops at
    2**-126 (its host stats say the same) and the next clean step steps on finite gradients, as a step at
    that scale does; torch's reaches 2**-128, its op checks the gradients before multiplying them by inf,
    steps, and writes inf into the weights."""
    runs: dict[str, tuple[list[torch.Tensor], list[torch.Tensor], torch.amp.GradScaler]] = {}
    for name, kind in BOTH.items():
        model = _linear()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = kind("cpu", init_scale=2.0**-100, backoff_factor=2.0**-4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # ours warns once of a collapsing scale
            for _ in range(7):
                opt.zero_grad()
                scaler.scale(model(torch.full((1, 4), 1e3)).sum() * math.nan).backward()
                scaler.step(opt)
                scaler.update()
        before = _params(model)
        opt.zero_grad()
        scaler.scale(model(torch.full((1, 4), 1e3)).sum()).backward()  # a clean step
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        scaler.step(opt)
        runs[name] = (before, _params(model), scaler)
    assert _bitwise(runs["ours"][0], runs["torch"][0]), "the NaN steps were skipped by both"
    before, after, ours = runs["ours"]
    assert ours.get_scale() == 2.0**-126 and ours.stats.scale == 2.0**-126  # type: ignore[attr-defined]  # ours only
    assert all(torch.isfinite(p).all() for p in after) and not _bitwise(after, before)
    assert not ours.last_step_skipped  # type: ignore[attr-defined]  # ours only
    # the reference differs here: torch's scale fell below 2**-126, its reciprocal inf; its unscale found
    # no inf in the (finite) gradients, then multiplied them by it and stepped: its weights are not finite
    assert runs["torch"][2].get_scale() < 2.0**-126  # (2**-128; torch 2.4 flushes it to 0)
    assert not all(torch.isfinite(p).all() for p in runs["torch"][1])


def test_fused_sgd_leaves_the_host_path_once_every_stepped_parameter_has_its_buffer() -> None:
    """Fused SGD with momentum whose optimizer also holds a parameter that never gets a gradient (or a
    group without momentum): the first step is checked from the host (a skipped kernel would leave new
    buffers unset), the later ones are handed to the kernel, as torch's (its count of buffers never
    reached the number of parameters, so every step used to be read on the host); parameters bitwise
    torch's scaler's."""
    from amp_backends.scaler.treatment import momentum_buffers_missing

    for layout in ("unused", "no-momentum group"):
        runs = []
        for kind in BOTH.values():
            model, unused = _linear(), torch.nn.Parameter(torch.ones(3))
            groups: list[dict[str, Any]] = [{"params": list(model.parameters())}]
            groups.append({"params": [unused], "momentum": 0.0} if layout != "unused" else {"params": [unused]})
            opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9, fused=True)
            scaler = kind("cpu", init_scale=64.0)
            missing = []
            for _ in range(3):
                opt.zero_grad()
                scaler.scale(model(torch.ones(2, 4)).sum()).backward()
                missing.append(momentum_buffers_missing(opt))
                scaler.step(opt)
                scaler.update()
            runs.append((missing, _params(model)))
        assert runs[0][0] == [True, False, False], layout
        assert _bitwise(runs[0][1], runs[1][1]), layout


def test_a_clip_after_a_later_backward_is_refused_only_where_that_backward_reached() -> None:
    """A backward after unscale_ that adds scaled gradients to an unscaled optimizer's (a clip on every
    micro-batch) is refused at the next clip, as torch refuses its second unscale_, nothing changed; one
    that reaches only another optimizer's parameters (two optimizers, both backwards before either
    step) is not: parameters bitwise torch's scaler's for the same calls."""
    x = torch.ones(2, 4)
    runs = []
    for kind in BOTH.values():
        ma, mb = _linear(0), _linear(1)
        oa, ob = torch.optim.SGD(ma.parameters(), lr=0.1), torch.optim.SGD(mb.parameters(), lr=0.1)
        scaler = kind("cpu", init_scale=64.0)
        scaler.scale(ma(x).sum()).backward()
        scaler.unscale_(oa)
        torch.nn.utils.clip_grad_norm_(ma.parameters(), 0.5)
        scaler.scale(mb(x).sum()).backward()  # reaches b only
        scaler.unscale_(ob)
        scaler.step(oa), scaler.step(ob)
        scaler.update()
        runs.append(_params(ma) + _params(mb))
    assert _bitwise(runs[0], runs[1])
    a = _linear(0)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=64.0)
    scaler.scale(a(x).sum()).backward()
    scaler.clip_grad_norm_(opt_a, 1e6)
    grads = [p.grad.clone() for p in a.parameters()]
    scaler.scale(a(x).sum()).backward()  # the next micro-batch reaches a's gradients
    after_backward = [p.grad.clone() for p in a.parameters()]
    with pytest.raises(RuntimeError, match="sync_gradients"):
        scaler.clip_grad_norm_(opt_a, 1e6)
    assert all(torch.equal(p.grad, g) for p, g in zip(a.parameters(), after_backward))
    assert not all(torch.equal(g, h) for g, h in zip(grads, after_backward))
