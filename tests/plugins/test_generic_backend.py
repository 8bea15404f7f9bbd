"""The generic backend: an accelerator torch reports that no plugin claims, served from torch's
own APIs. End to end on the simulated extension torch_sim (PrivateUse1 renamed "sim", autoloaded
by ``import torch`` through its ``torch.backends`` entry point, no amp_backends plugin), each run in
its own process (PrivateUse1 is renamed once per process); the registry's fallback rule and the
torch < 2.6 path in process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import amp_backends
from amp_backends import hookimpl
from amp_backends.backend import Backend
from amp_backends.registry import Registry
from amp_backends.testing import sim_packages_path

from conftest import ACME_SOURCE, cpu_only_env, run_json, run_python
from sim_marks import needs_sim_device

GENERIC = [sim_packages_path("generic")]
needs_accelerator_api = pytest.mark.skipif(
    not hasattr(torch, "accelerator"), reason=f"torch.accelerator arrived in torch 2.6; this is torch {torch.__version__}"
)

LOOP = """
import json, math, torch, amp_backends
be = amp_backends.get()
dev = be.device()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(32, 8).to(dev); y = torch.randn(32, 1).to(dev)
scaler = be.grad_scaler(torch.float16, init_scale=2.0**10)
record, dtypes = [], []
for step in range(4):
    opt.zero_grad()
    with be.autocast(torch.float16):
        out = model(x)
        dtypes.append(str(out.dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y)
    if step == 2:
        loss = loss * torch.full((), math.inf, device=dev)
    scaler.scale(loss).backward()
    scaler.step(opt); scaler.update()
    record.append([scaler.last_step_skipped, scaler.get_scale()])
try:
    amp_backends.distributed.init_process_group(be)
    dist_error = None
except amp_backends.AmpBackendsError as exc:
    dist_error = str(exc)
print(json.dumps({"name": be.name, "type": type(be).__name__, "device": str(dev), "record": record,
                  "dtypes": dtypes, "supported": [str(d) for d in be.supported_dtypes()],
                  "default": str(be.default_dtype), "fp64": be.has_fp64, "dist": be.dist_backend,
                  "available": amp_backends.available(), "torch_sim_plugin": "torch_sim" in
                  [p.name for p in amp_backends.plugins()], "dist_error": dist_error}))
"""


@needs_sim_device
@needs_accelerator_api
def test_an_unclaimed_accelerator_trains_through_the_generic_backend():
    out = run_json(LOOP, GENERIC, cpu_only_env())
    assert out["name"] == "sim" and out["type"] == "AcceleratorBackend" and out["device"] == "sim"
    assert out["available"][0] == "sim", "the accelerator ranks above cpu"
    assert out["torch_sim_plugin"] is False, "no amp_backends plugin is involved"
    assert set(out["dtypes"]) == {"torch.float16"}, "autocast ran the linear layers in float16 on the device"
    assert out["supported"] == ["torch.float16", "torch.bfloat16"] and out["default"] == "torch.float16"
    assert out["fp64"] is True and out["dist"] == "", "no process-group backend reduces sim tensors (gloo cannot)"
    assert "can reduce 'sim' tensors" in out["dist_error"] and "register_backend" in out["dist_error"]
    skipped = [r[0] for r in out["record"]]
    scales = [r[1] for r in out["record"]]
    assert skipped == [False, False, True, False]
    assert scales[2] == scales[1] / 2, "the inf step backed the scale off"


@needs_sim_device
@needs_accelerator_api
def test_info_lists_the_generic_backend():
    proc = run_python("from amp_backends.cli import main; main(['info', '--json'])", GENERIC, cpu_only_env())
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    row = next(b for b in data["backends"] if b["name"] == "sim")
    assert row["available"] and row["generic"] and row["plugin"] == "generic"
    assert "torch.accelerator reports 'sim'" in row["device"]
    assert data["best"] == "sim"
    text = run_python("from amp_backends.cli import main; main(['info'])", GENERIC, cpu_only_env()).stdout
    assert "(generic)" in text and "sim: generic: torch.accelerator reports 'sim'" in text


@needs_sim_device
@needs_accelerator_api
@pytest.mark.parametrize(("env", "reason"), [
    ({"AMP_SIM_GENERIC_DTYPES": "none"}, "accepts neither float16 nor bfloat16"),
    ({"AMP_SIM_GENERIC_UNSCALE": "0"}, "has no working kernel on 'sim'"),
], ids=["no-autocast-dtype", "no-unscale-kernel"])
def test_a_device_the_generic_path_cannot_serve_is_named_with_the_reason(env, reason):
    code = """
    import json, warnings, amp_backends
    from amp_backends.registry import default_registry, probe
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        best = amp_backends.get().name
    be = next(b for b, _ in default_registry().backends() if b.name == "sim")
    try:
        amp_backends.get("sim"); error = None
    except amp_backends.BackendUnavailableError as exc:
        error = str(exc)
    print(json.dumps({"best": best, "reason": probe(be), "error": error,
                      "warnings": [str(w.message) for w in caught]}))
    """
    out = run_json(code, GENERIC, {**cpu_only_env(), **env})
    assert out["best"] == "cpu"
    assert reason in out["reason"] and reason in out["error"]
    assert any("torch reports a usable 'sim' accelerator" in w and reason in w for w in out["warnings"]), (
        "falling back to cpu with an accelerator present is never silent")


@needs_sim_device
@needs_accelerator_api
def test_the_conformance_suite_passes_on_the_generic_backend(tmp_path):
    full = {k: v for k, v in os.environ.items() if not k.startswith("AMP_BACKEND")}
    full.update(cpu_only_env())
    full["PYTHONPATH"] = os.pathsep.join([str(p) for p in GENERIC] + [full.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "amp_backends.testing", "--amp-backend", "sim",
         "-q", "-p", "no:cacheprovider", "-p", "no:xdist"],
        capture_output=True, text=True, env=full, cwd=tmp_path, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


@needs_sim_device
@needs_accelerator_api
def test_a_plugin_for_the_device_replaces_the_generic_backend():
    code = """
    import json, torch, amp_backends
    from amp_backends import Backend, hookimpl

    class SimVendor(Backend):
        name = "simvendor"; device_type = "sim"; priority = 100
        def is_available(self): return True

    class Plugin:
        @hookimpl
        def amp_backends_register_backends(self, register):
            register(SimVendor())

    before = amp_backends.names()
    amp_backends.register_plugin(Plugin(), name="simvendor")
    print(json.dumps({"before": "sim" in before, "after": amp_backends.names(), "best": amp_backends.get().name}))
    """
    out = run_json(code, GENERIC, cpu_only_env())
    assert out["before"] is True
    assert "sim" not in out["after"] and "simvendor" in out["after"] and out["best"] == "simvendor"


# -- the registry's fallback rule, in process -------------------------------------------------
# (the fakes run on "meta": a backend on a device type torch does not know is unavailable)
class _Fake(Backend):
    priority = 60

    def __init__(self, name: str, device_type: str) -> None:
        self.name, self.device_type = name, device_type

    def is_available(self) -> bool:
        return True


def _plugin(backend: Backend, **kwargs):
    class Plugin:
        @hookimpl
        def amp_backends_register_backends(self, register):
            register(backend, **kwargs)

    return Plugin()


def _registry(*plugins) -> Registry:
    registry = Registry(group="amp_backends_no_such_group")
    for i, plugin in enumerate(plugins):
        registry.register_plugin(plugin, name=f"p{i}")
    return registry


def test_a_fallback_backend_stays_while_nothing_else_serves_its_device_type():
    registry = _registry(_plugin(_Fake("fakeacc", "meta"), fallback=True))
    assert registry.names() == ["fakeacc"]
    assert registry.get().name == "fakeacc"


@pytest.mark.parametrize("order", ["fallback-first", "fallback-last"])
def test_a_fallback_yields_to_any_backend_of_its_device_type(order):
    fallback = _plugin(_Fake("fakeacc", "meta"), fallback=True)
    vendor = _plugin(_Fake("vendoracc", "meta"))
    registry = _registry(*((fallback, vendor) if order == "fallback-first" else (vendor, fallback)))
    assert registry.names() == ["vendoracc"]
    assert registry.duplicates() == {}


def test_a_fallback_yields_to_a_backend_of_its_name_registered_later():
    registry = _registry(_plugin(_Fake("fakeacc", "meta"), fallback=True))
    assert registry.names() == ["fakeacc"]
    real = _Fake("fakeacc", "meta")
    registry.register_plugin(_plugin(real), name="vendor")
    assert registry.names() == ["fakeacc"] and registry.get("fakeacc") is real
    assert registry.duplicates() == {}


def test_fallback_and_override_together_are_refused():
    registry = _registry(_plugin(_Fake("fakeacc", "meta"), fallback=True, override=True))
    assert registry.names() == []
    record = next(r for r in registry.plugins() if r.name == "p0")
    assert record.status == "failed" and "a fallback never overrides" in record.error


def test_on_torch_without_torch_accelerator_the_generic_backend_names_the_version_it_needs(monkeypatch):
    from amp_backends_plugins import generic

    monkeypatch.setattr(generic, "current_accelerator_type", lambda: None)
    monkeypatch.setattr(generic, "privateuse1_name", lambda: "oldacc")
    if hasattr(torch, "accelerator"):
        monkeypatch.delattr(torch, "accelerator")
    backend = generic.detect()
    assert backend is not None and backend.name == "oldacc"
    reason = backend.unavailable_reason()
    assert "needs torch 2.6+" in reason and "oldacc" in reason and torch.__version__ in reason


@needs_accelerator_api
def test_the_generic_backend_is_not_offered_for_cpu_or_a_claimed_device(monkeypatch):
    from amp_backends_plugins import generic

    monkeypatch.setattr(generic, "current_accelerator_type", lambda: "cpu")
    assert generic.detect() is None
    monkeypatch.setattr(generic, "current_accelerator_type", lambda: "cuda")
    found = generic.detect()
    assert found is not None and found.device_type == "cuda"
    names = amp_backends.names()
    assert names.count("cuda") == 1, "the cuda plugin claims the device: no generic one beside it"


def test_a_fallback_does_not_take_over_a_device_whose_plugin_was_switched_off(monkeypatch):
    """AMP_BACKENDS_DISABLE_PLUGINS=cuda on a CUDA build of torch: no cuda backend at all, not a
    generic one in its place."""
    from amp_backends_plugins import generic

    monkeypatch.setattr(generic, "current_accelerator_type", lambda: "cuda")
    monkeypatch.setenv("AMP_BACKENDS_DISABLE_PLUGINS", "cuda")
    registry = Registry()
    assert "cuda" not in registry.names()
    monkeypatch.setenv("AMP_BACKENDS_DISABLE_PLUGINS", "")
    served = [b for b, _ in Registry().backends() if b.device_type == "cuda"]
    assert [type(b).__name__ for b in served] == ["CUDABackend"], "the cuda plugin, never a generic twin"


@needs_sim_device
@needs_accelerator_api
def test_reprobe_asks_the_generic_backend_again():
    """A device that becomes visible (torch.accelerator.device_count() 0, then 1): unavailable until
    amp_backends.reprobe(), available after it, with no reload."""
    code = """
    import json, torch, amp_backends
    real = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 0
    before = amp_backends.available()
    torch.accelerator.device_count = real
    cached = amp_backends.available()
    amp_backends.reprobe()
    print(json.dumps({"before": before, "cached": cached, "after": amp_backends.available(),
                      "best": amp_backends.get().name}))
    """
    out = run_json(code, GENERIC, cpu_only_env())
    assert "sim" not in out["before"] and "sim" not in out["cached"], "asked once per process"
    assert "sim" in out["after"] and out["best"] == "sim"


# the vendor's own backend name ("acme-sim"), not the device type, for the simulated "sim" device
SIM_PLUGIN = (ACME_SOURCE.replace('name = "acme"', 'name = "acme-sim"').replace('"cpu"', '"sim"')
              .replace("torch.bfloat16", "torch.float16"))


@needs_sim_device
@needs_accelerator_api
def test_a_switched_off_vendor_plugin_is_not_replaced_silently(tmp_path):
    """The vendor's plugin (entry point 'acmesim', device 'sim') switched off: the generic backend
    serves 'sim', and says that it stands in while a plugin is off."""
    from conftest import write_distribution

    vendor = write_distribution(tmp_path / "v", "acme-sim", "acme_sim", SIM_PLUGIN, {"acmesim": "acme_sim"})
    code = """
    import json, warnings, amp_backends
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        be = amp_backends.get()
    print(json.dumps({"name": be.name, "warnings": [str(w.message) for w in caught]}))
    """
    on = run_json(code, [*GENERIC, str(vendor)], cpu_only_env())
    assert on["name"] == "acme-sim" and not [w for w in on["warnings"] if "generic backend" in w]
    env = cpu_only_env()
    env["AMP_BACKENDS_DISABLE_PLUGINS"] = ",".join(filter(None, [env.get("AMP_BACKENDS_DISABLE_PLUGINS"), "acmesim"]))
    off = run_json(code, [*GENERIC, str(vendor)], env)
    assert off["name"] == "sim"
    assert [w for w in off["warnings"] if "'sim' runs on the generic backend" in w and "acmesim (disabled)" in w]
