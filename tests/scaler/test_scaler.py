"""GradScaler: parity with torch.amp.GradScaler, checkpoints, fused optimizers, signals and stats."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import amp_backends
from amp_backends import GradScaler, StateDictError
from amp_backends.scaler.treatment import Treatment, momentum_buffers_missing

SCALER_KW = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)


def _models():
    torch.manual_seed(0)
    m1 = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    m2 = torch.nn.Linear(8, 4)
    return m1, m2


def _run(make_scaler, steps=14, accum=2, injections=None, fused=False, clip="torch"):
    """A CPU fp16 run with two optimizers, accumulation, clipping and injected inf/NaN."""
    injections = injections or {}
    m1, m2 = _models()
    opt1 = torch.optim.SGD(m1.parameters(), lr=0.05, momentum=0.9)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-3, fused=fused)
    scaler = make_scaler()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)) for _ in range(accum)]
    scales, norms = [], []
    params = dict(list(m1.named_parameters(prefix="m1")) + list(m2.named_parameters(prefix="m2")))
    for step in range(steps):
        for x, y in data:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(m2(m1(x)).float(), y) / accum
            scaler.scale(loss).backward()
        for name, value in injections.get(step, []):
            params[name].grad.view(-1)[step % params[name].numel()] = value
        if clip == "torch":
            scaler.unscale_(opt1)
            norms.append(torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.5))
        elif clip == "scaler":
            norms.append(scaler.clip_grad_norm_(opt1, 0.5))
        scaler.step(opt1)
        scaler.step(opt2)
        scaler.update()
        scales.append(scaler.get_scale())
        opt1.zero_grad()
        opt2.zero_grad()
    state = [p.detach().clone() for p in list(m1.parameters()) + list(m2.parameters())]
    return state, scales, scaler.state_dict(), scaler, norms


INJECTIONS = {
    2: [("m1.0.weight", math.inf)],
    3: [("m2.bias", math.nan)],
    4: [("m1.2.bias", -math.inf), ("m2.weight", math.inf)],
    9: [("m2.weight", math.nan)],
}


@pytest.mark.parametrize("fused", [False, True])
def test_trajectory_parity_with_torch_bitwise(fused):
    ours = _run(lambda: GradScaler("cpu", **SCALER_KW), injections=INJECTIONS, fused=fused)
    ref = _run(lambda: torch.amp.GradScaler("cpu", **SCALER_KW), injections=INJECTIONS, fused=fused)
    for a, b in zip(ours[0], ref[0]):
        assert torch.equal(a, b)
    assert ours[1] == ref[1]
    assert ours[2] == ref[2]
    history = ours[1]
    assert any(b < a for a, b in zip(history, history[1:])), "the scale backed off"
    assert any(b > a for a, b in zip(history, history[1:])), "the scale grew"
    stats = ours[3].stats
    assert stats.overflows == 4 and stats.updates == 14 and stats.last_overflow_step == 9
    assert stats.scale == ours[1][-1]
    # step 2 skips opt1 only (opt2 clean), 3 skips opt2 only, 4 skips both, 9 skips opt2
    assert stats.skipped == 5 and stats.steps == 28 - 5


@pytest.mark.parametrize("fused", [False, True])
def test_the_scalers_clip_is_torchs_recipe_bitwise(fused):
    ours = _run(lambda: GradScaler("cpu", **SCALER_KW), injections=INJECTIONS, clip="scaler", steps=10, fused=fused)
    ref = _run(lambda: torch.amp.GradScaler("cpu", **SCALER_KW), injections=INJECTIONS, clip="torch", steps=10,
               fused=fused)
    for a, b in zip(ours[0], ref[0]):
        assert torch.equal(a, b)
    assert ours[1] == ref[1]
    assert len([b for b in ref[4] if torch.isfinite(b)]) == 8  # steps 2 and 4 put inf into opt1's gradients
    for a, b in zip(ours[4], ref[4]):
        assert torch.equal(a, b) or (a.isnan() and b.isnan())


def test_clip_grad_norm_with_a_fused_optimizer_is_torchs_recipe_bitwise():
    """unscale_, then torch.nn.utils.clip_grad_norm_ over the optimizer's parameters, then the fused step
    on the unscaled gradients (grad_scale None): the norm, the gradients and the parameters bitwise."""
    def run(use_scaler_clip):
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = GradScaler("cpu", init_scale=256.0) if use_scaler_clip else torch.amp.GradScaler("cpu", init_scale=256.0)
        x = torch.randn(8, 32)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).sum()
        scaler.scale(loss).backward()
        if use_scaler_clip:
            norm = scaler.clip_grad_norm_(opt, 1.0)
        else:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        return norm, [p.detach() for p in model.parameters()], [p.grad for p in model.parameters()]

    n1, p1, g1 = run(True)
    n2, p2, g2 = run(False)
    assert torch.equal(n1, n2)
    assert all(torch.equal(a, b) for a, b in zip(p1 + g1, p2 + g2))


def test_perfect_storm_every_position_of_every_gradient_is_found():
    params = [
        torch.nn.Parameter(torch.randn(3, 4)),
        torch.nn.Parameter(torch.randn(4, 3, dtype=torch.bfloat16)),
        torch.nn.Parameter(torch.randn(2, 5)),
        torch.nn.Parameter(torch.randn(3, 3, dtype=torch.bfloat16)),
    ]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0, growth_interval=10**6)

    def fresh_grads():
        params[0].grad = torch.randn(3, 4)  # dense
        params[1].grad = torch.randn(3, 4, dtype=torch.bfloat16).t()  # transposed
        params[2].grad = torch.randn(20, 20)[::10, 1:16:3]  # sliced view of a larger buffer
        params[3].grad = torch.randn(6, 6, dtype=torch.bfloat16)[::2, 1::2]

    positions = [(i, j) for i, p in enumerate(params) for j in range(p.numel())]
    for value in (math.inf, -math.inf, math.nan):
        for i, j in positions:
            fresh_grads()
            scaler.scale(torch.ones(()))
            grad = params[i].grad
            grad[tuple(int(k) for k in torch.unravel_index(torch.tensor(j), grad.shape))] = value
            before = [p.detach().clone() for p in params]
            scaler.step(opt)
            scaler.update(2.0)
            assert scaler.last_step_skipped, (value, i, j)
            assert all(torch.equal(b, p) for b, p in zip(before, params))
    fresh_grads()
    scaler.step(opt)
    scaler.update()
    assert not scaler.last_step_skipped


def test_state_dict_round_trips_with_torch_both_ways():
    ours = _run(lambda: GradScaler("cpu", **SCALER_KW), steps=5, injections={1: [("m2.bias", math.inf)]})[3]
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.state_dict() == ours.state_dict()
    assert set(ours.state_dict()) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    ref = _run(lambda: torch.amp.GradScaler("cpu", **SCALER_KW), steps=7, injections={2: [("m2.bias", math.nan)]})[3]
    fresh = GradScaler("cpu")
    fresh.load_state_dict(ref.state_dict())
    assert fresh.state_dict() == ref.state_dict()
    assert fresh.get_growth_interval() == 3 and fresh.stats.scale == ref.get_scale()


GOOD = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 100, "_growth_tracker": 3}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"scale": None}, "missing scale"),
        ({"_growth_tracker": None}, "missing _growth_tracker"),
        ({"scale": "1024"}, "must be a number"),
        ({"growth_interval": 10.5}, "must be an int"),
        ({"_growth_tracker": True}, "must be an int"),
        ({"scale": 0.0}, "scale must be a finite number > 0"),
        ({"scale": -2.0}, "scale must be a finite number > 0"),
        ({"scale": math.nan}, "scale must be a finite number > 0"),
        ({"scale": math.inf}, "scale must be a finite number > 0"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.5}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"_growth_tracker": -1}, "_growth_tracker"),
    ],
)
def test_malformed_state_dict_raises_and_changes_nothing(change, match):
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=5)
    scaler.scale(torch.ones(()))
    before = scaler.state_dict()
    bad = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(StateDictError, match=match):
        scaler.load_state_dict(bad)
    assert scaler.state_dict() == before


def test_empty_or_foreign_state_dict():
    scaler = GradScaler("cpu")
    with pytest.raises(StateDictError, match="empty: it was saved from a disabled scaler"):
        scaler.load_state_dict({})
    with pytest.raises(StateDictError, match="must be a dict"):
        scaler.load_state_dict([1, 2])  # type: ignore[arg-type]  # the wrong type on purpose: the refusal is the test
    disabled = GradScaler("cpu", enabled=False)
    assert disabled.state_dict() == {}
    disabled.load_state_dict({"anything": 1})  # a disabled scaler loads nothing, like torch's
    scaler.load_state_dict({**GOOD, "scale": torch.tensor(512.0)})
    assert scaler.get_scale() == 512.0


def test_misuse_raises_clear_errors():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    with pytest.raises(RuntimeError, match="before scale"):
        scaler.unscale_(opt)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="(?i)closure"):
        scaler.step(opt, closure=lambda: 0)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match="(?i)no inf checks"):
        scaler.update()
    half = torch.nn.Linear(2, 1).half()
    hopt = torch.optim.SGD(half.parameters(), lr=0.1)
    for p in half.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="FP16 gradients"):
        scaler.unscale_(hopt)
    for kwargs, match in [
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"init_scale": -1.0}, "scale"),
    ]:
        with pytest.raises(ValueError, match=match):
            GradScaler("cpu", **kwargs)
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.set_growth_factor(0.5)
    assert scaler.get_growth_factor() == 2.0


def test_scale_nested_outputs_and_manual_update():
    scaler = GradScaler("cpu", init_scale=4.0)
    a, b, c = torch.ones(2), torch.full((1,), 2.0), torch.full((1,), 3.0)
    out = scaler.scale([a, (b, c)])
    assert isinstance(out, list) and isinstance(out[1], tuple)
    assert out[0].tolist() == [4.0, 4.0] and out[1][1].item() == 12.0
    assert [t.item() for t in scaler.scale(iter([c]))] == [12.0]
    with pytest.raises(ValueError, match="must be a Tensor or an iterable"):
        scaler.scale([1.0])
    scaler.update(16.0)
    assert scaler.get_scale() == 16.0
    scaler.update(torch.tensor(32.0))
    assert scaler.get_scale() == 32.0 and scaler.stats.scale == 32.0


class _CountSyncs(TorchFunctionMode):
    """Counts Tensor.item / bool / tolist calls: each is a host synchronisation on an accelerator."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.tolist):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fused", [False, True])
def test_host_synchronisations_per_step(fused):
    model = torch.nn.Linear(4, 4)
    # SGD's step reads no tensor on the host, so every count below is the scaler's own
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True) if fused else torch.optim.SGD(model.parameters())
    scaler = GradScaler("cpu")
    loss = model(torch.randn(2, 4)).float().sum()
    scaled = scaler.scale(loss)
    scaled.backward()
    with _CountSyncs() as counter:
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    assert counter.count == (0 if fused else 1)
    if not fused:
        with _CountSyncs() as counter:
            stats = scaler.stats
            skipped = scaler.last_step_skipped
        assert counter.count == 0 and stats.steps == 1 and skipped is False


def test_last_step_skipped_gates_a_scheduler():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = GradScaler("cpu", init_scale=2.0)
    for step in range(4):
        scaler.scale(model(torch.ones(1, 3)).sum()).backward()
        if step == 1:
            model.bias.grad.fill_(math.nan)
        scaler.step(opt)
        scaler.update()
        if not scaler.last_step_skipped:
            sched.step()
        opt.zero_grad()
    assert sched.last_epoch == 3 and scaler.stats.skipped == 1 and scaler.stats.last_overflow_step == 1


def test_bf16_scaler_is_free_but_can_refuse_non_finite_steps():
    be = amp_backends.get("cpu")
    free = be.grad_scaler()
    assert not free.is_enabled() and free.get_scale() == 1.0 and free.state_dict() == {}
    loss = torch.ones((), requires_grad=True) * 3
    assert free.scale(loss) is loss, "no multiply at all"
    guarded = be.grad_scaler(check_finite=True)
    for scaler, expect_corrupt in ((free, True), (guarded, False)):
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        model.weight.grad[0, 0] = math.nan
        scaler.step(opt)
        scaler.update()
        assert bool(torch.isnan(model.weight).any()) is expect_corrupt
        assert scaler.last_step_skipped is (not expect_corrupt)
    assert guarded.stats.skipped == 1 and guarded.stats.overflows == 1
    fp16 = be.grad_scaler(torch.float16)
    assert fp16.is_enabled() and fp16.get_scale() == 2.0**16


def test_collapsing_scale_warns_once_naming_the_cause():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=8.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(8):
            loss = model(torch.ones(1, 2)).sum() * math.nan
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    relevant = [w for w in caught if "loss scale fell" in str(w.message)]
    assert len(relevant) == 1
    assert "the loss or the model itself produces inf/NaN" in str(relevant[0].message) and "check_model" in str(relevant[0].message)
    assert scaler.get_scale() == 8.0 * 0.5**8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_same_loop_trains_on_cpu(dtype):
    torch.manual_seed(0)
    be = amp_backends.get("cpu")
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(256, 10)
    y = (x[:, :1] * 2 - x[:, 1:2]).sin()
    scaler = be.grad_scaler(dtype)
    assert scaler.is_enabled() is (dtype == torch.float16)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        with be.autocast(dtype):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_scaler_uses_the_backends_kernel():
    calls = []

    class Recording(amp_backends.TorchKernel):
        name = "recording"

        def grad_op_(self, group, found_inf, inv_scale=None, norm_sq=None):
            if inv_scale is not None:
                calls.append((len(group.tensors), group.dtype))
            super().grad_op_(group, found_inf, inv_scale, norm_sq)

    be = copy.copy(amp_backends.get("cpu"))
    be.kernel = Recording()
    params = [torch.nn.Parameter(torch.randn(2)), torch.nn.Parameter(torch.randn(2, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler(be)
    scaler.scale(torch.ones(()))
    for p in params:
        p.grad = torch.ones_like(p)
    scaler.step(opt)
    assert sorted(calls, key=str) == sorted([(2, torch.float32), (1, torch.bfloat16)], key=str)


def test_fused_optimizer_after_unscale_is_not_unscaled_twice():
    """torch's clip recipe with AdamW(fused=True): unscale_, clip, step; bitwise equal to torch's scaler."""

    def run(make):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = make()
        x = torch.randn(8, 16)
        for step in range(6):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).sum()
            scaler.scale(loss).backward()
            if step == 2:
                model.bias.grad[0] = math.inf
            scaler.unscale_(opt)
            grads = [p.grad.clone() for p in model.parameters()]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return [p.detach() for p in model.parameters()], grads, scaler.get_scale()

    ours, ours_grads, ours_scale = run(lambda: GradScaler("cpu", init_scale=1024.0))
    ref, ref_grads, ref_scale = run(lambda: torch.amp.GradScaler("cpu", init_scale=1024.0))
    assert ours_scale == ref_scale == 512.0
    for a, b in zip(ours + ours_grads, ref + ref_grads):
        assert torch.equal(a, b)
    assert max(g.abs().max().item() for g in ours_grads) < 1024, "gradients were unscaled (once) before step"


def test_a_skipped_first_step_of_fused_sgd_with_momentum_is_a_no_op():
    """torch's fused SGD makes a parameter's first momentum buffer with empty_like and lets the kernel
    fill it; handed found_inf, the kernel skips and the buffer stays uninitialised (torch 2.13). The
    scaler skips such a step from the host until every parameter has its buffer. Oracle: a skipped
    step changes nothing, so (skipped step, clean step) equals the clean step alone."""
    def run(skip_first):
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
        scaler = GradScaler("cpu", init_scale=64.0)
        for step in range(2 if skip_first else 1):
            opt.zero_grad()
            scaler.scale(model(torch.ones(2, 5)).sum()).backward()
            if skip_first and step == 0:
                model.weight.grad[0, 0] = math.inf
                scaled = [p.grad.clone() for p in model.parameters()]
            scaler.step(opt)
            if skip_first and step == 0:
                assert scaler.last_step_skipped and not opt.state, "skipped: no state made"
                assert all(torch.equal(a, p.grad) or a.isinf().any() for a, p in zip(scaled, model.parameters())), \
                    "a skipped fused step leaves the gradients as they were, as torch's fused protocol does"
                scaler.update(64.0)
        return [p.detach().clone() for p in model.parameters()], opt.state_dict()["state"]

    params, state = run(skip_first=True)
    ref_params, ref_state = run(skip_first=False)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert all(torch.equal(state[k]["momentum_buffer"], ref_state[k]["momentum_buffer"]) for k in ref_state)
    scaler_after = GradScaler("cpu")
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    scaler_after.scale(model(torch.ones(2, 5)).sum()).backward()
    assert scaler_after._treatment(opt) is Treatment.FUSED, "chosen once: the fused kernel skips itself"
    assert momentum_buffers_missing(opt), "first step: downgraded to FROM_HOST, skipped from the host"
    scaler_after.step(opt)
    assert not momentum_buffers_missing(opt), "every parameter has its momentum buffer: the fused kernel skips itself"
