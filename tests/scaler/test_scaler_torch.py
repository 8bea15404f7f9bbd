"""GradScaler as a torch.amp.GradScaler: the behaviours torch's own GradScaler tests check
(test_torch.py's grad-scaling tests, test_cuda.py's fused-optimizer, preset-grad-scale and
pass-itself tests, on CPU), the members frameworks call, and the adversarial cases."""

from __future__ import annotations

import contextlib
import copy
import math
import pickle
import warnings

import pytest
import torch

import amp_backends
from amp_backends import GradScaler, StateDictError
from amp_backends.gradients.kernel import add_sum_of_squares
from torch.amp.grad_scaler import OptState


def _both(**kw):
    return {"ours": GradScaler("cpu", **kw), "torch": torch.amp.GradScaler("cpu", **kw)}


# -- a torch.amp.GradScaler, built the ways torch's is -----------------------------------
def test_is_a_torch_grad_scaler_and_takes_device_as_torch_spells_it():
    for scaler in (GradScaler("cpu"), GradScaler(device="cpu"), GradScaler(torch.device("cpu")),
                   GradScaler("cpu:0"), GradScaler(amp_backends.get("cpu"), device="cpu")):
        assert isinstance(scaler, torch.amp.GradScaler)
        assert scaler.backend.name == "cpu" and scaler._device == "cpu"
    with pytest.raises(ValueError, match="device='cuda' was also given"):
        GradScaler("cpu", device="cuda")
    with pytest.raises(TypeError, match="backend must be a backend name.*known backends: .*cpu"):
        GradScaler(3)  # type: ignore[arg-type]  # the wrong type on purpose: the refusal is the test
    with pytest.raises(amp_backends.UnknownBackendError, match="no backend serves device type 'meta'"):
        GradScaler(device="meta")


@pytest.mark.parametrize("kwarg", ["enabled", "check_finite"])
def test_a_string_where_a_bool_goes_is_refused(kwarg):
    with pytest.raises(TypeError, match=f"{kwarg} must be True or False, got str 'false'"):
        GradScaler("cpu", **{kwarg: "false"})
    assert GradScaler("cpu", **{kwarg: 0}).is_enabled() is (kwarg != "enabled")


def test_members_frameworks_call_exist_and_work():
    """Accelerate's FSDP2 load_state: load_state_dict, then _lazy_init_scale_growth_tracker(_device)."""
    scaler = GradScaler("cpu")
    scaler.load_state_dict({"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                            "growth_interval": 10, "_growth_tracker": 4})
    scaler._lazy_init_scale_growth_tracker(scaler._device)
    assert scaler._scale.item() == 512.0 and scaler._growth_tracker.item() == 4
    assert scaler._per_optimizer_states[123]["stage"] is OptState.READY
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    found = scaler._unscale_grads_(opt, torch.tensor(1 / 512.0), torch.zeros(()), False)
    assert list(found) == [torch.device("cpu")] and found[torch.device("cpu")].item() == 0.0


# -- fused-optimizer protocols -----------------------------------------------------------
@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_preset_grad_scale_after_unscale_is_applied(impl):
    """test_cuda.py's preset-grad-scale test on CPU: 1 - 0.1 * (15 / 5 / 3) = 0.9 on every torch."""
    weight = torch.ones(5, 5, requires_grad=True)
    weight.grad = torch.full_like(weight, 15.0)
    opt = torch.optim.SGD([weight], lr=0.1, fused=True)
    scaler = _both(init_scale=5.0)[impl]
    scaler.scale(torch.ones(5))
    scaler.unscale_(opt)
    opt.grad_scale = torch.tensor([3.0])
    scaler.step(opt)
    if impl == "ours" or torch.__version__ >= "2.5":  # torch 2.4's own scaler drops the preset
        assert torch.allclose(weight, torch.full_like(weight, 0.9))
    assert not hasattr(opt, "found_inf")


class _LambLike(torch.optim.Optimizer):
    """Modelled on torch_mlu's FusedLAMBAMP: scale and found_inf come only from ``grad_scaler``."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})
        self._step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        assert not hasattr(self, "grad_scale") and not hasattr(self, "found_inf")
        device = self.param_groups[0]["params"][0].device
        found = grad_scaler._check_inf_per_device(self)[device]
        inv = grad_scaler._get_scale_async().double().reciprocal().float()
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(torch.where(found == 0, p.grad * inv * group["lr"], 0.0))


def test_scaler_passes_itself_to_an_optimizer_that_asks():
    calls = []

    class Recording(amp_backends.TorchKernel):
        def grad_op_(self, group, found_inf, inv_scale=None, norm_sq=None):
            if inv_scale is None:
                calls.append(len(group.tensors))
            super().grad_op_(group, found_inf, inv_scale, norm_sq)

    be = copy.copy(amp_backends.get("cpu"))
    be.kernel = Recording()
    weight = torch.nn.Parameter(torch.ones(4))
    opt = _LambLike([weight])
    scaler = GradScaler(be, init_scale=8.0)
    for step, grad in enumerate([torch.full((4,), 8.0), torch.tensor([8.0, math.inf, 8.0, 8.0])]):
        scaler.scale(torch.ones(()))
        weight.grad = grad
        before = weight.detach().clone()
        with pytest.warns(FutureWarning, match="passing itself"):
            scaler.step(opt)
        scaler.update()
        if step == 0:
            assert torch.allclose(weight, before - 0.1) and not scaler.last_step_skipped
        else:
            assert torch.equal(weight, before) and scaler.last_step_skipped
    assert calls == [1, 1], "the optimizer's check ran on the backend's kernel"
    assert scaler.get_scale() == 4.0 and scaler.stats.skipped == 1 and scaler.stats.steps == 1


def test_fused_optimizer_without_gradients_is_a_no_op_and_not_counted():
    used, idle = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    opt_used = torch.optim.AdamW(used.parameters(), fused=True)
    opt_idle = torch.optim.AdamW(idle.parameters(), fused=True)
    scaler = GradScaler("cpu")
    scaler.scale(used(torch.ones(1, 2)).sum()).backward()
    before = [p.detach().clone() for p in idle.parameters()]
    scaler.step(opt_idle)  # torch: a no-op
    scaler.step(opt_used)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, idle.parameters()))
    assert scaler.stats.steps == 1 and scaler.stats.skipped == 0 and not scaler.last_step_skipped


def test_grad_scaling_autocast_fused_optimizers_match_torch():
    """test_cuda.py's fused-optimizer test on CPU: fused Adam/AdamW/SGD with ours == with torch's."""
    for ctor in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        results = {}
        for impl in ("ours", "torch"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
            opt = ctor(model.parameters(), lr=1e-2, fused=True)
            scaler = _both(init_scale=128.0, growth_interval=1)[impl]
            for step in range(5):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(4, 8)).float().pow(2).mean()
                scaler.scale(loss).backward()
                if step == 2:
                    model[0].weight.grad[0, 0] = math.nan
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            results[impl] = ([p.detach() for p in model.parameters()], scaler.get_scale())
        assert results["ours"][1] == results["torch"][1]
        assert all(torch.equal(a, b) for a, b in zip(results["ours"][0], results["torch"][0])), ctor.__name__


# -- torch's test_torch.py grad-scaling behaviours ---------------------------------------
def test_grad_scale_will_not_overflow():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    opt = torch.optim.Adam(model.parameters())
    scaler = GradScaler("cpu", growth_interval=1, growth_factor=2**4, init_scale=1e38)
    x, y = torch.randn(1, 5), 1e-30 * torch.randn(1, 1)
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    assert math.isfinite(scaler.get_scale())


def test_gradient_penalty_and_sparse_gradients_match_torch():
    """The AMP docs' gradient-penalty recipe and an embedding with sparse gradients (repeated indices)."""
    results = {}
    for impl in ("ours", "torch"):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 4, sparse=True)
        lin = torch.nn.Linear(4, 1)
        opts = [torch.optim.SGD(emb.parameters(), lr=0.1), torch.optim.SGD(lin.parameters(), lr=0.1)]
        scaler = _both(init_scale=64.0, growth_interval=2)[impl]
        for step in range(4):
            idx = torch.tensor([1, 1, 3, 7, 1])
            with torch.autocast("cpu", dtype=torch.float16):
                out = lin(emb(idx)).float().sum()
            grads = torch.autograd.grad(scaler.scale(out), lin.parameters(), create_graph=True)
            inv = 1.0 / scaler.get_scale()
            penalty = sum((g * inv).pow(2).sum() for g in grads).sqrt()
            scaler.scale(out + penalty).backward()
            if step == 1:
                lin.bias.grad[0] = math.inf
            for opt in opts:
                scaler.step(opt)
            scaler.update()
            for opt in opts:
                opt.zero_grad()
        results[impl] = ([p.detach().clone() for p in [*emb.parameters(), *lin.parameters()]], scaler.get_scale())
    assert results["ours"][1] == results["torch"][1] == 64.0
    assert all(torch.equal(a, b) for a, b in zip(results["ours"][0], results["torch"][0]))


def test_pickle_round_trip_keeps_settings_and_backend():
    scaler = GradScaler("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)
    fresh = pickle.loads(pickle.dumps(scaler))
    assert isinstance(fresh, GradScaler) and fresh.backend is amp_backends.get("cpu")
    assert (fresh.get_scale(), fresh.get_growth_factor(), fresh.get_backoff_factor(), fresh.get_growth_interval()) == (
        3.0, 4.0, 0.25, 2)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    again = pickle.loads(pickle.dumps(scaler))
    assert again.state_dict() == scaler.state_dict() and again.stats.scale == scaler.get_scale()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(AssertionError, match="only be pickled at the beginning"):
        pickle.dumps(scaler)  # mid-iteration, as torch refuses
    with _a_process_group() as group, pytest.raises(TypeError, match="process group object cannot be pickled"):
        pickle.dumps(GradScaler("cpu", process_group=group))


@contextlib.contextmanager
def _a_process_group():
    """A real ProcessGroup object of one rank: built directly where this torch allows it, else
    the default group of a one-process Gloo world, torn down afterwards."""
    import torch.distributed as dist

    for make in (lambda: dist.ProcessGroup(dist.HashStore(), 0, 1),
                 lambda: dist.ProcessGroup(dist.HashStore(), 0, 1, dist.ProcessGroup.Options(backend="gloo"))):
        try:
            group = make()
        except (TypeError, RuntimeError, AttributeError):
            continue
        yield group
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


# -- clip_grad_norm_ ------------------------------------------------------------------------
def _clip_run(use_scaler: bool, fused: bool = False, sparse: bool = False):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(6, 8, sparse=sparse)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    params = [*emb.parameters(), *model.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=fused) if fused else torch.optim.SGD(params, lr=0.1)
    scaler = (GradScaler if use_scaler else torch.amp.GradScaler)("cpu", init_scale=2.0**10)
    norms = []
    for step in range(4):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(emb(torch.tensor([0, 2, 2, 5]))).float().pow(2).sum()
        scaler.scale(loss).backward()
        if use_scaler:
            norms.append(scaler.clip_grad_norm_(opt, 0.5))
        else:
            scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(params, 0.5))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return norms, [p.detach() for p in params]


def test_clip_grad_norm_is_bitwise_torchs_recipe_with_the_torch_kernel():
    ours, ref = _clip_run(True), _clip_run(False)
    assert all(torch.equal(a, b) for a, b in zip(ours[0], ref[0])), (ours[0], ref[0])
    assert all(torch.equal(a, b) for a, b in zip(ours[1], ref[1]))


def test_clip_grad_norm_of_sparse_gradients_equals_the_dense_equivalent():
    """torch's clip_grad_norm_ cannot measure sparse gradients; the scaler's measures them coalesced."""
    ours, dense = _clip_run(True, sparse=True), _clip_run(False)
    for a, b in zip(ours[0] + ours[1][1:], dense[0] + dense[1][1:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours[1][0], dense[1][0].to(ours[1][0].dtype), rtol=1e-5, atol=1e-6)


def test_clip_grad_norm_folded_into_a_fused_optimizer_equals_up_to_rounding():
    ours, ref = _clip_run(True, fused=True), _clip_run(False, fused=True)
    for a, b in zip(ours[0] + ours[1], ref[0] + ref[1]):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)


def test_sparse_gradient_norm_counts_a_repeated_index_once():
    param = torch.nn.Parameter(torch.zeros(4, 2))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = GradScaler("cpu", init_scale=1.0)
    scaler.scale(torch.ones(()))
    param.grad = torch.sparse_coo_tensor(torch.tensor([[1, 1]]), torch.tensor([[3.0, 0.0], [1.0, 0.0]]), (4, 2))
    norm = scaler.clip_grad_norm_(opt, 100.0)
    assert norm.item() == 4.0, "coalesced: row 1 is 3 + 1 = 4, not sqrt(3^2 + 1^2)"


def test_norms_accumulate_in_fp32_whatever_the_gradient_dtype():
    big = torch.full((20, 20), 60000.0, dtype=torch.float16)[::2, ::3]  # strided: no Triton, torch's op
    ones = torch.ones(100000, dtype=torch.bfloat16)[::2]
    for grad, expected in ((big, 60000.0**2 * 70), (ones, 50000.0)):
        norm_sq = torch.zeros(())
        add_sum_of_squares([grad], norm_sq)
        # in fp16 the norm (502000) would be inf; in bf16 sqrt(50000) rounds to 223 (norm^2 49729)
        assert norm_sq.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_an_underflowed_scale_gives_an_inf_norm_not_nan(fused):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), fused=fused)
    scaler = GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 4)).sum()).backward()
    model.weight.grad.zero_()
    scaler._scale.fill_(0.0)  # what ~150 consecutive back-offs reach: inv_scale = inf
    norm = scaler.clip_grad_norm_(opt, 1.0)
    assert math.isinf(norm.item())


# -- adversarial: step, update, state -------------------------------------------------------
def test_closure_is_forwarded_by_a_disabled_scaler_and_refused_with_check_finite():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=2)

    def closure():
        opt.zero_grad()
        loss = model(torch.ones(3, 2)).pow(2).sum()
        loss.backward()
        return loss

    assert GradScaler("cpu", enabled=False).step(opt, closure) is not None
    assert GradScaler("cpu", enabled=False).step(opt, closure=closure) is not None
    with pytest.raises(RuntimeError, match="run the closure"):
        GradScaler("cpu", enabled=False, check_finite=True).step(opt, closure=closure)


def test_a_step_that_raises_is_not_counted():
    class Failing(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("boom")

    model = torch.nn.Linear(2, 1)
    opt = Failing(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    with pytest.raises(RuntimeError, match="boom"):
        scaler.step(opt)
    assert scaler.stats.steps == 0 and scaler.stats.skipped == 0


def test_stats_scale_equals_get_scale_for_a_scale_float32_cannot_hold():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler("cpu", init_scale=0.1 * 2**20, growth_interval=1)
    assert scaler.stats.scale == scaler.get_scale()
    for _ in range(3):
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert scaler.stats.scale == scaler.get_scale()
    scaler.update(0.3)
    assert scaler.stats.scale == scaler.get_scale()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"scale": 1e39}, "does not fit a float32"),
        ({"scale": 1e-46}, "does not fit a float32"),
        ({"_growth_tracker": 2**40}, "int32"),
        ({"growth_interval": 2**40}, "growth_interval"),
    ],
)
def test_state_dict_values_that_do_not_fit_the_tensors_are_refused_unchanged(change, match):
    scaler = GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))
    before = scaler.state_dict()
    good = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 100, "_growth_tracker": 3}
    with pytest.raises(StateDictError, match=match):
        scaler.load_state_dict({**good, **change})
    assert scaler.state_dict() == before


def test_manual_update_validates_and_accepts_what_torch_would():
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    scaler.update(1024)  # an int: torch's own scaler crashes on it
    assert scaler.get_scale() == 1024.0
    scaler.update(torch.tensor([256.0]))
    assert scaler.get_scale() == 256.0
    for bad, match in [(-1.0, "new_scale must be a finite number > 0"), (1e39, "does not fit a float32"),
                       (torch.ones(2), "one-element"), (torch.ones(1, requires_grad=True), "one-element")]:
        with pytest.raises(ValueError, match=match):
            scaler.update(bad)
    assert scaler.get_scale() == 256.0


def test_low_scale_warning_fires_with_a_fused_optimizer():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    scaler = GradScaler("cpu", init_scale=8.0)
    warned_at = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(70):
            scaler.scale(model(torch.ones(1, 2)).sum() * math.nan).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if warned_at is None and any("loss scale fell" in str(w.message) for w in caught):
                warned_at = step
    relevant = [w for w in caught if "loss scale fell" in str(w.message)]
    assert len(relevant) == 1 and scaler.stats.overflows == 70 and scaler.stats.skipped == 70
    # 8 -> 4 -> 2 -> 1 -> 0.5 at update 3; read without a sync at the next update, not 60 later
    assert warned_at == 4, warned_at
    assert "fell to 0.5 " in str(relevant[0].message)


def test_stage_bookkeeping_is_torchs():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.clip_grad_norm_(opt, 1.0)
    assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.UNSCALED
    scaler.step(opt)
    assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.STEPPED
    scaler.update()
    assert len(scaler._per_optimizer_states) == 0
