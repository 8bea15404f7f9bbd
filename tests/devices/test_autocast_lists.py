"""Each device's autocast lists, against the sources: torch's own registrations (the dispatcher, and
torch's autocast kernels run on fake CUDA, XPU and MPS tensors, which need no such device), and the
Intel Gaudi bridge's defaults and override files as its source reads them. The policy and the
inspector follow the device's lists, not CUDA's."""

from __future__ import annotations

import contextlib
import functools
import warnings

import pytest
import torch
from torch import nn

import amp_backends
from amp_backends.devices import autocast_lists as al
from amp_backends_plugins.cpu import CPUBackend
from amp_backends_plugins.cuda import CUDABackend
from amp_backends_plugins.hpu import HPUBackend
from amp_backends_plugins.mlu import MLUBackend
from amp_backends_plugins.mps import MPSBackend
from amp_backends_plugins.musa import MUSABackend
from amp_backends_plugins.npu import NPUBackend
from amp_backends_plugins.xpu import XPUBackend

_fake = pytest.importorskip("torch._subclasses.fake_tensor")
FakeTensorMode, unset_fake_temporarily = _fake.FakeTensorMode, _fake.unset_fake_temporarily

TORCH_213 = torch.__version__.startswith("2.13.")
#: torch's dispatch key for each device type's autocast, and the lists declared for it.
TORCH_DEVICES = {"cuda": ("AutocastCUDA", al.CUDA), "xpu": ("AutocastXPU", al.XPU), "cpu": ("AutocastCPU", al.CPU),
                 "mps": ("AutocastMPS", al.MPS)}


def _registered(key: str) -> set[str]:
    try:
        torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm", key)
    except RuntimeError:  # torch 2.4 has no AutocastMPS key
        pytest.skip(f"torch {torch.__version__} has no {key} dispatch key")
    return {name.split("::")[1].split(".")[0] for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, key)}


@pytest.mark.parametrize("device_type", sorted(TORCH_DEVICES))
def test_declared_ops_are_the_ones_torch_registers(device_type):
    """On torch 2.13, the release the lists are read from, the op names registered on the device's autocast
    key are exactly the declared ones; on other releases every op both name is checked by dtype below."""
    key, lists = TORCH_DEVICES[device_type]
    registered = _registered(key)
    declared = lists.lower | lists.fp32 | lists.promote | lists.banned
    if TORCH_213:
        assert registered == declared, (sorted(registered - declared), sorted(declared - registered))
    else:
        assert len(registered & declared) > 0.8 * len(registered), "the lists are far from this torch's"


@contextlib.contextmanager
def _cuda_hidden_from_fake(device_type: str):
    """torch 2.11's fake tensors of an xpu device make a real tensor of it first wherever CUDA is available
    (``fake_tensor.init_gpu_context`` asks ``torch.cuda.is_available() or torch.xpu.is_available()``; torch
    2.13 asks whether the device is the current accelerator), which fails on a GPU machine with "Torch not
    compiled with XPU enabled". For the fake tensors of a device this machine lacks, CUDA is hidden within
    the block, as ``CUDA_VISIBLE_DEVICES=""`` hides it from the CPU-only workers; nothing in it runs on CUDA."""
    module = getattr(torch, device_type, None)
    lacks = device_type != "cuda" and not (callable(getattr(module, "is_available", None)) and module.is_available())
    if not lacks:
        yield
        return
    cuda_is_available = torch.cuda.is_available
    torch.cuda.is_available = lambda: False
    try:
        yield
    finally:
        torch.cuda.is_available = cuda_is_available


@contextlib.contextmanager
def _autocast_on_fake(device_type: str, dtype: torch.dtype):
    """torch's own autocast for ``device_type``, switched on directly (torch.autocast refuses a device this
    machine lacks), over fake tensors of that device."""
    try:
        was = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
        torch.set_autocast_enabled(device_type, True)
    except RuntimeError as exc:
        pytest.skip(f"torch {torch.__version__} has no {device_type} autocast to switch on here: {exc}")
    torch.set_autocast_dtype(device_type, dtype)
    try:
        with _cuda_hidden_from_fake(device_type), FakeTensorMode(), torch.no_grad():
            yield  # (autograd on fake CUDA tensors would ask for the device)
    finally:
        torch.set_autocast_enabled(device_type, was[0])
        torch.set_autocast_dtype(device_type, was[1])
        torch.clear_autocast_cache()


def _built(dev: str, cls: type, *args: object, dtype: torch.dtype | None = None, **kwargs: object) -> nn.Module:
    """``cls(*args, **kwargs)`` on ``dev``: on another device than the CPU, made on the meta device outside any
    fake mode (initialising needs the device), then given fake tensors of ``dev`` as parameters and buffers;
    floating ones in ``dtype`` where given."""
    if dev == "cpu":
        return cls(*args, **kwargs).to(dtype) if dtype is not None else cls(*args, **kwargs)
    with unset_fake_temporarily(), torch.device("meta"):
        module = cls(*args, **kwargs)
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = nn.Parameter(torch.empty(p.shape, device=dev, dtype=dtype or p.dtype), False)
        for name, b in m._buffers.items():
            kind = dtype if dtype is not None and b is not None and b.is_floating_point() else None
            m._buffers[name] = b if b is None else torch.zeros(b.shape, device=dev, dtype=kind or b.dtype)
    return module


def _case(cls: type, dev: str, given: torch.dtype, untouched: bool = False) -> tuple[nn.Module, tuple, torch.dtype]:
    """An instance of ``cls`` on ``dev`` with inputs whose floating activation has dtype ``given``, and the
    dtype the module keeps when autocast leaves it alone (``untouched``: its parameters made in ``given``,
    as a module autocast does not cast must have them to run)."""
    def new(cls: type, *args: object, **kwargs: object) -> nn.Module:
        return _built(dev, cls, *args, dtype=given if untouched else None, **kwargs)

    def act(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=given)

    label = torch.zeros(4, dtype=torch.long, device=dev)
    table = {
        nn.Linear: lambda: (new(nn.Linear, 8, 8), (act(4, 8),)),
        nn.Bilinear: lambda: (new(nn.Bilinear, 8, 8, 4), (act(4, 8), act(4, 8))),
        nn.PReLU: lambda: (new(nn.PReLU), (act(4, 8),)),
        nn.Conv1d: lambda: (new(nn.Conv1d, 4, 4, 3), (act(2, 4, 8),)),
        nn.Conv2d: lambda: (new(nn.Conv2d, 4, 4, 3), (act(2, 4, 8, 8),)),
        nn.Conv3d: lambda: (new(nn.Conv3d, 4, 4, 3), (act(2, 4, 6, 6, 6),)),
        nn.ConvTranspose1d: lambda: (new(nn.ConvTranspose1d, 4, 4, 3), (act(2, 4, 8),)),
        nn.ConvTranspose2d: lambda: (new(nn.ConvTranspose2d, 4, 4, 3), (act(2, 4, 8, 8),)),
        nn.ConvTranspose3d: lambda: (new(nn.ConvTranspose3d, 4, 4, 3), (act(2, 4, 6, 6, 6),)),
        nn.LayerNorm: lambda: (new(nn.LayerNorm, 8), (act(4, 8),)),
        nn.GroupNorm: lambda: (new(nn.GroupNorm, 2, 8), (act(4, 8),)),
        nn.BatchNorm1d: lambda: (new(nn.BatchNorm1d, 8), (act(4, 8),)),
        nn.BatchNorm2d: lambda: (new(nn.BatchNorm2d, 4), (act(2, 4, 8, 8),)),
        nn.BatchNorm3d: lambda: (new(nn.BatchNorm3d, 4), (act(2, 4, 4, 4, 4),)),
        nn.SyncBatchNorm: lambda: (new(nn.SyncBatchNorm, 8).eval(), (act(4, 8, 2),)),
        nn.InstanceNorm1d: lambda: (new(nn.InstanceNorm1d, 4), (act(2, 4, 8),)),
        nn.InstanceNorm2d: lambda: (new(nn.InstanceNorm2d, 4), (act(2, 4, 8, 8),)),
        nn.InstanceNorm3d: lambda: (new(nn.InstanceNorm3d, 4), (act(2, 4, 4, 4, 4),)),
        nn.Softmax: lambda: (nn.Softmax(-1), (act(4, 8),)),
        nn.LogSoftmax: lambda: (nn.LogSoftmax(-1), (act(4, 8),)),
        nn.CrossEntropyLoss: lambda: (nn.CrossEntropyLoss(), (act(4, 8), label)),
        nn.NLLLoss: lambda: (nn.NLLLoss(), (act(4, 8), label)),
        nn.MSELoss: lambda: (nn.MSELoss(), (act(4, 8), act(4, 8))),
        nn.L1Loss: lambda: (nn.L1Loss(), (act(4, 8), act(4, 8))),
        nn.SmoothL1Loss: lambda: (nn.SmoothL1Loss(), (act(4, 8), act(4, 8))),
        nn.HuberLoss: lambda: (nn.HuberLoss(), (act(4, 8), act(4, 8))),
        nn.KLDivLoss: lambda: (nn.KLDivLoss(reduction="batchmean"), (act(4, 8), act(4, 8))),
        nn.BCELoss: lambda: (nn.BCELoss(), (act(4, 8).sigmoid(), act(4, 8).sigmoid())),
        nn.BCEWithLogitsLoss: lambda: (nn.BCEWithLogitsLoss(), (act(4, 8), act(4, 8))),
        nn.Embedding: lambda: (new(nn.Embedding, 10, 8), (label,)),
        nn.LeakyReLU: lambda: (nn.LeakyReLU(), (act(4, 8),)),
        nn.Dropout: lambda: (nn.Dropout(0.5), (act(4, 8),)),
    }
    if hasattr(nn, "RMSNorm"):
        table[nn.RMSNorm] = lambda: (new(nn.RMSNorm, 8), (act(4, 8),))
    assert set(table) == set(al.MODULE_OPS), "every module the lists place has a case here"
    module, args = table[cls]()
    module.eval()  # no running statistics to update: fake buffers of another dtype would need the device
    keeps = torch.float32 if cls is nn.Embedding and not untouched else given
    return module, args, keeps


def _widest(module: nn.Module, args: tuple) -> torch.dtype:
    """What a promote op computes in: the widest floating dtype among its inputs and the module's parameters."""
    dtypes = [t.dtype for t in (*args, *module.parameters()) if t.is_floating_point()]
    widest = dtypes[0]
    for dtype in dtypes[1:]:
        widest = torch.promote_types(widest, dtype)
    return widest


def _op_registered(cls: type, key: str) -> bool:
    """Whether this torch registers on ``key`` one of the ops deciding ``cls`` (other releases' lists differ)."""
    registered = _registered(key)
    return any(op in registered for op in al.MODULE_OPS[cls])


@pytest.mark.parametrize("device_type", ["cuda", "xpu", "mps"])
@pytest.mark.parametrize("given", [torch.float16, torch.float32], ids=["low-input", "fp32-input"])
def test_each_module_runs_as_the_declared_lists_say_under_torchs_own_autocast(device_type, given):
    """torch's autocast kernels for the device, run on fake tensors: what each module of MODULE_OPS gives
    is what the declared lists say (float32, the low dtype, a refusal, or the input's dtype)."""
    key, lists = TORCH_DEVICES[device_type]
    checked = []
    with _autocast_on_fake(device_type, torch.float16):
        for cls in al.MODULE_OPS:
            policy = lists.module_policy(cls)
            if not TORCH_213 and policy is not None and not _op_registered(cls, key):
                continue  # this release's lists do not have the op: the declaration is torch 2.13's
            module, args, keeps = _case(cls, device_type, given, untouched=policy is None)
            if policy == "banned":
                with pytest.raises(RuntimeError, match="unsafe to autocast"):
                    module(*args)
            else:
                out = module(*args)
                expected = {"fp32": torch.float32, "lower": torch.float16, "promote": _widest(module, args)}.get(
                    policy, keeps)
                assert out.dtype == expected, f"{cls.__name__} on {device_type}: {out.dtype}, declared {policy}"
            checked.append(cls)
    assert len(checked) >= len(al.MODULE_OPS) - 3


def test_the_cpu_lists_hold_on_the_cpu_itself():
    """The CPU declaration, checked with real tensors under the CPU's real autocast."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for cls in al.MODULE_OPS:
            for given in (torch.bfloat16, torch.float32):
                policy = al.CPU.module_policy(cls)
                if not TORCH_213 and policy is not None and not _op_registered(cls, "AutocastCPU"):
                    continue
                module, args, keeps = _case(cls, "cpu", given, untouched=policy is None)
                out = module(*args)
                expected = {"fp32": torch.float32, "lower": torch.bfloat16, "promote": _widest(module, args)}.get(
                    policy, keeps)
                assert out.dtype == expected, f"{cls.__name__} on cpu from {given}: {out.dtype}, declared {policy}"


def test_xpu_bans_bce_as_cuda_does_and_the_cpu_and_mps_do_not():
    assert al.XPU.module_policy(nn.BCELoss) == "banned" == al.CUDA.module_policy(nn.BCELoss)
    assert al.CPU.module_policy(nn.BCELoss) == "fp32"
    assert al.MPS.module_policy(nn.BCELoss) is None
    assert al.XPU.lower == al.CUDA.lower - {"cudnn_convolution", "cudnn_convolution_transpose"}


def test_each_backend_declares_its_devices_lists():
    assert CPUBackend.autocast_lists is al.CPU
    assert CUDABackend.autocast_lists is al.CUDA
    assert XPUBackend.autocast_lists is al.XPU
    assert MPSBackend.autocast_lists is al.MPS
    assert HPUBackend().autocast_lists is al.GAUDI
    for cls in (MLUBackend, MUSABackend):  # torch's macros, BCE banned
        lists = cls.autocast_lists
        assert (lists.lower, lists.fp32, lists.banned) == (al.CUDA.lower, al.CUDA.fp32, al.CUDA.banned)
    npu = NPUBackend.autocast_lists
    assert npu.policy("_scaled_dot_product_flash_attention") == "lower" and npu.policy("linalg_vecdot") is None
    assert npu.policy("upsample_bilinear2d") is None and npu.policy("norm") == "fp32"
    assert npu.policy("binary_cross_entropy") == "banned"


def test_the_npu_declaration_is_what_the_simulated_torch_npu_registers():
    """The npu backend's lists against the simulated torch_npu's (both read from AutoCastOps.cpp)."""
    import importlib.util

    from amp_backends.testing import sim_packages_path

    spec = importlib.util.spec_from_file_location(
        "_sim_torch_npu_lists", sim_packages_path("npu") / "torch_npu" / "__init__.py")
    source = spec.loader.get_source("_sim_torch_npu_lists")
    start = source.index("AUTOCAST_LISTS = {")
    namespace: dict = {}
    exec(source[start:source.index("\n}\n", start) + 3], namespace)  # the literal only: installing needs a process
    sim = namespace["AUTOCAST_LISTS"]
    declared = NPUBackend.autocast_lists
    assert set(sim["lower"]) == declared.lower
    assert set(sim["fp32"]) == declared.fp32
    assert set(sim["promote"]) == declared.promote


# -- Intel Gaudi: the bridge's defaults and its override files ---------------------------------------------
def test_gaudi_defaults_are_the_bridges():
    """hpu_ops/autocast_helpers.h (v1.19.0): 27 lower ops, 49 float32 ops, 12 promoted; norms and softmax
    in bf16, losses in float32, BCE in float32 and not banned; lower wins over float32 over promote."""
    g = al.GAUDI
    assert (len(g.lower), len(g.fp32), len(g.promote), g.banned) == (27, 49, 12, frozenset())
    for cls in (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm2d, nn.InstanceNorm2d, nn.Softmax, nn.LogSoftmax,
                nn.Linear, nn.Dropout):
        assert g.module_policy(cls) == "lower", cls
    for cls in (nn.CrossEntropyLoss, nn.NLLLoss, nn.MSELoss, nn.BCELoss, nn.BCEWithLogitsLoss, nn.Embedding):
        assert g.module_policy(cls) == "fp32", cls
    assert (g.policy("mul"), g.policy("div"), g.policy("add")) == ("lower", "fp32", "promote")
    assert g.first_input_only == {"layer_norm", "group_norm", "instance_norm", "batch_norm"}


def test_gaudi_override_files_replace_the_defaults(tmp_path):
    lower = tmp_path / "lower.txt"
    lower.write_text("linear\nmatmul\n")
    fp32 = tmp_path / "fp32.txt"
    fp32.write_text("layer_norm\nsoftmax\n")
    env = {al.GAUDI_LOWER_VARIABLE: str(lower), al.GAUDI_FP32_VARIABLE: str(fp32)}
    lists = al.gaudi(env)
    assert lists.lower == {"linear", "matmul"} and lists.fp32 == {"layer_norm", "softmax"}
    assert lists.promote == al.GAUDI.promote, "the promote list is fixed in the bridge"
    assert lists.module_policy(nn.LayerNorm) == "fp32" and lists.module_policy(nn.Conv2d) is None
    assert str(lower) in lists.source and str(fp32) in lists.source
    only_fp32 = al.gaudi({al.GAUDI_FP32_VARIABLE: str(fp32)})
    assert only_fp32.lower == al.GAUDI.lower and only_fp32.fp32 == {"layer_norm", "softmax"}


def test_gaudi_reads_each_line_whole_and_warns_where_that_names_nothing(tmp_path):
    path = tmp_path / "fp32.txt"
    path.write_bytes(b"mse_loss\r\n layer_norm\nsoftmax\n")
    with pytest.warns(RuntimeWarning, match="takes each line whole"):
        lists = al.gaudi({al.GAUDI_FP32_VARIABLE: str(path)})
    assert lists.fp32 == {"mse_loss\r", " layer_norm", "softmax"}
    assert lists.module_policy(nn.MSELoss) is None and lists.module_policy(nn.Softmax) == "lower"


def test_an_unreadable_gaudi_file_keeps_the_defaults_with_a_warning(tmp_path):
    with pytest.warns(RuntimeWarning, match="cannot be read.*keeps its default"):
        lists = al.gaudi({al.GAUDI_LOWER_VARIABLE: str(tmp_path / "missing.txt")})
    assert lists is al.GAUDI


def test_the_hpu_backend_reads_the_variables(tmp_path, monkeypatch):
    path = tmp_path / "lower.txt"
    path.write_text("mm\n")
    monkeypatch.setenv(al.GAUDI_LOWER_VARIABLE, str(path))
    assert HPUBackend().autocast_lists.lower == {"mm"}
    monkeypatch.delenv(al.GAUDI_LOWER_VARIABLE)
    assert HPUBackend().autocast_lists is al.GAUDI


def test_bad_lists_questions_are_refused():
    with pytest.raises(ValueError, match="not a policy"):
        al.CUDA.modules("float8")
    with pytest.raises(TypeError, match="no list named"):
        al.CUDA.changed("x", lowered=())


# -- the policy and the inspector follow the device's lists ------------------------------------------------
def _bce_model(dev: str = "cpu") -> nn.ModuleDict:
    return nn.ModuleDict({"model": nn.Sequential(_built(dev, nn.Linear, 8, 1), nn.Sigmoid()), "loss": nn.BCELoss()})


@pytest.mark.parametrize("backend, selected", [(XPUBackend, True), (CUDABackend, True), (HPUBackend, False),
                                               (MPSBackend, False), (CPUBackend, False)])
def test_the_policy_runs_bce_in_float32_where_the_devices_autocast_refuses_it(backend, selected):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _bce_model()  # kept: a policy holds its model weakly
        policy = amp_backends.precision_policy(model, fp32=(), backend=backend())
    assert ("loss" in policy.selected) is selected
    if selected:
        assert "refuses binary_cross_entropy" in policy.selected["loss"]


def test_on_xpus_own_autocast_the_policy_rescues_bce():
    """torch's XPU autocast kernels (fake XPU tensors): BCELoss raises there, and runs in float32 once a
    policy built with the xpu backend holds it."""
    with _autocast_on_fake("xpu", torch.float16):
        holder = _bce_model("xpu")
        x, y = torch.randn(4, 8, device="xpu"), torch.rand(4, 1, device="xpu")
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            holder["loss"](holder["model"](x), y)
        policy = amp_backends.precision_policy(holder, fp32=(), backend=XPUBackend())
        try:
            value = holder["loss"](holder["model"](x), y)
        finally:
            policy.remove()
    assert value.dtype == torch.float32


def test_the_inspector_labels_float32_ops_from_the_devices_lists():
    """On the CPU, autocast runs BCELoss in float32 (the CPU's list), which CUDA's lists would not say, and
    runs LayerNorm in its input's dtype: the report follows the CPU's lists."""
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1), nn.Sigmoid())
    bce = nn.BCELoss()
    target = torch.rand(4, 1)
    holder = nn.ModuleDict({"net": model, "bce": bce})

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.holder = holder

        def forward(self, x):
            return self.holder["bce"](self.holder["net"](x), target)

    report = amp_backends.check_model(Both(), torch.randn(4, 8), "cpu", torch.bfloat16)
    rows = {r.name: r for r in report.rows}
    assert rows["holder.bce"].fp32_reason == "autocast: float32 op"
    assert rows["holder.net.1"].output_dtype == "bfloat16" and rows["holder.net.1"].fp32_reason is None


@pytest.mark.parametrize("backend, would", [(CUDABackend, "float32 already"), (HPUBackend, "the low dtype"),
                                            (CPUBackend, "its input's dtype"), (MPSBackend, "float32 already")])
def test_the_recipes_reasons_say_what_the_devices_autocast_would_do(backend, would):
    """The recipe keeps norms in float32 on every device; its reason says what that device's autocast would
    have done with them (CUDA: float32 anyway; Gaudi: bf16; the CPU: the input's dtype), from the lists."""
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        policy = amp_backends.precision_policy(model, backend=backend())
    try:
        assert policy.selected["1"] == f"recipe: LayerNorm (under {backend.name}'s autocast it would run in {would})"
        assert policy.selected["3"] == "recipe: the final classifier / head"
        expected_bn = {"mps": "float32 already", "hpu": "the low dtype", "cpu": "its input's dtype"}.get(
            backend.name, "its input's dtype")
        assert policy.selected["2"].endswith(f"it would run in {expected_bn})")
    finally:
        policy.remove()
    policy = amp_backends.precision_policy(model)
    assert policy.selected["1"] == "recipe: LayerNorm", "without a backend: no claim about a device"
    policy.remove()


def test_the_simulated_promote_prioritizes_as_torchs_autocast():
    """The simulated devices' promote ops against torch's own ``at::autocast::prioritize`` (the CPU's
    autocast, promoting ``cat``): for every mix of input dtypes, the same output dtype or the same
    refusal (float16 meeting bfloat16), float64 left alone."""
    import itertools

    from amp_backends.testing.simautocast import _prioritize

    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    for low in (torch.bfloat16, torch.float16):
        for n in (1, 2, 3):
            for mix in itertools.product(dtypes, repeat=n):
                try:
                    with torch.autocast("cpu", dtype=low):
                        expected = torch.cat([torch.ones(1, dtype=d) for d in mix]).dtype
                except RuntimeError as exc:
                    assert "prioritize" in str(exc)
                    with pytest.raises(RuntimeError, match="Unexpected floating ScalarType in at::autocast::prioritize"):
                        _prioritize(low, list(mix))
                    continue
                target = _prioritize(low, list(mix))
                cast = [target if d in (torch.float16, torch.bfloat16, torch.float32) else d for d in mix]
                assert functools.reduce(torch.promote_types, cast) == expected, (low, mix)
