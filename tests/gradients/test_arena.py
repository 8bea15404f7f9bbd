"""flat_grads(): the gradient arena, the scaler's ops on it (bitwise the per-tensor path's), misuse."""

from __future__ import annotations

import copy
import gc
import math
import pickle
import struct
import warnings
import weakref

import pytest
import torch

import amp_backends
from amp_backends.gradients.arena import ALIGN_BYTES, flat_grads_of
from amp_backends.scaler import GradScaler
from python_events import python_events

pytestmark = pytest.mark.filterwarnings("ignore::amp_backends.PerformanceWarning")


def _kernels():
    kernels = [pytest.param(amp_backends.TorchKernel(), id="torch")]
    try:
        from amp_backends_plugins.triton import TritonKernel

        if TritonKernel().supports("cpu"):
            kernels.append(pytest.param(TritonKernel(), id="triton"))
    except ImportError:  # pragma: no cover - the triton extra is not installed
        pass
    return kernels


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    # odd sizes: a 37-element bias is followed by a gradient that would start at byte 148
    model = torch.nn.Sequential(
        torch.nn.Linear(13, 37), torch.nn.ReLU(), torch.nn.Linear(37, 29), torch.nn.Tanh(), torch.nn.Linear(29, 3)
    )
    return model.to(dtype)


def _backend(kernel):
    be = copy.copy(amp_backends.get("cpu"))
    be.kernel = kernel
    return be


def _train(kernel, arena: bool, steps=7, fused=False, clip=True, accumulate=2, optimizer="adamw", check="identity"):
    model = _model()
    params = list(model.parameters())
    if optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-2, fused=fused)
    else:
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    flat = amp_backends.flat_grads(opt, check=check) if arena else None
    scaler = GradScaler(_backend(kernel), init_scale=2.0**10, growth_interval=2)
    g = torch.Generator().manual_seed(1)
    norms, attached = [], []
    for step in range(steps):
        for _ in range(accumulate):
            x = torch.randn(8, 13, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
        if step == 3:
            params[2].grad[1, 2] = math.inf
        if clip:
            norms.append(scaler.clip_grad_norm_(opt, 0.5).clone())
        scaler.step(opt)
        scaler.update()
        if flat is not None:
            attached.append(flat.problem() is None and all(
                p.grad.data_ptr() == grp.buffer.data_ptr() + off * grp.buffer.element_size()
                for grp in flat.groups for p, off in zip(grp.params, grp.offsets)))
        opt.zero_grad(set_to_none=step % 2 == 0)
    return [p.detach().clone() for p in params], norms, scaler.stats, attached


@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("check", ["identity", "refcount"])
def test_arena_training_is_bitwise_the_per_tensor_path(kernel, clip, check):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback may happen in a clean loop
        params, norms, stats, attached = _train(kernel, arena=True, clip=clip, check=check)
    ref_params, ref_norms, ref_stats, _ = _train(kernel, arena=False, clip=clip)
    assert all(attached), "the gradients stay in the arena across step, update and zero_grad"
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)
    for a, b in zip(norms, ref_norms):
        assert torch.equal(a, b) or (a.isnan() and b.isnan())
    assert stats.skipped == ref_stats.skipped == 1 and stats.scale == ref_stats.scale


@pytest.mark.parametrize("kernel", _kernels())
def test_arena_with_fused_optimizer_and_sgd(kernel):
    for kwargs in ({"fused": True}, {"optimizer": "sgd"}):
        params, norms, stats, _ = _train(kernel, arena=True, steps=5, **kwargs)
        ref_params, ref_norms, ref_stats, _ = _train(kernel, arena=False, steps=5, **kwargs)
        for a, b in zip(params, ref_params):
            assert torch.equal(a, b), kwargs
        for a, b in zip(norms, ref_norms):
            assert torch.equal(a, b) or (a.isnan() and b.isnan())
        assert stats.skipped == ref_stats.skipped == 1


def test_layout_views_aligned_per_device_and_dtype():
    model = _model()
    extra = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
    frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    existing = torch.randn(3, 29)
    model[4].weight.grad = existing.clone()
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": [extra, frozen]}], lr=0.1)
    arena = amp_backends.flat_grads(opt)
    assert [(g.device, g.dtype) for g in arena.groups] == [(torch.device("cpu"), torch.float32),
                                                          (torch.device("cpu"), torch.bfloat16)]
    assert torch.equal(model[4].weight.grad, existing), "gradients present are copied in"
    assert model[4].weight.grad._base is arena.groups[0].buffer
    assert model[0].weight.grad is None and extra.grad is None, "no gradient yet: None, as torch has it"
    model(torch.randn(2, 13)).sum().backward()
    (extra.float().sum() * 2).backward()
    for group in arena.groups:
        assert group.buffer.dim() == 1 and group.buffer.data_ptr() % ALIGN_BYTES == 0
        for p, v, off in zip(group.params, group.views(), group.offsets):
            assert p.grad is v and v.shape == p.shape and v.dtype == p.dtype
            assert v.data_ptr() == group.buffer.data_ptr() + off * group.buffer.element_size()
            assert v.data_ptr() % ALIGN_BYTES == 0
    assert frozen.grad is None and len(arena.groups[1].params) == 1
    assert arena.nbytes >= sum(p.numel() * p.element_size() for p in model.parameters())
    assert flat_grads_of(opt) is arena and "cpu/float32: 6" in repr(arena)


def test_gradients_are_none_where_torchs_are_and_backward_accumulates_in_place():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arena = amp_backends.flat_grads(opt)
    buffer = arena.groups[0].buffer
    assert all(p.grad is None for p in model.parameters())
    x = torch.randn(4, 13)
    model(x).sum().backward()
    views = [p.grad for p in model.parameters()]
    assert all(v._base is buffer for v in views), "backward wrote into the arena"
    once = [v.clone() for v in views]
    model(x).sum().backward()
    for p, v, o in zip(model.parameters(), views, once):
        assert p.grad is v and torch.allclose(v, 2 * o), "accumulated in place"
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is v for p, v in zip(model.parameters(), views)) and torch.count_nonzero(buffer) == 0
    del views, once, v, o
    opt.zero_grad()  # set_to_none=True, torch's default
    assert all(p.grad is None for p in model.parameters())
    assert arena.groups[0].buffer is buffer, "nobody held a view: the same buffer, zeroed"
    model(x).sum().backward()
    assert all(p.grad._base is buffer for p in model.parameters())
    arena.release()
    assert flat_grads_of(opt) is None and "zero_grad" not in vars(opt)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters()), "torch's zero_grad again"


def test_a_view_kept_by_the_user_keeps_its_values_as_torchs_gradient_would():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arena = amp_backends.flat_grads(opt)
    model(torch.randn(4, 13)).sum().backward()
    kept = model[0].weight.grad
    value = kept.clone()
    opt.zero_grad()
    assert model[0].weight.grad is None and torch.equal(kept, value), "torch would not zero a dropped gradient"
    model(torch.randn(4, 13)).sum().backward()
    assert torch.equal(kept, value) and model[0].weight.grad._base is arena.groups[0].buffer
    assert arena.problem() is None


def test_scaler_does_not_walk_the_gradients(monkeypatch):
    import amp_backends.gradients.arena as arena_module
    import amp_backends.gradients.collect as gradients
    from amp_backends.gradients import executor

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_backends.flat_grads(opt)
    scaler = GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.randn(2, 13)).sum()).backward()
    walks = []
    monkeypatch.setattr(gradients, "walk", lambda *a: walks.append(a) or [])
    monkeypatch.setattr(arena_module.FlatGrads, "_resync", lambda self: walks.append("resync"))
    runs = []
    monkeypatch.setattr(executor, "_flat", lambda device, kernel, group, *a: runs.append(group.dtype))
    scaler.unscale_(opt)
    assert walks == [] and runs == [torch.float32], "one op per (device, dtype); no walk, no per-parameter check"


def test_the_issues_case_model_zero_grad_and_a_parameter_used_later():
    """Linear(2,1) and a parameter first used at step 2, gradients cleared by model.zero_grad(set_to_none=False),
    lr 0.1, scale 1024: every step bitwise torch's scaler (the arena once let the late gradient reach the
    optimizer still multiplied by 1024)."""
    def run(arena, check):
        torch.manual_seed(0)
        lin = torch.nn.Linear(2, 1)
        late = torch.nn.Parameter(torch.ones(1))
        opt = torch.optim.SGD([*lin.parameters(), late], lr=0.1)
        if arena:
            amp_backends.flat_grads(opt, check=check)
        scaler = (GradScaler if arena else torch.amp.GradScaler)("cpu", init_scale=1024.0)
        history = []
        for step in range(4):
            lin.zero_grad(set_to_none=False)
            late.grad = None if step == 0 else late.grad
            y = lin(torch.ones(1, 2)) + (late * 3 if step >= 2 else 0)
            scaler.scale(y.sum()).backward()
            scaler.step(opt)
            scaler.update()
            history.append([p.detach().clone() for p in (*lin.parameters(), late)])
        return history

    reference = run(False, None)
    for check in ("refcount", "identity"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no fallback needed: the arena follows torch
            got = run(True, check)
        for step, (a, b) in enumerate(zip(got, reference)):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (check, step)
    # steps 2 and 3 move it by about 0.3 each (step 3's gradient accumulates onto step 2's), not by 307
    assert reference[-1][2].item() == pytest.approx(0.4, abs=1e-3)


def _step(model, opt, scaler, x, after_backward=None):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    if after_backward is not None:
        after_backward()
    norm = scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    return norm


def _pair():
    out = []
    for arena in (True, False):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if arena:
            amp_backends.flat_grads(opt)
        out.append((model, opt, GradScaler("cpu", init_scale=8.0)))
    return out


def _same_params(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_model_zero_grad_stays_in_the_arena_and_equals_torch(set_to_none):
    (model, opt, scaler), (ref, ref_opt, ref_scaler) = _pair()
    arena = flat_grads_of(opt)
    x = torch.randn(4, 13)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(3):
            model.zero_grad(set_to_none=set_to_none)
            ref.zero_grad(set_to_none=set_to_none)
            assert [p.grad is None for p in model.parameters()] == [p.grad is None for p in ref.parameters()]
            assert torch.equal(_step(model, opt, scaler, x), _step(ref, ref_opt, ref_scaler, x))
            assert _same_params(model, ref)
            assert all(p.grad._base is arena.groups[0].buffer for p in model.parameters())


def test_gradient_assigned_by_hand_is_the_one_unscaled():
    (model, opt, scaler), (ref, ref_opt, ref_scaler) = _pair()
    x = torch.randn(4, 13)

    def replace(m):
        def go():
            m[0].bias.grad = m[0].bias.grad * 2  # a new tensor, outside the arena
        return go

    with pytest.warns(RuntimeWarning, match="outside the arena"):
        norm = _step(model, opt, scaler, x, replace(model))
    ref_norm = _step(ref, ref_opt, ref_scaler, x, replace(ref))
    assert torch.equal(norm, ref_norm) and _same_params(model, ref)


def test_param_group_added_later_and_dtype_change():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_backends.flat_grads(opt)
    scaler = GradScaler("cpu", init_scale=8.0)
    late = torch.nn.Parameter(torch.ones(4))
    opt.add_param_group({"params": [late]})
    x = torch.randn(4, 13)

    def touch_late():
        late.grad = torch.full((4,), math.inf)  # an inf only in the new parameter: must be seen

    with pytest.warns(RuntimeWarning, match="parameters changed since flat_grads"):
        _step(model, opt, scaler, x, touch_late)
    assert scaler.last_step_skipped, "the per-tensor path saw the new parameter's inf"
    opt.zero_grad()  # torch's zero_grad while the arena no longer fits
    assert late.grad is None
    arena = amp_backends.flat_grads(opt)  # rebuilt for the current parameters
    (late * 2).sum().backward()
    assert arena.problem() is None and late.grad._base is arena.groups[0].buffer

    model.to(torch.float64)  # a dtype change: the gradients are new float64 tensors
    model(torch.randn(2, 13, dtype=torch.float64)).sum().backward()
    assert "float64" in arena.problem() and "flat_grads(optimizer) again" in arena.problem()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters()), "nothing put back into slots that no longer fit"


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        amp_backends.flat_grads(torch.nn.Linear(2, 2))
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    dense = torch.nn.Parameter(torch.ones(3))
    dense.grad = torch.full((3,), 2.0)
    before = dense.grad
    with pytest.raises(TypeError, match="sparse"):
        amp_backends.flat_grads(torch.optim.SGD([dense, *emb.parameters()], lr=0.1))
    assert dense.grad is before, "refused before any gradient moved"


@pytest.fixture
def denormals():
    """float32 denormals honoured for the test: after torch 2.4's inductor has compiled a model on the CPU
    the process flushes them to zero (seen in the torch 2.4 leg), and 1e-45 is then 0."""
    flushing = struct.unpack("f", struct.pack("f", 1e-45))[0] == 0.0
    torch.set_flush_denormal(False)
    yield
    torch.set_flush_denormal(flushing)


@pytest.mark.parametrize("clear", ["model", "hand"])
def test_gaps_poisoned_by_a_vanishing_scale_do_not_fail_later_checks(clear, denormals):
    """A scale so small that 1/scale is inf: the unscale leaves NaN (0 * inf) in the alignment gaps and
    free slots. Gradients then zeroed without touching the gaps (model.zero_grad(set_to_none=False),
    or by hand): the next step's check must not see the gaps' NaN."""
    model = _model()
    opt = torch.optim.SGD([*model.parameters(), torch.nn.Parameter(torch.ones(3))], lr=0.1)  # one never used
    arena = amp_backends.flat_grads(opt)
    assert any(g.buffer.numel() > sum(g.numels) for g in arena.groups), "the layout has gaps"
    scaler = GradScaler("cpu", init_scale=8.0)
    x = torch.randn(4, 13)
    scaler.scale(model(x).sum()).backward()
    scaler.update(8.0)
    # a denormal float32 scale, whose 1/scale overflows to inf: update(), load_state_dict and the backoff
    # no longer reach one (refused, or floored at 2**-126), so it is set directly, the host's mirror dropped
    scaler._scale.fill_(1e-45)
    scaler._telemetry.mirror = None
    scaler.scale(model(x).sum()).backward()
    scaler.unscale_(opt)  # torch's op checks the values it is given (finite), then multiplies by inf
    assert any(g.buffer.isnan().any() for g in arena.groups), "the gaps took the NaN"
    if clear == "model":
        model.zero_grad(set_to_none=False)
    else:
        for p in model.parameters():
            p.grad.zero_()
    scaler.update(8.0)
    scaler.scale(model(x).sum()).backward()
    scaler.step(opt)
    assert not scaler.last_step_skipped, "NaN in the gaps is not a gradient's NaN"
    assert arena.problem() is None


def test_scaler_with_arena_pickles_and_copies():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_backends.flat_grads(opt)
    scaler = GradScaler("cpu", init_scale=8.0)
    scaler.scale(model(torch.randn(2, 13)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    arena = flat_grads_of(opt)
    assert arena is not None and not any(r is arena for r in gc.get_referents(scaler.__dict__)), \
        "the scaler keeps no arena: the optimizer does"
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.get_scale() == scaler.get_scale()
    assert copy.deepcopy(scaler).get_scale() == scaler.get_scale()


@pytest.mark.parametrize("check", ["identity", "refcount"])
def test_each_check_finds_what_leaves_the_arena(check):
    """replaced by hand, assigned where there was none, a view's .data swapped, a parameter added: both
    checks see them; a gradient set to None is torch's None, and its slot is taken back."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arena = amp_backends.flat_grads(opt, check=check)
    model(torch.randn(2, 13)).sum().backward()
    assert arena.problem() is None
    w, b = model[0].weight, model[0].bias
    cases = [
        lambda: setattr(w, "grad", torch.zeros_like(w)),
        lambda: setattr(w.grad, "data", torch.zeros_like(w, dtype=torch.float64)),
        lambda: (setattr(b, "grad", None), setattr(b, "grad", torch.ones_like(b))),
    ]
    for leave in cases:
        leave()
        assert arena.problem() is not None, check
        opt.zero_grad()
        assert arena.problem() is None and all(p.grad is None for p in model.parameters())
        model(torch.randn(2, 13)).sum().backward()
        assert w.grad._base is arena.groups[0].buffer
    w.grad = None
    assert arena.problem() is None, "None is torch's own state: the slot is free again"
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    assert "parameters changed" in arena.problem()


def test_gradients_torch_makes_itself_are_seen_and_taken_back():
    """create_graph=True (torch replaces the gradient out of place) and a gradient of a parameter made
    while a view of its slot was still held: outside the arena, found, the step per-tensor and right."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arena = amp_backends.flat_grads(opt)
    model(torch.randn(2, 13)).pow(2).sum().backward(create_graph=True)
    assert arena.problem() is not None and "outside the arena" in arena.problem()
    opt.zero_grad()
    assert arena.problem() is None
    model(torch.randn(2, 13)).sum().backward()
    held = model[0].weight.grad
    model.zero_grad()  # the view is dropped from .grad but still referenced here
    model(torch.randn(2, 13)).sum().backward()
    assert model[0].weight.grad._base is not arena.groups[0].buffer, "left to torch: the held view keeps its values"
    assert arena.problem() is not None
    del held
    opt.zero_grad()
    assert arena.problem() is None


def test_check_must_be_known():
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'refcount', 'identity'"):
        amp_backends.flat_grads(opt, check="never")
    assert flat_grads_of(opt) is None and all(p.grad is None for g in opt.param_groups for p in g["params"])
    arena = amp_backends.flat_grads(opt)
    assert arena.check == "refcount", "the constant-time check is the default"
    with pytest.raises(ValueError, match="'refcount', 'identity'"):
        amp_backends.flat_grads(opt, check="never")
    assert flat_grads_of(opt) is arena and opt.zero_grad == arena.zero_grad, "the arena in place stays"


class _Branchy(torch.nn.Module):
    """A trunk always used, a branch used only at some steps, a head never used after step 0."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.trunk = torch.nn.Linear(6, 6)
        self.branch = torch.nn.Linear(6, 6)
        self.early = torch.nn.Linear(6, 1)
        self.out = torch.nn.Linear(6, 1)

    def forward(self, x, step):
        h = torch.relu(self.trunk(x))
        if step % 3 == 0:
            h = h + self.branch(h)
        y = self.out(h)
        return y + self.early(h) if step == 0 else y


def _branchy_run(arena: bool, optimizer: str, set_to_none: bool, overflow_at: int | None = None):
    model = _Branchy()
    make = {
        "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "sgd-weight-decay": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.1),
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    }
    opt = make[optimizer](model.parameters())
    if arena:
        amp_backends.flat_grads(opt)
    scaler = GradScaler("cpu", init_scale=2.0**8) if arena else torch.amp.GradScaler("cpu", init_scale=2.0**8)
    g = torch.Generator().manual_seed(2)
    history = []
    for step in range(6):
        opt.zero_grad(set_to_none=set_to_none)
        for _ in range(2):  # accumulation: the branch is used (or not) in both micro-batches
            x = torch.randn(4, 6, generator=g)
            loss = model(x, step).square().mean()
            scaler.scale(loss).backward()
        if step == overflow_at:
            model.trunk.weight.grad[0, 0] = math.inf
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        scaler.step(opt)
        scaler.update()
        history.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale(),
                        {n: g is None for n, g in grads.items()}))
    return history


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "sgd-weight-decay", "adamw", "adam"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_parameters_without_a_gradient_step_as_with_torchs_scaler(optimizer, set_to_none):
    """A branch used every third step and a head used only at step 0: with the arena the
    parameters after every step are bitwise those of torch's scaler without it (the optimizer
    sees None where torch's would, zeros where set_to_none=False keeps them)."""
    ours = _branchy_run(True, optimizer, set_to_none, overflow_at=4)
    theirs = _branchy_run(False, optimizer, set_to_none, overflow_at=4)
    for step, ((p_ours, s_ours, _), (p_theirs, s_theirs, _)) in enumerate(zip(ours, theirs)):
        assert s_ours == s_theirs, step
        for a, b in zip(p_ours, p_theirs):
            assert torch.equal(a, b), f"step {step}: parameters differ from torch's scaler"


def test_the_optimizer_sees_none_for_parameters_no_backward_reached():
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    arena = amp_backends.flat_grads(opt)
    scaler = GradScaler("cpu", init_scale=2.0**8)
    seen = {}

    def spy(optimizer, args, kwargs):
        seen.update({n: p.grad is None for n, p in model.named_parameters()})

    opt.register_step_pre_hook(spy)
    opt.zero_grad()
    scaler.scale(model(torch.randn(4, 6), 1).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert seen == {"trunk.weight": False, "trunk.bias": False, "branch.weight": True, "branch.bias": True,
                    "early.weight": True, "early.bias": True, "out.weight": False, "out.bias": False}
    assert arena.problem() is None
    assert all(torch.count_nonzero(s.spare[i]) == 0 for s in arena._slots for i in s.free), "free slots stay zero"


def test_an_optimizer_without_any_gradient_raises_as_torchs_scaler_does():
    for arena, scaler in ((True, GradScaler("cpu", init_scale=4.0)), (False, torch.amp.GradScaler("cpu", init_scale=4.0))):
        model = _Branchy()
        unused = torch.optim.SGD(model.branch.parameters(), lr=0.1)
        used = torch.optim.SGD(model.trunk.parameters(), lr=0.1)
        if arena:
            amp_backends.flat_grads(unused)
            amp_backends.flat_grads(used)
        unused.zero_grad()
        used.zero_grad()
        scaler.scale(model(torch.randn(4, 6), 1).sum()).backward()
        scaler.step(used)
        with pytest.raises((RuntimeError, AssertionError), match="No inf checks were recorded for this optimizer"):
            scaler.step(unused)


def test_release_removes_the_arenas_hooks():
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arena = amp_backends.flat_grads(opt)
    arena.release()
    assert all(not p._backward_hooks for p in model.parameters())
    model(torch.randn(4, 6), 0).sum().backward()
    assert all(p.grad._base is None for p in model.parameters()), "backward makes torch's own gradients"


# -- hostile input (issue 38, items 4, 5, 6, 13): each against torch's own scaler, parameters bitwise --------------


def _against_torch(program, checks=("refcount", "identity")):
    """``program(arena, check)`` -> observations per step; with the arena (each check, no fallback warning
    unless ``program`` expects one itself) they equal those of torch.amp.GradScaler without one."""
    reference = program(False, None)
    for check in checks:
        got = program(True, check)
        assert len(got) == len(reference)
        for step, (a, b) in enumerate(zip(got, reference)):
            assert a.keys() == b.keys()
            for key in a:
                x, y = a[key], b[key]
                same = (x is None and y is None) if x is None or y is None else torch.equal(x, y)
                assert same, f"{check}, step {step}: {key} differs from torch's scaler"


def _observe(model):
    out = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"grad {n}": None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
    return out


def _scaler(arena):
    return GradScaler("cpu", init_scale=2.0**8) if arena else torch.amp.GradScaler("cpu", init_scale=2.0**8)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd-weight-decay", "sgd-momentum"])
def test_autograd_grad_leaves_grad_none_where_torch_does(optimizer):
    """torch.autograd.grad(...) accumulates nothing into .grad: the arena hands no view out there (its hook
    is on the AccumulateGrad node, which autograd.grad does not run). A parameter that only autograd.grad
    reached keeps .grad None, and AdamW with weight decay leaves it alone, as with torch's scaler."""
    make = {"adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
            "sgd-weight-decay": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.1),
            "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}[optimizer]

    def program(arena, check):
        model = _Branchy()
        opt = make(model.parameters())
        if arena:
            amp_backends.flat_grads(opt, check=check)
        scaler = _scaler(arena)
        g = torch.Generator().manual_seed(3)
        history = []
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # the arena follows torch: no fallback
            for step in range(1, 5):  # the branch and the early head are used by the probe only (step 0's forward)
                opt.zero_grad()
                x = torch.randn(4, 6, generator=g)
                probe = torch.autograd.grad(model(x, 0).square().mean(), list(model.parameters()), allow_unused=True)
                assert all(t is not None for t in probe)
                scaler.scale(model(x, 1).square().mean()).backward()
                if arena:
                    assert model.branch.weight.grad is None and model.early.bias.grad is None
                scaler.step(opt)
                scaler.update()
                history.append(_observe(model))
        return history

    _against_torch(program)


def test_backward_with_inputs_hands_views_to_the_parameters_it_names_only():
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arena = amp_backends.flat_grads(opt)
    loss = model(torch.randn(4, 6), 0).sum()
    loss.backward(inputs=[model.trunk.weight, model.out.bias])
    assert model.trunk.weight.grad._base is arena.groups[0].buffer and model.out.bias.grad._base is arena.groups[0].buffer
    assert all(p.grad is None for n, p in model.named_parameters() if n not in ("trunk.weight", "out.bias"))
    assert arena.problem() is None


@pytest.mark.parametrize("numel", [1, 6])
def test_a_parameter_replaced_in_the_optimizers_list_is_seen(numel):
    """Model surgery: a parameter replaced in the module and in its group's list (same list, same length).
    The arena sees it before the op (the step runs per-tensor, warned, with torch's results), and after
    flat_grads(optimizer) again the new parameter's gradient is in the arena. A one-element parameter
    replaced by one equal in value is seen too (it compares equal by value)."""

    def program(arena, check):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, numel), torch.nn.Tanh(), torch.nn.Linear(numel, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        if arena:
            amp_backends.flat_grads(opt, check=check)
        scaler = _scaler(arena)
        g = torch.Generator().manual_seed(4)
        history = []
        for step in range(5):
            if step == 1:  # surgery: a new bias for the first layer, equal to the old one
                new = torch.nn.Parameter(model[0].bias.detach().clone())
                model[0].bias = new
                opt.param_groups[0]["params"][1] = new
            if step == 3 and arena:
                amp_backends.flat_grads(opt, check=check)  # what the warning asks for
            opt.zero_grad()
            scaler.scale(model(torch.randn(5, 3, generator=g)).square().mean()).backward()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", RuntimeWarning)
                scaler.step(opt)
            scaler.update()
            if arena:
                arena_now = flat_grads_of(opt)
                fallback = [str(w.message) for w in caught if "flat_grads" in str(w.message)]
                if step in (1, 2):  # per-tensor until flat_grads() again, said once
                    assert "parameter 1 of param group 0 is another tensor" in arena_now.problem()
                    assert len(fallback) == (step == 1) and all("is another tensor" in m for m in fallback)
                    assert "flat_grads(optimizer) again" in arena_now.problem()
                else:
                    assert not fallback, fallback
                    assert arena_now.problem() is None and model[0].bias.grad._base is arena_now.groups[0].buffer
            history.append(_observe(model))
        return history

    _against_torch(program)


def test_a_replaced_list_or_an_added_group_is_named():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arena = amp_backends.flat_grads(opt)
    opt.param_groups[0]["params"] = list(opt.param_groups[0]["params"])
    assert "param group 0's list of parameters was replaced" in arena.problem() and not arena.fits()
    amp_backends.flat_grads(opt)
    arena = flat_grads_of(opt)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    assert "2 param groups, 1 at flat_grads()" in arena.problem()


@pytest.mark.parametrize("check", ["refcount", "identity"])
def test_a_kept_view_and_a_pruned_gradient_in_the_same_step(check):
    """g = p.grad.detach() kept for analysis and q.grad = q.grad * mask (pruning) in the same step: the
    buffer's count stays balanced (one tensor more, one less), but the pruned gradient's view ended, and
    the arena sees it: each step equals torch's scaler, and so does the kept tensor."""

    def program(arena, check):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if arena:
            amp_backends.flat_grads(opt, check=check)
        scaler = _scaler(arena)
        g = torch.Generator().manual_seed(5)
        mask = (torch.arange(37 * 13) % 3 != 0).reshape(37, 13).float()
        history, kept = [], None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for _ in range(3):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(8, 13, generator=g)).float().pow(2).mean()
                scaler.scale(loss).backward()
                kept = model[2].weight.grad.detach()  # kept for analysis, across the next zero_grad too
                model[0].weight.grad = model[0].weight.grad * mask  # pruning
                scaler.step(opt)
                scaler.update()
                history.append({**_observe(model), "kept": kept.clone()})
        return history

    _against_torch(program, checks=(check,))


def test_refcount_check_blind_spots_are_the_documented_ones_and_identity_sees_them():
    """What "refcount" cannot tell, with no backward in between: the view object itself kept while .grad is
    replaced by hand; a view's .data swapped while as many new tensors share the buffer. identity can."""
    def replaced(w, b):
        old = w.grad
        w.grad = old * 2
        return old

    def swapped(w, b):
        extra = b.grad.detach()
        w.grad.data = torch.ones_like(w)
        return extra

    for leave in (replaced, swapped):
        for check, seen in (("refcount", False), ("identity", True)):
            model = _model()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            arena = amp_backends.flat_grads(opt, check=check)
            model(torch.randn(2, 13)).sum().backward()
            held = leave(model[0].weight, model[0].bias)
            assert (arena.problem() is not None) is seen, (leave.__name__, check)
            del held
            assert arena.problem() is not None, "once the other reference is gone, both see it"


def test_a_gradient_dropped_while_another_view_is_kept_is_seen_by_refcount():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arena = amp_backends.flat_grads(opt)
    model(torch.randn(2, 13)).sum().backward()
    kept = model[2].weight.grad.detach()
    model[0].bias.grad = None
    assert "still referenced elsewhere" in arena.problem()
    del kept
    assert arena.problem() is None, "nobody holds the dropped view: its slot is free again"
    assert model[0].bias.grad is None and arena._slots[0].drops == []


def _recreating(arena, check, keep_old):
    model = _model()
    def make() -> torch.optim.AdamW:
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    opt = make()
    if arena:
        amp_backends.flat_grads(opt, check=check)
    scaler = _scaler(arena)
    g = torch.Generator().manual_seed(6)
    history, old = [], None
    for step in range(5):
        if step == 2:  # the optimizer made again over the same parameters (a new learning-rate plan, say)
            if keep_old:
                old = opt
            gone = weakref.ref(opt)
            buffer = weakref.ref(flat_grads_of(opt).groups[0].buffer) if arena else None
            opt = make()
            if not keep_old:
                assert gone() is None, "nothing holds the old optimizer, its state or its arena"
            if arena:
                amp_backends.flat_grads(opt, check=check)  # the gradients present are copied in
                assert keep_old or buffer() is None, "the old arena's buffer is freed"
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(8, 13, generator=g)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if arena:
            assert flat_grads_of(opt).problem() is None
            assert all(p.grad._base is flat_grads_of(opt).groups[0].buffer for p in model.parameters())
        history.append(_observe(model))
    assert old is None or flat_grads_of(old) is None
    return history


def test_a_recreated_optimizer_frees_the_old_one_and_the_new_arena_keeps_the_fast_path():
    """A new optimizer over the same parameters, then flat_grads(new): the old optimizer, its state and
    its arena are freed (the hooks hold their arena weakly, the arena its optimizer), and the new arena
    takes every step on its buffers (no fallback, no warning), with torch's results."""
    def program(arena, check):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            return _recreating(arena, check, keep_old=False)

    _against_torch(program)


def test_flat_grads_over_parameters_another_live_arena_holds_takes_them_over():
    def program(arena, check):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            history = _recreating(arena, check, keep_old=True)
        messages = [str(w.message) for w in caught]
        if arena:
            assert len(messages) == 1 and "still alive (AdamW at" in messages[0] and "LR scheduler" in messages[0]
        return history

    _against_torch(program)
    # the other optimizer, still stepped, runs on the per-tensor path with torch's results
    model = _model()
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_backends.flat_grads(first)
    second = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="still alive"):
        amp_backends.flat_grads(second)
    assert flat_grads_of(first) is None and "zero_grad" not in vars(first)
    model(torch.randn(2, 13)).sum().backward()
    assert model[0].weight.grad._base is flat_grads_of(second).groups[0].buffer
    assert model[2].weight.grad._base is None, "the released arena hands nothing out"


def test_an_arena_outliving_its_optimizer_lets_go_of_the_parameters():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arena = amp_backends.flat_grads(opt)
    del opt
    assert arena.optimizer is None and arena.problem() is not None
    model(torch.randn(2, 13)).sum().backward()
    assert all(p.grad._base is None for p in model.parameters()), "its hooks went with the optimizer"


def test_a_parameter_given_a_new_node_is_hooked_again():
    """p.data swapped for another dtype and back gives the parameter a new AccumulateGrad node: one step
    per-tensor (warned), and the next zero_grad hooks the new node."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arena = amp_backends.flat_grads(opt)
    model.double().float()
    model(torch.randn(2, 13)).sum().backward()
    assert "outside the arena" in arena.problem()
    opt.zero_grad()
    model(torch.randn(2, 13)).sum().backward()
    assert arena.problem() is None and all(p.grad._base is arena.groups[0].buffer for p in model.parameters())


# -- the host cost per step: constant in the number of parameters ------------------------------------
def _sized(n: int, numel: int, check: str = "refcount"):
    params = [torch.nn.Parameter(torch.rand(numel) + 0.5) for _ in range(n)]
    opt = torch.optim.SGD(params, lr=0.1)
    amp_backends.flat_grads(opt, check=check)
    for p in params:
        p.grad = None
    loss = sum(p.sum() for p in params)
    scaler = GradScaler("cpu", init_scale=4.0)
    scaler.scale(loss).backward()
    return opt, scaler


@pytest.mark.parametrize("numel", [1, 4])
def test_the_checks_before_each_op_do_no_python_work_per_parameter(numel):
    """The issue's sizes in small: the arena's check and the whole ``unscale_`` make the same number of
    Python calls at 20 and 2000 parameters (round 4 compared each one-element parameter in Python: 2000
    more calls there). Counted, not timed: it holds on any machine."""
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    counts = {}
    for n in (20, 2000):
        opt, scaler = _sized(n, numel)
        arena = flat_grads_of(opt)
        assert arena.problem() is None
        problem = python_events(arena.problem)
        for _ in range(2):  # the second call counted: the first fills caches
            scaler._per_optimizer_states[id(opt)] = _refresh_per_optimizer_state()
            unscale = python_events(lambda: scaler.unscale_(opt))
        counts[n] = (problem, unscale)
    assert counts[20] == counts[2000], counts
    opt, scaler = _sized(2000, numel, check="identity")  # the check that looks at every parameter: it grows
    small, _ = _sized(20, numel, check="identity")
    assert python_events(flat_grads_of(opt).problem) > python_events(flat_grads_of(small).problem) + 1000


_MUTATIONS = {  # each leaves the list holding other tensors, or the same in another order
    "item": lambda ps, new: ps.__setitem__(1, new),
    "slice": lambda ps, new: ps.__setitem__(slice(1, 2), [new]),
    "insert, del": lambda ps, new: (ps.insert(1, new), ps.__delitem__(2)),
    "append, pop": lambda ps, new: (ps.append(new), ps.pop(1), ps.insert(1, ps.pop())),
    "remove, insert": lambda ps, new: (ps.remove(ps[0]), ps.insert(0, new)),
    "reverse": lambda ps, new: ps.reverse(),
    "sort": lambda ps, new: ps.sort(key=lambda p: -p.numel()),
    "+=, del": lambda ps, new: (ps.__iadd__([new]), ps.__delitem__(1), ps.insert(1, ps.pop())),
    "clear, extend": lambda ps, new: (lambda old: (ps.clear(), ps.extend([old[0], new, *old[2:]])))(list(ps)),
    "*=": lambda ps, new: ps.__imul__(2),
}


@pytest.mark.parametrize("how", list(_MUTATIONS))
def test_every_way_of_changing_a_groups_list_is_seen_and_undoing_it_is_not_a_change(how):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arena = amp_backends.flat_grads(opt)
    params = opt.param_groups[0]["params"]
    before = list(params)
    new = torch.nn.Parameter(torch.zeros_like(before[1]))
    _MUTATIONS[how](params, new)
    assert params is opt.param_groups[0]["params"]
    assert len(params) != len(before) or any(a is not b for a, b in zip(params, before))
    assert "changed since flat_grads()" in arena.problem() and not arena.fits()
    params[:] = before  # undone: the same tensors in the same order
    assert arena.problem() is None and arena.fits()
    params[0] = params[0]  # a change that changes nothing
    assert arena.problem() is None


def test_a_list_held_elsewhere_at_flat_grads_stays_the_optimizers_and_is_compared():
    """A reference to the group's list taken before flat_grads() still reaches the optimizer (the list is
    not swapped for a watched one), and a parameter replaced through it is seen, one-element ones included."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 1), torch.nn.Linear(1, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = opt.param_groups[0]["params"]
    arena = amp_backends.flat_grads(opt)
    assert opt.param_groups[0]["params"] is kept and type(kept) is list
    kept[1] = torch.nn.Parameter(kept[1].detach().clone())  # the one-element bias, equal in value
    assert "parameter 1 of param group 0 is another tensor" in arena.problem()


def test_a_watched_list_pickles_and_copies_as_a_plain_list():
    from amp_backends.gradients.watched import WatchedList

    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    amp_backends.flat_grads(opt)
    params = opt.param_groups[0]["params"]
    assert type(params) is WatchedList
    assert type(pickle.loads(pickle.dumps(params))) is list and type(copy.copy(params)) is list
    twin = copy.deepcopy(opt)
    assert type(twin.param_groups[0]["params"]) is list and len(twin.param_groups[0]["params"]) == len(params)
    opt.load_state_dict(opt.state_dict())
    assert opt.param_groups[0]["params"] is params and flat_grads_of(opt).problem() is None
