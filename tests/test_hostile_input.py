"""Bad arguments to the public API: a clear error (a TypeError/ValueError/AmpBackendsError naming
the problem), never a raw AttributeError/OverflowError or a silently wrong result, and nothing
changed by the refused call: the scaler's state, the parameters and the gradients are as before.

The generated part crosses each argument of the scaler's entry points with a pool of hostile
values (non-finite and out-of-range numbers, wrong types, tensors of the wrong shape or dtype or
value): several hundred cases per run.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import amp_backends
from amp_backends import AmpBackendsError, GradScaler, StateDictError

CLEAR = (TypeError, ValueError, RuntimeError, AmpBackendsError)
RAW = ("unhashable", "object has no attribute", "'NoneType' object", "can't multiply", "not supported between")


class _Opaque:
    """An object of no numeric kind (its repr is stable: test ids must match across xdist workers)."""

    def __repr__(self) -> str:
        return "<opaque>"


def _setup(enabled: bool = True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = GradScaler("cpu", init_scale=16.0, growth_interval=3, enabled=enabled)
    scaler.scale(model(torch.randn(3, 4)).square().sum()).backward()
    return model, opt, scaler


def _snapshot(model, opt, scaler):
    params = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    stage = scaler._per_optimizer_states[id(opt)]["stage"] if scaler.is_enabled() else None
    return params, grads, scaler.state_dict(), stage, scaler.get_scale()


def _unchanged(before, after) -> bool:
    (p0, g0, s0, st0, sc0), (p1, g1, s1, st1, sc1) = before, after
    return (all(torch.equal(a, b) for a, b in zip(p0, p1)) and all(torch.equal(a, b) for a, b in zip(g0, g1))
            and s0 == s1 and st0 is st1 and sc0 == sc1)


def _refused(call) -> str:
    with pytest.raises(CLEAR) as info:
        call()
    message = str(info.value)
    assert message and not any(raw in message for raw in RAW), message
    return message


# -- the items found by hand, each its own test ---------------------------------------------
@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -4.0, 1e39])
def test_update_with_a_bad_tensor_scale_is_refused(value):
    model, opt, scaler = _setup()
    scaler.step(opt)
    before = scaler.get_scale()
    message = _refused(lambda: scaler.update(torch.tensor(value)))
    assert "new_scale must be finite and > 0" in message
    assert scaler.get_scale() == before
    scaler.update(torch.tensor(8.0))  # a good one still works afterwards
    assert scaler.get_scale() == 8.0


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_norm": math.nan}, "max_norm must be a number >= 0"),
    ({"max_norm": -1.0}, "max_norm must be a number >= 0"),
    ({"max_norm": "1"}, "max_norm must be a number >= 0"),
    ({"max_norm": 1.0, "norm_type": math.nan}, "norm_type must be a number > 0"),
    ({"max_norm": 1.0, "norm_type": -2.0}, "norm_type must be a number > 0"),
])
def test_clip_with_bad_numbers_is_refused_and_changes_nothing(kwargs, match):
    model, opt, scaler = _setup()
    before = _snapshot(model, opt, scaler)
    assert match in _refused(lambda: scaler.clip_grad_norm_(opt, **kwargs))
    assert _unchanged(before, _snapshot(model, opt, scaler))


def test_clip_takes_the_optimizer_and_not_after_step():
    model, opt, scaler = _setup()
    message = _refused(lambda: scaler.clip_grad_norm_(model.parameters(), 1.0))
    assert "scaler.clip_grad_norm_(optimizer, max_norm)" in message
    assert math.isfinite(scaler.clip_grad_norm_(opt, math.inf).item()), "inf: measure without clipping"
    scaler.step(opt)
    assert "after step()" in _refused(lambda: scaler.clip_grad_norm_(opt, 1.0))


@pytest.mark.parametrize("enabled", ["no", 2, None, [True]])
def test_enabled_must_be_a_bool_everywhere(enabled):
    be = amp_backends.get("cpu")
    assert "enabled must be True or False" in _refused(lambda: be.grad_scaler(torch.float16, enabled=enabled))
    assert "enabled must be True or False" in _refused(lambda: GradScaler("cpu", enabled=enabled))


@pytest.mark.parametrize("group", ["wrld", 123, _Opaque()])
def test_process_group_is_checked_when_the_scaler_is_built(group):
    assert "process_group must be None, 'world'" in _refused(lambda: GradScaler("cpu", process_group=group))


@pytest.mark.parametrize("value", ["inf", "1e300", "abc", "-1", "0", "nan"])
def test_probe_timeout_variable_is_refused_naming_itself(monkeypatch, value):
    from amp_backends.registry import probe_timeout

    monkeypatch.setenv("AMP_BACKENDS_PROBE_TIMEOUT", value)
    assert f"AMP_BACKENDS_PROBE_TIMEOUT={value!r}" in _refused(probe_timeout)
    monkeypatch.setenv("AMP_BACKENDS_PROBE_TIMEOUT", "2.5")
    assert probe_timeout() == 2.5


@pytest.mark.parametrize(("patch", "match"), [
    ({"scale": 10**400}, "does not fit a float"),
    ({"scale": 1e-40}, "reciprocal overflows float32|does not fit a float32|> 0"),
])
def test_state_dict_extremes_are_state_dict_errors(patch, match):
    scaler = GradScaler("cpu", init_scale=16.0, growth_interval=3)
    state = {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": 1}
    scaler.load_state_dict(state)
    with pytest.raises(StateDictError, match=match):
        scaler.load_state_dict({**state, **patch})
    assert scaler.state_dict() == state


@pytest.mark.parametrize("dtype", [[1], {"a": 1}, 3.5, torch.int32, "float128"])
def test_autocast_with_a_non_dtype_says_so(dtype):
    be = amp_backends.get("cpu")
    message = _refused(lambda: be.autocast(dtype))
    assert "supports" in message or "supported" in message


def test_an_arena_refusing_fp16_parameters_touches_no_buffer():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).half())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arena = amp_backends.flat_grads(opt)
    scaler = GradScaler("cpu", init_scale=16.0)
    x = torch.randn(2, 4)
    scaler.scale(model[0](x).sum() + model[1](x.half()).float().sum()).backward()
    buffers = [g.buffer.clone() for g in arena.groups]
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)
    assert all(torch.equal(b, g.buffer) for b, g in zip(buffers, arena.groups)), "nothing unscaled"
    from torch.amp.grad_scaler import OptState

    assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY


# -- generated: every argument against a pool of hostile values ------------------------------
HOSTILE_NUMBERS = [math.nan, math.inf, -math.inf, -1.0, 0.0, 10**400, True, "2", None, [2.0], _Opaque()]
HOSTILE_INTS = [0, -1, 2**31, 2.5, math.nan, "3", None, True, 10**30]
HOSTILE_TENSORS = [torch.tensor([1.0, 2.0]), torch.tensor(2, dtype=torch.int64), torch.tensor(math.nan),
                   torch.tensor(-1.0), torch.tensor(0.0), torch.tensor(2.0, requires_grad=True), torch.tensor(math.inf)]


def _ctor_cases():
    good = {"init_scale": 16.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3}
    pools = {"init_scale": HOSTILE_NUMBERS + [1e39], "growth_factor": HOSTILE_NUMBERS + [1.0, 0.5],
             "backoff_factor": HOSTILE_NUMBERS + [1.0, 1.5], "growth_interval": HOSTILE_INTS}
    for key, pool in pools.items():
        for bad in pool:
            yield pytest.param({**good, key: bad}, id=f"{key}={bad!r}"[:60])
    # two bad arguments at once: the error names one of them, and still nothing is built
    for (k1, p1), (k2, p2) in itertools.combinations(pools.items(), 2):
        for b1, b2 in zip(p1[:6], p2[:6]):
            yield pytest.param({**good, k1: b1, k2: b2}, id=f"{k1}={b1!r},{k2}={b2!r}"[:60])


@pytest.mark.parametrize("kwargs", list(_ctor_cases()))
def test_generated_constructor_arguments(kwargs):
    _refused(lambda: GradScaler("cpu", **kwargs))


SETTERS = {"set_growth_factor": HOSTILE_NUMBERS + [1.0, 0.5], "set_backoff_factor": HOSTILE_NUMBERS + [1.0, 2.0],
           "set_growth_interval": HOSTILE_INTS}


@pytest.mark.parametrize(("setter", "bad"), [(s, b) for s, pool in SETTERS.items() for b in pool],
                         ids=lambda v: repr(v)[:40])
def test_generated_setter_arguments(setter, bad):
    model, opt, scaler = _setup()
    before = _snapshot(model, opt, scaler)
    _refused(lambda: getattr(scaler, setter)(bad))
    assert _unchanged(before, _snapshot(model, opt, scaler))


@pytest.mark.parametrize("bad", [b for b in HOSTILE_NUMBERS + HOSTILE_TENSORS if b is not None] + [1e39],
                         ids=lambda v: repr(v)[:40])
def test_generated_update_arguments(bad):
    model, opt, scaler = _setup()
    scaler.step(opt)
    before = scaler.get_scale()
    _refused(lambda: scaler.update(bad))
    assert scaler.get_scale() == before


def _clip_cases():
    for bad in HOSTILE_NUMBERS:
        if bad is True or (isinstance(bad, (int, float)) and not isinstance(bad, bool) and not bad < 0):
            if not (isinstance(bad, float) and math.isnan(bad)):
                continue  # 0 (clip to nothing), inf and huge max_norm (no clipping) are legitimate
        yield pytest.param({"max_norm": bad}, id=f"max_norm={bad!r}"[:40])
    for bad in [math.nan, -1.0, 0.0, -math.inf, "2", None, [2.0]]:
        yield pytest.param({"max_norm": 1.0, "norm_type": bad}, id=f"norm_type={bad!r}"[:40])


@pytest.mark.parametrize("kwargs", list(_clip_cases()))
@pytest.mark.parametrize("arena", [False, True])
def test_generated_clip_arguments(kwargs, arena):
    model, opt, scaler = _setup()
    if arena:
        amp_backends.flat_grads(opt)
    before = _snapshot(model, opt, scaler)
    _refused(lambda: scaler.clip_grad_norm_(opt, **kwargs))
    assert _unchanged(before, _snapshot(model, opt, scaler))
    scaler.step(opt)  # the iteration goes on normally after a refusal
    scaler.update()


@pytest.mark.parametrize("tracker", [3, 7])
def test_a_tracker_past_the_interval_loads_one_short_of_it_with_a_warning(tracker):
    """torch's set_growth_interval may leave its tracker past a shortened interval (its scale then never
    grows); such a state loads one short of the interval, saying so."""
    scaler = GradScaler("cpu", init_scale=16.0, growth_interval=3)
    state = {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": tracker}
    with pytest.warns(RuntimeWarning, match="not below growth_interval"):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == {**state, "_growth_tracker": 2}


STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _valid_field(key: str, value: object) -> bool:
    """Whether ``value`` is a valid value of state_dict[key] (growth_interval 3, tracker 1 beside it)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value or abs(value) >= 1e300:
        return False
    return {"scale": 3e-39 < value < 3e38, "growth_factor": 1 < value, "backoff_factor": 0 < value < 1,
            "growth_interval": isinstance(value, int) and 3 <= value < 2**31,
            "_growth_tracker": isinstance(value, int) and 0 <= value < 2**31}[key]


@pytest.mark.parametrize(("key", "bad"), [(k, b) for k in STATE_KEYS for b in HOSTILE_NUMBERS + ["x", -5, 2**40]
                                          if not _valid_field(k, b)], ids=lambda v: repr(v)[:40])
def test_generated_state_dict_fields(key, bad):
    scaler = GradScaler("cpu", init_scale=16.0, growth_interval=3)
    state = {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": 1}
    scaler.load_state_dict(state)
    with pytest.raises(StateDictError):
        scaler.load_state_dict({**state, key: bad})
    assert scaler.state_dict() == state


@pytest.mark.parametrize("dtype", [None, "float64", torch.float64, torch.int8, 16, [1], "", "torch.float32x"],
                         ids=repr)
@pytest.mark.parametrize("name", ["autocast", "grad_scaler"])
def test_generated_dtype_arguments(name, dtype):
    be = amp_backends.get("cpu")
    if dtype is None:
        getattr(be, name)(dtype)  # the default
        return
    _refused(lambda: getattr(be, name)(dtype))


# -- round 3: the scaler's smaller surprises ------------------------------------------------------
@pytest.mark.parametrize("value", [torch.tensor(8.0), torch.tensor([8.0]), torch.tensor(8, dtype=torch.int64),
                                   torch.tensor(8.0, dtype=torch.float64)], ids=["0d", "1-element", "int", "float64"])
def test_init_scale_may_be_a_one_element_tensor_as_torch_takes_it(value):
    scaler = GradScaler("cpu", init_scale=value, growth_factor=torch.tensor(2.0))
    reference = torch.amp.GradScaler("cpu", init_scale=value)
    model, opt, _ = _setup()
    scaler.scale(model(torch.randn(3, 4)).sum())
    assert scaler.get_scale() == 8.0 and float(reference.get_scale()) == 8.0


@pytest.mark.parametrize("value", [torch.tensor([8.0, 8.0]), torch.tensor(True), torch.tensor(math.nan),
                                   torch.tensor(-8.0)],
                         ids=["two-elements", "bool", "nan", "negative"])
def test_a_tensor_init_scale_that_is_not_a_positive_number_is_refused(value):
    message = _refused(lambda: GradScaler("cpu", init_scale=value))
    assert "scale must be a finite number > 0" in message


def test_the_returned_norm_is_the_callers_and_the_stats_keep_theirs():
    model, opt, scaler = _setup()
    norm = scaler.clip_grad_norm_(opt, 1.0)
    kept = float(scaler.stats.grad_norm)
    norm.div_(4.0)  # a caller scaling its copy for logging
    assert float(scaler.stats.grad_norm) == kept and float(norm) == kept / 4.0


@pytest.mark.parametrize("bad", ["model", "none", "params"])
def test_found_inf_takes_the_optimizer(bad):
    model, opt, scaler = _setup()
    scaler.unscale_(opt)
    value = {"model": model, "none": None, "params": list(model.parameters())}[bad]
    message = _refused(lambda: scaler.found_inf(value))
    assert "found_inf takes the optimizer" in message
    assert scaler.found_inf(opt) is False
