"""The one vendor contract: registration by class, capabilities as mixins, one spelling per fact, and
the older spellings accepted with a DeprecationWarning at registration and honoured the same."""

from __future__ import annotations

import os
import types
import warnings

import pytest
import torch

import amp_backends
from amp_backends import Backend, ComputedMapping, Kernel, OverflowStatus, TorchKernel
from amp_backends.devices import fused
from amp_backends.devices.contract import Device
from amp_backends.gradients.kernel import selects_itself
from amp_backends.registry import Registry


def _register(*objects: object) -> tuple[Registry, list[str]]:
    """Register ``objects`` from one plugin in a registry of their own; the registry and the
    DeprecationWarnings the registration gave."""
    class Plugin:
        @amp_backends.hookimpl
        def amp_backends_register_backends(self, register):
            for obj in objects:
                if not isinstance(obj, Kernel):
                    register(obj)

        @amp_backends.hookimpl
        def amp_backends_register_kernels(self, register):
            for obj in objects:
                if isinstance(obj, Kernel):
                    register(obj)

    registry = Registry(group="amp_backends_no_such_group")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry.register_plugin(Plugin(), name="vendor")
        registry.names()  # the hooks run on first use
    return registry, [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


def _record(registry: Registry):
    return {r.name: r for r in registry.plugins()}["vendor"]


class Current(Backend):
    """A backend in the one spelling."""

    name, device_type, default_dtype = "current", "cpu", torch.bfloat16

    def unavailable_reason(self) -> str | None:
        return None


# -- registration by class -------------------------------------------------------------------
def test_an_object_with_a_backends_methods_is_refused_naming_the_class_to_subclass():
    duck = types.SimpleNamespace(name="duck", device_type="cpu", default_dtype=torch.float16, priority=0,
                                 grad_scaler=lambda *a, **k: None, unavailable_reason=lambda: None)
    registry, _ = _register(duck)
    record = _record(registry)
    assert record.status == "failed" and "subclass amp_backends.Backend" in record.error
    assert "amp_backends.ExtensionBackend" in record.error and "SimpleNamespace" in record.error
    assert "duck" not in registry.names()


def test_only_a_backend_is_a_device_and_vendors_get_both_classes_from_the_package():
    with pytest.raises(TypeError, match="abstract"):
        type("Bare", (Device,), {"name": "bare", "device_type": "cpu"})()
    assert issubclass(amp_backends.ExtensionBackend, Backend)
    assert {"Backend", "ExtensionBackend", "OverflowStatus", "Kernel"} <= set(amp_backends.__all__)
    assert "Device" not in amp_backends.__all__


def test_the_one_spelling_registers_without_a_warning():
    registry, deprecations = _register(Current())
    assert deprecations == [] and registry.get("current").unavailable_reason() is None


# -- availability: unavailable_reason() only --------------------------------------------------
@pytest.mark.parametrize("answer", [True, False])
def test_is_available_is_accepted_with_a_warning_and_answers_the_same(answer):
    class Older(Backend):
        name, device_type = "older", "cpu"

        def is_available(self) -> bool:
            return answer

    registry, deprecations = _register(Older())
    assert len(deprecations) == 1 and "Older.is_available" in deprecations[0]
    assert "unavailable_reason()" in deprecations[0] and "0.3.0" in deprecations[0]
    assert ("older" in registry.available()) is answer
    assert Older().unavailable_reason() == (None if answer else "Older.is_available() returned False")


# -- fused kernels: fused_found_inf only --------------------------------------------------------
class _FusedSGD(torch.optim.SGD):
    def __init__(self, params):
        super().__init__(params, lr=0.1, fused=True)


def test_fused_steps_honour_found_inf_false_is_the_mapping_for_every_kind_with_a_warning():
    class Older(Current):
        name = "older-fused"
        fused_steps_honour_found_inf = False

    class Declared(Current):
        name = "declared-fused"
        fused_found_inf = {"*": (fused.IGNORES, "fused_steps_honour_found_inf = False")}

    _, deprecations = _register(Older())
    assert len(deprecations) == 1 and "fused_steps_honour_found_inf" in deprecations[0]
    assert 'fused_found_inf = {"*": "ignores"}' in deprecations[0]
    _, none = _register(Declared())
    assert none == []
    opt = _FusedSGD([torch.nn.Parameter(torch.ones(2))])
    old, new = fused.kernel_of(Older(), opt), fused.kernel_of(Declared(), opt)
    assert old.status == fused.IGNORES and old.note == "backend 'older-fused': fused_steps_honour_found_inf = False"
    assert new.status == old.status and dict(Older.fused_found_inf) == dict(Declared.fused_found_inf)
    with pytest.warns(DeprecationWarning, match="read fused_found_inf"):
        assert Declared().fused_steps_honour_found_inf is False and Current().fused_steps_honour_found_inf is True


def test_a_fused_found_inf_property_is_accepted_with_a_warning_and_a_computed_mapping_without(monkeypatch):
    def declared() -> dict[str, str]:
        return {"sgd": fused.ABSENT if os.environ.get("VENDOR_FALLBACK") == "0" else fused.HONOURS}

    class Property(Current):
        name = "property-fused"

        @property
        def fused_found_inf(self):
            return declared()

    class Computed(Current):
        name = "computed-fused"
        fused_found_inf = ComputedMapping(declared)

    _, deprecations = _register(Property())
    assert len(deprecations) == 1 and "Property.fused_found_inf" in deprecations[0]
    _, none = _register(Computed())
    assert none == []
    opt = _FusedSGD([torch.nn.Parameter(torch.ones(2))])
    monkeypatch.delenv("VENDOR_FALLBACK", raising=False)
    assert fused.kernel_of(Computed(), opt).status == fused.kernel_of(Property(), opt).status == fused.HONOURS
    monkeypatch.setenv("VENDOR_FALLBACK", "0")  # read when asked, as the property was
    assert fused.kernel_of(Computed(), opt).status == fused.kernel_of(Property(), opt).status == fused.ABSENT


# -- the overflow register: the OverflowStatus mixin --------------------------------------------
class Register:
    def __init__(self) -> None:
        self.overflow = False
        self.clears = 0

    def clear(self) -> None:
        self.overflow = False
        self.clears += 1

    def read_(self, found_inf: torch.Tensor) -> None:
        if self.overflow:
            found_inf.fill_(1.0)
        self.clear()


def _train(be: Backend, register: Register) -> list[bool]:
    """Four fp16-scaled steps on ``be``, the register overflowing during the third backward."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp_backends.GradScaler(be, init_scale=8.0)
    skipped = []
    for step in range(4):
        register.overflow = True  # left from before the iteration: scale() clears it
        loss = scaler.scale(model(torch.ones(1, 4)).sum())
        register.overflow = step == 2
        loss.backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(scaler.last_step_skipped)
    return skipped


def test_the_overflow_mixin_and_its_older_spelling_train_alike():
    register_new, register_old = Register(), Register()

    class Mixin(OverflowStatus, Current):
        name, default_dtype = "mixin-status", torch.float16

        def clear_overflow_status(self) -> None:
            register_new.clear()

        def read_overflow_status_(self, found_inf: torch.Tensor) -> None:
            register_new.read_(found_inf)

    class Older(Current):
        name, default_dtype = "older-status", torch.float16
        global_overflow_status = True

        def clear_overflow_status(self) -> None:
            register_old.clear()

        def read_overflow_status_(self, found_inf: torch.Tensor) -> None:
            register_old.read_(found_inf)

    _, none = _register(Mixin())
    _, deprecations = _register(Older())
    assert none == [] and len(deprecations) == 1 and "subclass amp_backends.OverflowStatus" in deprecations[0]
    assert Mixin().global_overflow_status is True and isinstance(Mixin(), OverflowStatus)
    assert _train(Mixin(), register_new) == _train(Older(), register_old) == [False, False, True, False]
    assert register_new.clears == register_old.clears > 0


def test_the_mixin_requires_its_methods_and_the_older_spelling_is_refused_without_them():
    class Half(OverflowStatus, Current):
        name = "half-status"

        def clear_overflow_status(self) -> None:
            pass

    with pytest.raises(TypeError, match="read_overflow_status_"):
        Half()

    class Older(Current):
        name = "older-half-status"
        global_overflow_status = True

    registry, _ = _register(Older())
    record = _record(registry)
    assert record.status == "failed" and "read_overflow_status_(found_inf)" in record.error
    assert "subclass amp_backends.OverflowStatus" in record.error and "older-half-status" not in registry.names()


# -- a kernel: unavailable_reason(device_type) and auto_device_types --------------------------
class Declared(TorchKernel):
    name, priority = "declared", 5
    auto_device_types = ("cpu",)

    def unavailable_reason(self, device_type: str) -> str | None:
        return None if device_type in ("cpu", "meta") else f"no {device_type} build"


class OlderKernel(TorchKernel):
    name, priority = "older-kernel", 5

    def supports(self, device_type: str) -> bool:
        return device_type in ("cpu", "meta")

    def auto_select(self, device_type: str) -> bool:
        return device_type == "cpu"


def test_a_kernels_older_methods_are_accepted_with_warnings_and_choose_the_same(monkeypatch):
    monkeypatch.delenv("AMP_BACKENDS_KERNEL", raising=False)
    _, deprecations = _register(OlderKernel())
    assert [d.split(":")[0] for d in deprecations] == ["OlderKernel.supports", "OlderKernel.auto_select"]
    assert "unavailable_reason(device_type)" in deprecations[0] and "auto_device_types" in deprecations[1]
    registry, none = _register(Declared())
    assert none == []
    for device_type in ("cpu", "meta", "cuda"):
        assert selects_itself(OlderKernel(), device_type) is selects_itself(Declared(), device_type) \
            is (device_type == "cpu")
        assert (OlderKernel().unavailable_reason(device_type) is None) is \
            (Declared().unavailable_reason(device_type) is None) is (device_type != "cuda")
    assert registry.kernel_for(Current()).name == "declared"


def test_calling_a_kernels_older_methods_warns_and_answers_from_the_one_spelling():
    with pytest.warns(DeprecationWarning, match=r"Kernel.supports\(\) is deprecated"):
        assert Declared().supports("cuda") is False
    with pytest.warns(DeprecationWarning, match=r"Kernel.auto_select\(\) is deprecated"):
        assert Declared().auto_select("meta") is False  # available there, but not chosen automatically
    with pytest.warns(DeprecationWarning):
        assert Kernel().supports("anything") is True and Kernel().auto_select("anything") is True


def test_the_triton_kernels_dtypes_are_declared_once():
    pytest.importorskip("triton")
    from amp_backends_plugins.triton import TritonKernel, _kernels

    assert _kernels.KERNEL_DTYPES is TritonKernel.handles_dtypes
    assert TritonKernel.auto_device_types == ("cuda", "xpu")
    assert "supports" not in vars(TritonKernel) and "auto_select" not in vars(TritonKernel)


def test_the_built_in_plugins_use_the_one_spelling():
    from amp_backends.devices.old_contract import BACKEND_SPELLINGS, KERNEL_SPELLINGS, deprecations

    registry = Registry()
    registry.names()  # loads the built-in plugins
    found = [m for b, _ in registry.backends() for m in deprecations(b, Device, BACKEND_SPELLINGS)]
    found += [m for k in registry.kernels().values() for m in deprecations(k, Kernel, KERNEL_SPELLINGS)]
    assert found == []
