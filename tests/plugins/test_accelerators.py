"""The xpu, mps and hpu backends and ROCm inside the cuda backend, without the hardware.

No machine here has an Intel GPU, an Apple GPU, an Intel Gaudi or an AMD GPU. What is patched,
plainly: the device queries torch (or habana_frameworks) would answer on such a machine
(``torch.xpu.*``, ``torch.backends.mps.is_built/is_available``, the macOS release, ``torch.hpu``,
``torch.version.hip`` and ``torch.cuda``'s device queries). What is real: the backends' code,
the registry choosing among them, torch's autocast accepting each device's dtypes, the scaler.
Unpatched, each backend must say why it is unavailable here (or work, where the device exists).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import amp_backends
from amp_backends import BackendUnavailableError, UnsupportedDtypeError
from amp_backends_plugins import cuda as cuda_plugin
from amp_backends_plugins import hpu as hpu_plugin
from amp_backends_plugins import mps as mps_plugin
from amp_backends_plugins import xpu as xpu_plugin

from conftest import run_json
from fake_gpus import patch_nvidia
from fake_gpus import patch_rocm


@pytest.fixture
def fresh_registry(monkeypatch):
    """The default registry rebuilt under the test's patches, and rebuilt again after them."""
    for var in ("AMP_BACKEND", "AMP_BACKENDS_DISABLE_PLUGINS", "AMP_BACKENDS_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    amp_backends.reload()
    yield
    monkeypatch.undo()
    amp_backends.reload()


def _others_off(monkeypatch, keep: str) -> None:
    """Switch off the accelerators this machine really has, so the patched one is the only one."""
    real = [n for n in amp_backends.available() if n not in ("cpu", keep)]
    registry = amp_backends.registry.default_registry()
    plugins = sorted({r.name for b, r in registry.backends() if b.name in real})
    if plugins:
        monkeypatch.setenv("AMP_BACKENDS_DISABLE_PLUGINS", ",".join(plugins))
    amp_backends.reload()


# -- xpu ----------------------------------------------------------------------------------------
def _patch_xpu(monkeypatch, *, fp64: bool = True, bf16_native: bool = True, xccl: bool = True,
               name: str = "Intel(R) Data Center GPU Max 1550") -> None:
    xpu = torch.xpu
    monkeypatch.setattr(xpu, "_is_compiled", lambda: True, raising=False)
    monkeypatch.setattr(xpu, "is_available", lambda: True)
    monkeypatch.setattr(xpu, "device_count", lambda: 2)
    monkeypatch.setattr(xpu, "current_device", lambda: 0)
    monkeypatch.setattr(xpu, "get_device_name", lambda device=None: name)

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return True if including_emulation else bf16_native

    monkeypatch.setattr(xpu, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(xpu, "get_device_properties", lambda device=None: types.SimpleNamespace(has_fp64=fp64))
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_xccl_available", lambda: xccl, raising=False)


def test_xpu_unavailable_here_says_why(fresh_registry):
    be = xpu_plugin.XPUBackend()
    reason = be.unavailable_reason()
    if torch.xpu.is_available():  # a machine with an Intel GPU: then it must work
        assert reason is None
        return
    assert reason and ("not built for XPU" in reason or "no Intel GPU visible" in reason)
    with pytest.raises(BackendUnavailableError, match="backend 'xpu' is not available"):
        amp_backends.get("xpu")


@pytest.mark.filterwarnings("ignore:kernel 'triton'")  # its self-check cannot run on a patched device
def test_xpu_is_chosen_where_torch_reports_it(monkeypatch, fresh_registry):
    _patch_xpu(monkeypatch)
    _others_off(monkeypatch, "xpu")
    be = amp_backends.get()
    assert be.name == "xpu" and be.device_type == "xpu", "never cpu silently on an Intel GPU"
    assert be.supported_dtypes() == (torch.float16, torch.bfloat16)
    assert be.native_dtypes() == (torch.float16, torch.bfloat16)
    assert be.has_fp64 is True and be.dist_backend == "xccl"
    assert be.autocast(torch.bfloat16).fast_dtype == torch.bfloat16  # torch's autocast takes it for xpu
    scaler = be.grad_scaler()
    assert scaler.is_enabled() and scaler.backend is be
    from amp_backends.cli import info

    # xpu declares fp8 on this torch (2.10+): info would import torchao, and torch._dynamo with it, under
    # the patched torch.xpu; the engine's own check is tested in test_fp8.py
    monkeypatch.setattr(info, "_fp8_engine", lambda needed: {"torchao": "0.18.0", "problem": None, "checked": needed})
    row = next(r for r in info.collect()["backends"] if r["name"] == "xpu")
    assert row["available"] and row["device"] == "Intel(R) Data Center GPU Max 1550 (torch.xpu, 2 device(s))"


def test_xpu_arc_without_float64_uses_the_float32_inverse_scale(monkeypatch, fresh_registry):
    _patch_xpu(monkeypatch, fp64=False, bf16_native=False, xccl=False, name="Intel(R) Arc(TM) A770 Graphics")
    be = xpu_plugin.XPUBackend()
    assert be.has_fp64 is False
    assert be.native_dtypes() == (torch.float16,), "bf16 emulated where the device says so"
    assert "is_bf16_supported(including_emulation=False)" in be.emulation_reason(torch.bfloat16)
    assert "no float64" in be.describe()
    monkeypatch.setattr(xpu_plugin.importlib.util, "find_spec",
                        lambda name: object() if name == "oneccl_bindings_for_pytorch" else None)
    assert be.dist_backend == "ccl", "oneCCL's bindings where torch has no XCCL"
    monkeypatch.setattr(xpu_plugin.importlib.util, "find_spec", lambda name: None)
    assert be.dist_backend == "", "neither: no process group (gloo cannot reduce xpu tensors)"
    with pytest.raises(amp_backends.AmpBackendsError, match=r"can reduce 'xpu' tensors \(gloo reduces cpu and cuda "
                                                             r"tensors only\): use a torch XPU build with XCCL.*oneccl"):
        amp_backends.distributed.init_process_group(be)
    scale = torch.full((), 2.0**16)
    inv = amp_backends.GradScaler(be, init_scale=2.0**16)._grads.inv_scale(scale)
    assert inv.dtype == torch.float32 and inv.item() == 2.0**-16


def test_a_process_group_backend_only_where_it_can_reduce_the_devices_tensors():
    """torch's declared capabilities decide: gloo for cpu, nccl for cuda, none for mps (torch maps mps
    to gloo, which cannot reduce mps tensors) or an unknown device; an extension's registered backend
    for its device type (tested in a subprocess: registering changes torch's tables)."""
    from amp_backends.devices.accelerator import process_group_backend

    assert process_group_backend("cpu") == "gloo" and process_group_backend("cuda") == "nccl"
    assert process_group_backend("mps") == "" and process_group_backend("acme") == ""
    out = run_json("""
import json, torch.distributed as dist
from amp_backends.devices.accelerator import process_group_backend
dist.Backend.register_backend("acmecl", lambda *a: None, devices=["acme"])
print(json.dumps(process_group_backend("acme")))
""")
    assert out == "acmecl"


# -- mps ----------------------------------------------------------------------------------------
def _patch_mps(monkeypatch, *, macos=(14, 5), torch_version=(2, 13), unscale_ok=True) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(mps_plugin, "_macos", lambda: macos)
    monkeypatch.setattr(mps_plugin, "_torch_version", lambda: torch_version)
    monkeypatch.setattr(mps_plugin, "_unscale_keeps_values", lambda device: unscale_ok)


needs_mps_autocast = pytest.mark.skipif(
    not torch.amp.is_autocast_available("mps"), reason=f"torch {torch.__version__} has no mps autocast (2.5+)"
)


def test_mps_unavailable_here_says_why(fresh_registry):
    reason = mps_plugin.MPSBackend().unavailable_reason()
    if torch.backends.mps.is_available() and torch.amp.is_autocast_available("mps"):
        assert reason is None
        return
    assert reason and ("not built with MPS" in reason or "no Metal device" in reason or "needs torch 2.5+" in reason)


@pytest.mark.parametrize(("version", "macos"), [((2, 8), "12.3"), ((2, 9), "14"), ((2, 13), "14")])
def test_mps_without_a_metal_device_names_the_macos_this_torch_needs(monkeypatch, version, macos):
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(mps_plugin, "_torch_version", lambda: version)
    assert f"needs macOS {macos}+ for MPS" in mps_plugin.MPSBackend().unavailable_reason()


@needs_mps_autocast
def test_mps_is_chosen_where_torch_reports_it(monkeypatch, fresh_registry):
    _patch_mps(monkeypatch)
    _others_off(monkeypatch, "mps")
    be = amp_backends.get()
    assert be.name == "mps", "never cpu silently on an Apple GPU"
    assert be.supported_dtypes() == (torch.float16, torch.bfloat16)
    assert be.has_fp64 is False and be.dist_backend == ""
    assert be.unscale_dtypes is None and be.fused_found_inf is None, "fused kernels: probed on the device"
    assert be.grad_scaler().is_enabled()
    with pytest.raises(amp_backends.AmpBackendsError, match="no torch.distributed process-group backend that can reduce 'mps' tensors"):
        amp_backends.distributed.init_process_group(be)


@needs_mps_autocast
def test_mps_bf16_needs_macos_14(monkeypatch, fresh_registry):
    _patch_mps(monkeypatch, macos=(13, 6))
    be = mps_plugin.MPSBackend()
    assert be.supported_dtypes() == (torch.float16,)
    with pytest.raises(UnsupportedDtypeError, match="does not support autocast dtype bfloat16"):
        be.autocast(torch.bfloat16)


@needs_mps_autocast
def test_mps_scaler_before_torch_2_8_is_refused_with_the_version(monkeypatch, fresh_registry):
    _patch_mps(monkeypatch, torch_version=(2, 7))
    be = mps_plugin.MPSBackend()
    with pytest.raises(UnsupportedDtypeError, match=r"loss scaling on mps needs torch 2\.8\+") as info:
        be.grad_scaler()
    assert "bfloat16" in str(info.value), "the way out is named"
    assert not be.grad_scaler(torch.bfloat16).is_enabled(), "bf16 needs no scaler: allowed"
    assert not be.grad_scaler(enabled=False).is_enabled()


@needs_mps_autocast
def test_mps_device_bugs_are_guarded_where_probed(monkeypatch, fresh_registry):
    _patch_mps(monkeypatch, unscale_ok=False)
    be = mps_plugin.MPSBackend()
    assert be.unscale_dtypes == (torch.float32,), "fp16/bf16 gradients go through float32 copies"
    assert "unscaled through float32" in be.describe()


def test_the_mps_unscale_probe_detects_the_bug_it_guards(monkeypatch):
    """The probe itself, run on the CPU: torch's correct kernel passes; a kernel that zeroes
    half-precision values is caught. (The fused-kernel probe: tests/devices/test_fused.py.)"""
    assert mps_plugin._unscale_keeps_values("cpu") is True
    real = torch._amp_foreach_non_finite_check_and_unscale_

    def zeroing(grads, found, inv):
        real(grads, found, inv)
        for g in grads:
            if g.dtype != torch.float32:
                g.zero_()

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", zeroing)
    assert mps_plugin._unscale_keeps_values("cpu") is False


class _BuggyFusedSGD(torch.optim.SGD):
    """A fused optimizer with the MPS bug: it takes grad_scale/found_inf and ignores found_inf."""

    _step_supports_amp_scaling = True

    def step(self, closure=None):
        handed = {k: self.__dict__.pop(k) for k in ("grad_scale", "found_inf") if k in self.__dict__}
        try:
            scale = handed.get("grad_scale")
            if scale is not None:
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.div_(scale)
            return super().step(closure)  # found_inf ignored
        finally:
            self.__dict__.update(handed)


@pytest.mark.parametrize("declared", [True, False])
def test_the_scaler_skips_from_the_host_where_fused_steps_ignore_found_inf(declared):
    cpu = type(amp_backends.get("cpu"))

    class Backend(cpu):
        name = "cpu-buggy-fused"
        fused_steps_honour_found_inf = declared

    be = Backend()
    model = torch.nn.Linear(3, 1)
    opt = _BuggyFusedSGD(model.parameters(), lr=0.1)
    scaler = amp_backends.GradScaler(be, init_scale=2.0**4)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.ones(2, 3)).sum() * torch.tensor(float("inf"))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped, "the scaler knows the step overflowed either way"
    unchanged = all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    # declared honest: the buggy optimizer steps anyway (what the declaration must not hide);
    # declared buggy: the scaler unscales and skips it from the host
    assert unchanged is (not declared)


# -- hpu ----------------------------------------------------------------------------------------
def _patch_hpu(monkeypatch, generation: str = "GAUDI2") -> None:
    parent = types.ModuleType("habana_frameworks")
    child = types.ModuleType("habana_frameworks.torch")
    parent.__path__ = []  # a package
    parent.torch = child
    child.__spec__ = types.SimpleNamespace(name="habana_frameworks.torch")
    monkeypatch.setitem(sys.modules, "habana_frameworks", parent)
    monkeypatch.setitem(sys.modules, "habana_frameworks.torch", child)
    monkeypatch.setattr(hpu_plugin.HPUBackend, "_load", lambda self: torch.hpu)
    hpu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 8,
                                get_device_name=lambda device=None: generation)
    monkeypatch.setattr(torch, "hpu", hpu, raising=False)


def test_hpu_unavailable_here_says_why():
    reason = hpu_plugin.HPUBackend().unavailable_reason()
    if reason is None:
        return  # a Gaudi machine
    assert "habana_frameworks.torch" in reason


def test_hpu_is_chosen_where_gaudi_is_present(monkeypatch, fresh_registry):
    _patch_hpu(monkeypatch)
    _others_off(monkeypatch, "hpu")
    be = amp_backends.get()
    assert be.name == "hpu", "never cpu silently on a Gaudi"
    assert be.default_dtype == torch.bfloat16 and be.supported_dtypes() == (torch.bfloat16, torch.float16)
    assert not be.grad_scaler().is_enabled(), "bf16 by default: the scaler is off"
    assert be.grad_scaler(torch.float16).is_enabled(), "fp16 on Gaudi 2: scaled"
    assert be.dist_backend == "hccl" and be.has_fp64 is False
    assert be.describe() == "Intel Gaudi 2 (8 device(s))"


@pytest.mark.parametrize("answer", [True, False])
def test_hpu_asks_the_stack_whether_fp16_is_supported(monkeypatch, fresh_registry, answer):
    _patch_hpu(monkeypatch, generation="GAUDI3")
    utils = types.ModuleType("habana_frameworks.torch.utils")
    experimental = types.ModuleType("habana_frameworks.torch.utils.experimental")
    experimental._is_fp16_supported = lambda: answer
    utils.experimental = experimental
    utils.__path__ = []
    monkeypatch.setitem(sys.modules, "habana_frameworks.torch.utils", utils)
    monkeypatch.setitem(sys.modules, "habana_frameworks.torch.utils.experimental", experimental)
    sys.modules["habana_frameworks.torch"].__path__ = []
    be = hpu_plugin.HPUBackend()
    assert be.supported_dtypes() == ((torch.bfloat16, torch.float16) if answer else (torch.bfloat16,))


def test_first_generation_gaudi_has_no_float16(monkeypatch, fresh_registry):
    _patch_hpu(monkeypatch, generation="GAUDI")
    be = hpu_plugin.HPUBackend()
    assert be.supported_dtypes() == (torch.bfloat16,)
    with pytest.raises(UnsupportedDtypeError, match="float16"):
        be.autocast(torch.float16)


def _failing(*args, **kwargs):
    raise RuntimeError("device query failed")


@pytest.mark.parametrize("failure", ["fp16-query-raises", "name-raises", "name-none"])
def test_hpu_survives_failing_queries_with_bf16_intact(monkeypatch, fresh_registry, failure):
    """A stack whose fp16 query or device-name query fails: hpu stays available in bf16 (which every
    Gaudi has); fp16 is judged by the generation, or refused where that is unknown; the name says so."""
    _patch_hpu(monkeypatch, generation="GAUDI2")
    if failure == "fp16-query-raises":
        utils = types.ModuleType("habana_frameworks.torch.utils")
        experimental = types.ModuleType("habana_frameworks.torch.utils.experimental")
        experimental._is_fp16_supported = _failing
        utils.experimental, utils.__path__ = experimental, []
        monkeypatch.setitem(sys.modules, "habana_frameworks.torch.utils", utils)
        monkeypatch.setitem(sys.modules, "habana_frameworks.torch.utils.experimental", experimental)
        sys.modules["habana_frameworks.torch"].__path__ = []
    else:
        monkeypatch.setattr(torch.hpu, "get_device_name", _failing if failure == "name-raises" else lambda d=None: None)
    be = hpu_plugin.HPUBackend()
    assert be.unavailable_reason() is None and be.default_dtype == torch.bfloat16
    known = failure == "fp16-query-raises"
    assert be.supported_dtypes() == ((torch.bfloat16, torch.float16) if known else (torch.bfloat16,))
    assert be.describe() == ("Intel Gaudi 2 (8 device(s))" if known else "Intel Gaudi (generation unknown) (8 device(s))")
    assert "None" not in be.describe()


@pytest.mark.filterwarnings("ignore:kernel 'triton'")
@pytest.mark.parametrize("failure", ["properties", "name"])
def test_xpu_survives_failing_device_queries(monkeypatch, fresh_registry, failure):
    _patch_xpu(monkeypatch)
    if failure == "properties":
        monkeypatch.setattr(torch.xpu, "get_device_properties", _failing)
    else:
        monkeypatch.setattr(torch.xpu, "get_device_name", _failing)
    be = xpu_plugin.XPUBackend()
    assert be.unavailable_reason() is None
    if failure == "properties":
        assert be.has_fp64 is False, "unknown: the scaler's float32 path, which every device has"
        assert be.describe() == "Intel(R) Data Center GPU Max 1550 (torch.xpu, 2 device(s), no float64)"
    else:
        assert be.has_fp64 is True
        assert be.describe() == "Intel GPU (name unavailable: RuntimeError) (torch.xpu, 2 device(s))"


# -- ROCm inside the cuda backend ------------------------------------------------------------------
def test_rocm_is_named_with_its_release_and_architecture(monkeypatch):
    patch_rocm(monkeypatch)
    be = cuda_plugin.CUDABackend()
    assert be.is_available()
    assert be.describe() == "AMD Instinct MI300X (ROCm 6.2, gfx942)"
    assert be.native_dtypes() == (torch.float16, torch.bfloat16)


def test_rocm_bf16_is_native_by_amd_architecture(monkeypatch):
    patch_rocm(monkeypatch, arch="gfx908:sramecc+:xnack-", name="AMD Instinct MI100")
    be = cuda_plugin.CUDABackend()
    assert be.native_dtypes() == (torch.float16, torch.bfloat16), "MI100 (CDNA 1) has bf16 matrix cores"
    patch_rocm(monkeypatch, arch="gfx906:sramecc+:xnack-", name="AMD Radeon Instinct MI50")
    assert be.native_dtypes() == (torch.float16,), "MI50: bf16 works, emulated"
    assert "gfx906" in be.emulation_reason(torch.bfloat16) and "gfx908" in be.emulation_reason(torch.bfloat16)


@pytest.mark.parametrize(("capability", "name", "fp8"), [
    ((8, 0), "NVIDIA A100", ()), ((8, 6), "NVIDIA RTX A6000", ()),
    ((8, 9), "NVIDIA L4", ("float8_e4m3fn", "float8_e5m2")), ((9, 0), "NVIDIA H100", ("float8_e4m3fn", "float8_e5m2")),
    ((10, 0), "NVIDIA B200", ("float8_e4m3fn", "float8_e5m2")),
])
def test_cuda_declares_fp8_from_compute_capability_8_9(monkeypatch, capability, name, fp8):
    patch_nvidia(monkeypatch, capability, name)
    be = cuda_plugin.CUDABackend()
    assert tuple(str(d).replace("torch.", "") for d in be.fp8_dtypes()) == fp8
    assert be.fp8_recipes() == (("tensorwise", "rowwise", "rowwise_with_gw_hp") if fp8 else ())
    if not fp8:
        with pytest.raises(amp_backends.precision.fp8.engine.Fp8UnavailableError, match=rf"backend 'cuda' \({name} .*has no fp8 matmul"):
            amp_backends.precision.fp8.engine.check_device(be, "tensorwise", emulate=False)


@pytest.mark.parametrize(("capability", "name"), [((7, 0), "Tesla V100-SXM2-16GB"), ((7, 5), "Tesla T4"),
                                               ((8, 0), "NVIDIA A100")])
def test_cuda_takes_bf16_where_torchs_autocast_does_and_says_where_it_is_emulated(monkeypatch, capability, name):
    """torch's autocast takes bf16 on any GPU torch.cuda.is_bf16_supported() accepts, emulation included
    (a V100 or T4): the backend supports it there too, and native_dtypes (which warns) leaves it out."""
    patch_nvidia(monkeypatch, capability, name)
    be = cuda_plugin.CUDABackend()
    assert be.supported_dtypes() == (torch.float16, torch.bfloat16)
    native = capability >= (8, 0)
    assert be.native_dtypes() == ((torch.float16, torch.bfloat16) if native else (torch.float16,))
    if not native:
        assert f"compute capability {capability[0]}.{capability[1]}" in be.emulation_reason(torch.bfloat16)


_OCP, _FNUZ = ("float8_e4m3fn", "float8_e5m2"), ("float8_e4m3fnuz", "float8_e5m2fnuz")


@pytest.mark.parametrize(("arch", "hip", "fp8", "said"), [
    ("gfx942:sramecc+:xnack-", "6.2.41133", _FNUZ, None),
    ("gfx950", "6.4.43482", (), "gfx950 takes OCP fp8, but this torch is built with ROCm 6.4"),
    ("gfx950", "6.5.0", _OCP, None),
    ("gfx1201", "6.3.42131", (), "gfx1201 takes OCP fp8, but this torch is built with ROCm 6.3"),
    ("gfx1200", "7.0.51831", _OCP, None),
    ("gfx90a", "6.5.0", (), "gfx90a is not among the AMD GPUs torch's _scaled_mm takes"),
    ("gfx1100", "6.5.0", (), "gfx1100 is not among the AMD GPUs torch's _scaled_mm takes"),
])
def test_rocm_declares_fp8_by_architecture_and_rocm_release(monkeypatch, arch, hip, fp8, said):
    """torch's _scaled_mm_allowed_device and _scaled_mm_out_cuda (ScaledBlas.cpp): gfx942 in the fnuz
    formats; gfx950 and gfx1200/1201 in the OCP formats from ROCm 6.5 (the release torch is built with,
    torch.version.hip); refused below, naming the release to install."""
    patch_rocm(monkeypatch, arch=arch, hip=hip)
    be = cuda_plugin.CUDABackend()
    assert tuple(str(d).replace("torch.", "") for d in be.fp8_dtypes()) == fp8
    if said is None:
        assert be.fp8_unavailable_reason() is None
    else:
        with pytest.raises(amp_backends.precision.fp8.engine.Fp8UnavailableError) as info:
            amp_backends.precision.fp8.engine.check_device(be, "tensorwise", emulate=False)
        assert said in str(info.value) and "emulate=True" in str(info.value)


@pytest.mark.parametrize(("release", "recipes"), [((2, 6), ("tensorwise",)),
                                                   ((2, 7), ("tensorwise", "rowwise", "rowwise_with_gw_hp"))])
def test_rocm_rowwise_fp8_from_torch_2_7(monkeypatch, release, recipes):
    """Upstream torch's hipBLASLt rowwise fp8 (pytorch PR 144432) landed after the 2.6 branch cut."""
    patch_rocm(monkeypatch)
    monkeypatch.setattr(cuda_plugin, "torch_release", lambda: release)
    be = cuda_plugin.CUDABackend()
    assert be.fp8_recipes() == recipes
    if recipes == ("tensorwise",):
        with pytest.raises(amp_backends.precision.fp8.engine.Fp8UnavailableError,
                           match="runs the fp8 recipes 'tensorwise', not 'rowwise'"):
            amp_backends.precision.fp8.engine.check_device(be, "rowwise", emulate=False)


@pytest.mark.parametrize(("release", "kinds"), [((2, 12), ("adam", "adamw", "sgd")),
                                                ((2, 13), ("adam", "adamw", "sgd", "adagrad"))])
def test_cuda_declares_fused_adagrad_where_torch_enables_it(monkeypatch, release, kinds):
    monkeypatch.setattr(cuda_plugin, "torch_release", lambda: release)
    declared = cuda_plugin.CUDABackend().fused_found_inf
    assert tuple(declared) == kinds and {v[0] for v in declared.values()} == {"honours"}


@pytest.mark.parametrize(("release", "fp8", "kinds"), [
    ((2, 5), (), ()), ((2, 9), (), ("adam", "adamw", "sgd")),
    ((2, 10), _OCP, ("adam", "adamw", "sgd")), ((2, 13), _OCP, ("adam", "adamw", "sgd", "adagrad")),
])
def test_xpu_declares_fp8_and_fused_kernels_by_torch_release(monkeypatch, fresh_registry, release, fp8, kinds):
    """torch-xpu-ops' fused kernels (skip and divide) from torch 2.6, Adagrad's from 2.13; the native
    XPU _scaled_mm from torch 2.10 (before it, torch-xpu-ops ran it on the CPU)."""
    _patch_xpu(monkeypatch)
    _others_off(monkeypatch, "xpu")
    monkeypatch.setattr(xpu_plugin, "_torch_release", lambda: release)
    be = amp_backends.get("xpu")
    assert tuple(be.fused_found_inf) == kinds and all(v[0] == "honours" for v in be.fused_found_inf.values())
    assert tuple(str(d).replace("torch.", "") for d in be.fp8_dtypes()) == fp8
    assert be.fp8_recipes() == (("tensorwise", "rowwise", "rowwise_with_gw_hp") if fp8 else ())
    if not fp8:
        with pytest.raises(amp_backends.precision.fp8.engine.Fp8UnavailableError) as info:
            amp_backends.precision.fp8.engine.check_device(be, "tensorwise", emulate=False)
        assert "backend 'xpu' (Intel(R) Data Center GPU Max 1550" in str(info.value)
        assert "native XPU _scaled_mm came in torch 2.10" in str(info.value)


@pytest.mark.parametrize(("generation", "fp8", "recipes", "said"), [
    ("GAUDI", (), (), "has no fp8 matmul: Gaudi has no fp8"),
    ("GAUDI2", _OCP, (), "has fp8 matmuls (_scaled_mm, float8_e4m3fn and float8_e5m2) that none of torchao's"),
    ("GAUDI3", _OCP, ("tensorwise",), None),
])
def test_hpu_declares_fp8_by_gaudi_generation(monkeypatch, fresh_registry, generation, fp8, recipes, said):
    """The Gaudi bridge registers _scaled_mm (hpu_op.yaml, scaled_mm_gen.cpp: e4m3fn and e5m2); its
    tests skip first-generation Gaudi and run mixed e5m2 x e4m3fn (torchao's tensorwise backward) on
    Gaudi 3 only, with one-element scales only. A refusal on Gaudi 2 says it has fp8 matmuls and names
    Gaudi's own fp8 stack."""
    _patch_hpu(monkeypatch, generation)
    _others_off(monkeypatch, "hpu")
    be = amp_backends.get("hpu")
    assert tuple(str(d).replace("torch.", "") for d in be.fp8_dtypes()) == fp8 and be.fp8_recipes() == recipes
    engine = amp_backends.precision.fp8.engine
    if said is None:
        engine.check_device(be, "tensorwise", emulate=False)
        with pytest.raises(engine.Fp8UnavailableError, match="runs the fp8 recipes 'tensorwise', not 'rowwise'"):
            engine.check_device(be, "rowwise", emulate=False)
    else:
        with pytest.raises(engine.Fp8UnavailableError) as info:
            engine.check_device(be, "tensorwise", emulate=False)
        assert said in str(info.value) and "transformer_engine" in str(info.value)
        if generation == "GAUDI2":
            assert "has no fp8 matmul" not in str(info.value), "Gaudi 2 has fp8 matmuls: the refusal says which it lacks"


@pytest.mark.filterwarnings("ignore:kernel 'triton'")  # its self-check cannot run on a patched device
def test_info_shows_fp8_per_backend(monkeypatch, fresh_registry):
    import amp_backends.cli.info  # a submodule: imported here, not by another test first

    patch_nvidia(monkeypatch, (9, 0), "NVIDIA H100")
    monkeypatch.setattr(amp_backends.cli.info, "_fp8_engine", lambda needed: {"torchao": "0.18.0", "problem": None,
                                                                          "checked": needed})
    data = amp_backends.cli.info.collect()
    rows = {b["name"]: b for b in data["backends"]}
    assert rows["cuda"]["reason"] is None, rows["cuda"]["reason"]
    assert rows["cuda"]["fp8_dtypes"] == ["float8_e4m3fn", "float8_e5m2"] and rows["cpu"]["fp8_dtypes"] == []
    assert data["fp8_engine"]["checked"] is True, "a backend with fp8 here: torchao is imported to check it"
    text = amp_backends.cli.info.render(data)
    assert "cuda: float8_e4m3fn, float8_e5m2; recipes tensorwise, rowwise, rowwise_with_gw_hp" in text


@pytest.mark.parametrize(("arch", "native"), [
    ("gfx90a", True), ("gfx940", True), ("gfx942", True), ("gfx950", True), ("gfx1100", True), ("gfx1201", True),
    ("gfx908", True), ("gfx906", False), ("gfx1030", False), ("gfx1010", False), (None, False), ("sm_90", False),
    ("gfx909", False), ("gfx90c", False), ("gfx900", False), ("gfx908:sramecc+:xnack-", True),
])
def test_amd_bf16_rule(arch, native):
    assert cuda_plugin.amd_bf16_native(arch) is native


def test_a_kernel_is_adopted_on_rocm_only_after_its_self_check(monkeypatch):
    """On ROCm the device type is cuda: the registry's self-check runs there as on NVIDIA; a kernel
    that fails it is not adopted."""
    patch_rocm(monkeypatch)
    from amp_backends import Kernel
    from amp_backends.registry import Registry

    class Rocket(Kernel):
        name = "rocket"
        priority = 99

        def auto_select(self, device_type):
            return device_type == "cuda"

    checked = []

    def self_check(kernel, device):
        checked.append((kernel.name, str(device)))
        return "missed an inf/NaN in torch.float16 gradients"

    monkeypatch.setattr(amp_backends.gradients.selfcheck, "kernel_self_check", self_check)

    class Plugin:
        @amp_backends.hookimpl
        def amp_backends_register_kernels(self, register):
            register(Rocket())

    registry = Registry(group="amp_backends_no_such_group")
    registry.register_plugin(Plugin(), name="rocket")
    monkeypatch.delenv("AMP_BACKENDS_KERNEL", raising=False)
    with pytest.warns(RuntimeWarning, match="failed its self-check on cuda"):
        kernel = registry.kernel_for(cuda_plugin.CUDABackend())
    assert kernel.name == "torch" and checked == [("rocket", "cuda:0")], "on the current device"
