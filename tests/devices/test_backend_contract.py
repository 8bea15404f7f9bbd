"""The declarative part of the backend contract, on CPU backends that declare what a real
device's op cannot do: the core adapts, with torch's results."""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

import amp_backends
from amp_backends import GradScaler, TorchKernel
from amp_backends.cli.info import collect, render
from amp_backends.gradients.groups import FlatGroup
from amp_backends.testing import grad_op_


class StrictKernel(TorchKernel):
    """torch's op behind the limits of torch_mlu's (csrc/aten/operators/bang/amp_unscale.cpp):
    float32 and float16 only, at most ``limit`` elements per tensor."""

    name = "strict"

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.seen: list[tuple[torch.dtype, int]] = []

    def _admit(self, grads):
        for g in grads:
            if g.dtype not in (torch.float32, torch.float16):
                raise RuntimeError("Currently amp_unscale only support float32 and float16 dtype")
            if self.limit is not None and g.numel() > self.limit:
                raise RuntimeError(f"amp_unscale: tensor of {g.numel()} elements over the limit")
            self.seen.append((g.dtype, g.numel()))

    def grad_op_(self, group, found_inf, inv_scale=None, norm_sq=None):
        self._admit([group.buffer] if isinstance(group, FlatGroup) else group.tensors)
        super().grad_op_(group, found_inf, inv_scale, norm_sq)


def _backend(**declared) -> amp_backends.Backend:
    be = copy.copy(amp_backends.get("cpu"))
    kernel = declared.pop("kernel", None)
    for key, value in declared.items():
        setattr(be, key, value)
    be.kernel = kernel or StrictKernel()
    return be


def _grads(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = (torch.randn(3, 4, generator=g) * 1000).to(dtype)
    transposed = (torch.randn(4, 3, generator=g) * 1000).to(dtype).t()
    sliced = (torch.randn(6, 6, generator=g) * 1000).to(dtype)[::2, 1::2]
    return [dense, transposed, sliced]


@pytest.mark.parametrize("bad", [None, math.inf, math.nan])
def test_gradients_of_dtypes_the_op_refuses_go_through_float32_with_torchs_results(bad):
    strict = _backend()
    with pytest.raises(RuntimeError, match="only support float32 and float16"):
        grad_op_(strict, _grads(torch.bfloat16), torch.zeros(()), torch.tensor(0.125))
    be = _backend(unscale_dtypes=(torch.float32, torch.float16))
    ours, ref = _grads(torch.bfloat16), _grads(torch.bfloat16)
    if bad is not None:
        ours[2][1, 1] = ref[2][1, 1] = bad
    found, ref_found = torch.zeros(()), torch.zeros(())
    grad_op_(be, ours, found, torch.tensor(0.125))
    torch._amp_foreach_non_finite_check_and_unscale_(ref, ref_found, torch.tensor(0.125))
    assert found.item() == ref_found.item() == (0.0 if bad is None else 1.0)
    for a, b in zip(ours, ref):
        assert a.dtype == torch.bfloat16 and a.stride() == b.stride()
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert {d for d, _ in be.kernel.seen} == {torch.float32}, "the device's op saw only what it accepts"
    before = [g.clone() for g in ours]
    found.zero_()
    grad_op_(be, ours, found)
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(ours, before)), "read-only stays read-only"


def test_tensors_over_the_element_limit_go_in_slices():
    be = _backend(max_tensor_elements=5, kernel=StrictKernel(limit=5))
    ours, ref = _grads(torch.float32), _grads(torch.float32)
    ours[1][2, 3] = ref[1][2, 3] = math.inf  # the last element of a transposed (non-contiguous) gradient
    found, ref_found = torch.zeros(()), torch.zeros(())
    grad_op_(be, ours, found, torch.tensor(0.5))
    torch._amp_foreach_non_finite_check_and_unscale_(ref, ref_found, torch.tensor(0.5))
    assert found.item() == ref_found.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert max(n for _, n in be.kernel.seen) <= 5


def test_a_scaler_trains_bf16_parameters_on_a_strict_device():
    """check_finite with bf16 gradients: the conformance case that would raise on an MLU590."""
    be = _backend(unscale_dtypes=(torch.float32, torch.float16), max_tensor_elements=16, kernel=StrictKernel(16))
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(be, enabled=False, check_finite=True)
    for step in range(3):
        scaler.scale(model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum()).backward()
        if step == 1:
            model.weight.grad[3, 7] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert scaler.last_step_skipped is (step == 1)


class StatusRegister:
    """A device-wide overflow flag, as torch_npu keeps on chips without inf/NaN mode."""

    def __init__(self) -> None:
        self.overflow = False
        self.clears = 0


def _status_backend(register: StatusRegister) -> amp_backends.Backend:
    be = _backend(global_overflow_status=True, has_fp64=False)

    def clear(self):
        register.overflow = False
        register.clears += 1

    def read(self, found_inf):
        found_inf.fill_(1.0 if register.overflow else 0.0)
        register.overflow = False

    be.clear_overflow_status = types.MethodType(clear, be)
    be.read_overflow_status_ = types.MethodType(read, be)
    return be


def test_a_global_overflow_status_is_cleared_by_scale_and_read_by_unscale():
    register = StatusRegister()
    be = _status_backend(register)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(be, init_scale=8.0)
    skipped = []
    for step in range(4):
        register.overflow = True  # left over from the previous step's forward: scale() clears it
        loss = scaler.scale(model(torch.ones(1, 4)).sum())
        if step == 2:
            register.overflow = True  # an overflow during this step's backward
        loss.backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(scaler.last_step_skipped)
    assert skipped == [False, False, True, False] and register.clears == 4
    assert scaler.get_scale() == 4.0
    assert be.kernel.seen == [], "the tensors are not inspected: the status is the check"


def test_the_status_is_cleared_once_per_iteration_and_held_for_every_optimizer():
    """torch_npu's semantics: the first scale() after update() clears; later scale() calls of the
    iteration (accumulation) do not; one read serves every optimizer of the iteration; an
    overflowing group is left scaled and its norm is inf."""
    register = StatusRegister()
    be = _status_backend(register)
    a, b = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    scaler = GradScaler(be, init_scale=8.0)
    scaler.scale(a(torch.ones(1, 4)).sum()).backward()
    register.overflow = True  # micro-batch 1's backward overflowed
    scaler.scale(b(torch.ones(1, 4)).sum()).backward()  # micro-batch 2: must not clear it
    assert register.clears == 1 and register.overflow
    grad_before = a.weight.grad.clone()
    scaler.unscale_(opt_a)
    assert torch.equal(a.weight.grad, grad_before), "left scaled, as the device's op leaves them"
    assert not register.overflow, "the read reset the register"
    assert math.isinf(scaler.clip_grad_norm_(opt_b, 1.0).item()), "the iteration's overflow holds for opt_b"
    scaler.step(opt_a)
    scaler.step(opt_b)  # the register was reset by the read: the iteration's overflow still holds
    assert scaler.last_step_skipped
    scaler.update()
    assert scaler.get_scale() == 4.0 and scaler.stats.skipped == 2 and scaler.stats.overflows == 1
    scaler.scale(a(torch.ones(1, 4)).sum()).backward()
    scaler.step(opt_a)
    assert not scaler.last_step_skipped and register.clears == 2


def test_without_float64_one_over_scale_is_computed_in_float32():
    class Float64Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.double:
                self.calls += 1
            return func(*args, **(kwargs or {}))

    for has_fp64, expected in ((True, True), (False, False)):
        be = _backend(has_fp64=has_fp64)
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = GradScaler(be, init_scale=3.0)
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        grad = model.weight.grad.clone()
        with Float64Calls() as mode:
            scaler.unscale_(opt)
        assert (mode.calls > 0) is expected
        torch.testing.assert_close(model.weight.grad, grad / 3.0, rtol=1e-6, atol=0)


def test_static_loss_scaling_keeps_the_scale_and_still_skips():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=128.0, growth_interval=1, dynamic=False)
    for step in range(4):
        scaler.scale(model(torch.ones(1, 2)).sum() * (math.inf if step == 1 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert scaler.get_scale() == 128.0 and scaler.stats.scale == 128.0
    assert scaler.stats.skipped == 1 and scaler.stats.overflows == 1
    with pytest.raises(TypeError, match="dynamic must be True or False"):
        GradScaler("cpu", dynamic="no")


def test_supported_dtypes_keep_only_autocast_dtypes(monkeypatch):
    """torch_npu's get_amp_supported_dtype() lists float32 too."""
    monkeypatch.setattr(torch, "fakenpu", types.SimpleNamespace(
        get_amp_supported_dtype=lambda: [torch.float16, torch.bfloat16, torch.float32]), raising=False)

    class Fake(amp_backends.Backend):
        name = device_type = "fakenpu"

        def is_available(self):
            return True

    assert Fake().supported_dtypes() == (torch.float16, torch.bfloat16)


def test_info_warns_when_the_extension_is_built_for_another_torch(no_amp_env):
    class Built(amp_backends.Backend):
        name = "builtfor"
        device_type = "cpu"
        built_for_torch = "2.4.0"

        def is_available(self):
            return True

    class Plugin:
        @amp_backends.hookimpl
        def amp_backends_register_backends(self, register):
            register(Built())

    amp_backends.register_plugin(Plugin(), name="builtfor")
    try:
        data = collect()
        row = {b["name"]: b for b in data["backends"]}["builtfor"]
        same = torch.__version__.split("+")[0] == "2.4.0"
        assert (row["torch_mismatch"] is None) is same
        if not same:
            assert f"built for torch 2.4.0, and this is torch {torch.__version__}" in row["torch_mismatch"]
            assert "Warning, torch version mismatch:" in render(data)
    finally:
        amp_backends.registry.default_registry().unregister_plugin("builtfor")


# -- plugins written against the contract before the layout ---------------------------------------------

def _registered(plugin_name: str, *objects: object):
    """Register ``objects`` (backends and kernels) from one in-process plugin through the registry; its record."""
    class Plugin:
        @amp_backends.hookimpl
        def amp_backends_register_backends(self, register):
            for obj in objects:
                if isinstance(obj, amp_backends.Backend):
                    register(obj)

        @amp_backends.hookimpl
        def amp_backends_register_kernels(self, register):
            for obj in objects:
                if isinstance(obj, amp_backends.Kernel):
                    register(obj)

    amp_backends.register_plugin(Plugin(), name=plugin_name)
    return next(r for r in amp_backends.plugins() if r.name == plugin_name)


@pytest.mark.parametrize("method", ["unscale_and_check_", "check_", "unscale_check_norm_", "check_norm_"])
def test_a_backend_overriding_an_old_gradient_op_is_refused_at_registration(no_amp_env, method):
    """Its override would never be called (the scaler runs the kernel's grad_op_): the plugin is refused, named
    in its record and in get(), with the new spelling."""
    calls = []

    def old_op(self, grads, found_inf, *rest):
        calls.append(len(grads))

    Old = type("OldStyle", (amp_backends.Backend,), {
        "name": "oldstyle", "device_type": "cpu", "default_dtype": torch.bfloat16,
        "unavailable_reason": lambda self: None, method: old_op})
    try:
        record = _registered("oldstyle-plugin", Old())
        assert record.status == "failed" and "oldstyle" not in amp_backends.names()
        assert f"OldStyle overrides {method}() of the earlier backend contract" in record.error
        assert "grad_op_" in record.error and "amp_backends_register_kernels" in record.error
        with pytest.raises(amp_backends.AmpBackendsError, match=f"overrides {method}"):
            amp_backends.get("oldstyle")
    finally:
        amp_backends.registry.default_registry().unregister_plugin("oldstyle-plugin")
    assert calls == []


@pytest.mark.parametrize("method", ["unscale_and_check_", "check_", "unscale_check_norm_", "check_norm_", "flat_op_"])
def test_a_kernel_overriding_an_old_op_is_refused_at_registration(no_amp_env, method):
    Old = type("OldKernel", (amp_backends.Kernel,), {"name": "oldkernel", method: lambda self, *a: None})
    try:
        record = _registered("oldkernel-plugin", Old())
        assert record.status == "failed" and "oldkernel" not in amp_backends.registry.default_registry().kernels()
        assert f"OldKernel overrides {method}() of the earlier kernel contract" in record.error
        assert "override grad_op_ instead" in record.error
    finally:
        amp_backends.registry.default_registry().unregister_plugin("oldkernel-plugin")


def test_calling_an_old_gradient_op_names_its_replacement_which_gives_torchs_result(no_amp_env):
    be = amp_backends.get("cpu")
    for method in ("unscale_and_check_", "check_", "unscale_check_norm_", "check_norm_"):
        assert not hasattr(be, method)
        with pytest.raises(AttributeError, match=rf"CPUBackend\.{method}\(\) was removed .*grad_op_") as caught:
            getattr(be, method)
        assert isinstance(caught.value, amp_backends.AmpBackendsError)
        assert "amp_backends.testing.grad_op_(backend, grads, found_inf" in str(caught.value)
    for method in ("unscale_and_check_", "flat_op_"):
        with pytest.raises(AttributeError, match=rf"TorchKernel\.{method}\(\) was removed .*grad_op_"):
            getattr(be.kernel, method)
    with pytest.raises(AttributeError, match="'CPUBackend' object has no attribute 'no_such_method'"):
        be.no_such_method  # noqa: B018 - the attribute read is the test
    # the replacement named: the same results as torch's own op on the same gradients
    grads = [torch.tensor([1.0, 2.0, -4.0]), torch.tensor([[8.0, 0.5]], dtype=torch.bfloat16)]
    expected = [g.clone() for g in grads]
    found, want = torch.zeros(()), torch.zeros(())
    inv = torch.full((), 0.25)
    grad_op_(be, grads, found, inv)
    for g in expected:
        torch._amp_foreach_non_finite_check_and_unscale_([g], want, inv)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected)) and found.item() == want.item() == 0.0


@pytest.mark.parametrize("answer", [True, False])
def test_a_backend_answering_availability_with_is_available_is_honoured(no_amp_env, answer):
    """The earlier contract's is_available() (no unavailable_reason()): asked, and its answer taken; a backend
    it calls available trains."""
    asked = []

    class Older(amp_backends.Backend):
        name, device_type, default_dtype = "older", "cpu", torch.bfloat16

        def is_available(self) -> bool:
            asked.append(True)
            return answer

    try:
        record = _registered("older-plugin", Older())
        assert record.status == "loaded" and "older" in amp_backends.names()
        assert ("older" in amp_backends.available()) is answer and asked
        if not answer:
            with pytest.raises(amp_backends.BackendUnavailableError, match=r"Older\.is_available\(\) returned False"):
                amp_backends.get("older")
            return
        be = amp_backends.get("older")
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = be.grad_scaler()
        with be.autocast():
            loss = model(torch.ones(3, 4)).float().sum()
        scaler.scale(loss).backward()
        before = model.weight.detach().clone()
        scaler.step(opt)
        scaler.update()
        assert not torch.equal(before, model.weight) and be.is_available() is True
    finally:
        amp_backends.registry.default_registry().unregister_plugin("older-plugin")
