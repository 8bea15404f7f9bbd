"""The registry under a broken vendor plugin: a plugin whose hook raises after registering leaves the
table as it found it (a built-in it overrode, a name it made a duplicate, come back); a plugin
registering one name twice is named; a kernel whose availability question raises is named, not
skipped in silence; a kernel that clears a found_inf already set fails its self-check; another thread
asking while plugins load waits for them, and a plugin asking at import is told why. Each plugin is a
real entry-point distribution in a subprocess."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import cpu_only_env, run_json, write_distribution

_FAILING_OVERRIDE = '''
import torch, amp_backends
from amp_backends_plugins.cpu import CPUBackend

class Cpu2(CPUBackend):
    pass

@amp_backends.hookimpl
def amp_backends_register_backends(register):
    register(Cpu2(), override=True)
    raise RuntimeError("driver init failed after registering")
'''

_ACME = '''
import torch, amp_backends

class Acme(amp_backends.Backend):
    name = "acme"
    device_type = "cpu"
    default_dtype = torch.bfloat16
    priority = 50

    def unavailable_reason(self):
        return None

    def supported_dtypes(self):
        return (torch.bfloat16,)

@amp_backends.hookimpl
def amp_backends_register_backends(register):
    register(Acme())
    TAIL
'''


def _names(roots: list[Path]) -> dict:
    return run_json("""
    import json, warnings, amp_backends
    warnings.simplefilter("ignore")
    records = {r.name: [r.status, r.backends] for r in amp_backends.plugins()}
    try:
        acme = amp_backends.get("acme").name
    except amp_backends.AmpBackendsError as exc:
        acme = type(exc).__name__ + ": " + str(exc)
    print(json.dumps({"names": amp_backends.names(), "cpu": type(amp_backends.get("cpu")).__name__,
                      "best": amp_backends.get().name, "acme": acme, "records": records}))
    """, roots, cpu_only_env())


def test_a_plugin_failing_after_overriding_a_builtin_leaves_the_builtin(tmp_path: Path) -> None:
    """It used to delete cpu: get() found no backend at all."""
    root = write_distribution(tmp_path / "s", "acme-broken", "acme_broken", _FAILING_OVERRIDE, {"acmebroken": "acme_broken"})
    out = _names([root])
    assert "cpu" in out["names"] and out["cpu"] == "CPUBackend" and out["best"] == "cpu"
    assert out["records"]["acmebroken"] == ["failed", []]


def test_a_plugin_failing_after_taking_a_name_leaves_the_working_plugin_its_name(tmp_path: Path) -> None:
    """A second plugin registering 'acme' and then raising used to leave the name a duplicate: the working
    acme was unusable and get() fell back to cpu in silence."""
    good = write_distribution(tmp_path / "a", "acme-good", "acme_good", _ACME.replace("TAIL", ""), {"acme": "acme_good"})
    bad = write_distribution(tmp_path / "z", "zz-broken", "zz_broken",
                             _ACME.replace("TAIL", "raise RuntimeError('broken after registering')"),
                             {"zzbroken": "zz_broken"})
    out = _names([good, bad])
    assert out["acme"] == "acme" and out["best"] == "acme"
    assert out["records"]["zzbroken"] == ["failed", []] and out["records"]["acme"] == ["loaded", ["acme"]]


def test_a_plugin_registering_one_name_twice_is_named(tmp_path: Path) -> None:
    root = write_distribution(tmp_path / "t", "acme-twice", "acme_twice", _ACME.replace("TAIL", "register(Acme())"),
                              {"acme": "acme_twice"})
    out = _names([root])
    assert out["acme"].startswith("PluginLoadError") and "registers a backend named 'acme' twice" in out["acme"]
    assert "cpu" in out["names"]


_RAISING_KERNEL = '''
import amp_backends

class Broken(amp_backends.Kernel):
    name = "acme_raise"
    priority = 200
    auto_device_types = ("cpu",)

    def unavailable_reason(self, device_type):
        raise RuntimeError("libacme.so: cannot open shared object file")

    def grad_op_(self, group, found_inf, inv_scale=None, norm_sq=None):
        raise AssertionError("never run")

@amp_backends.hookimpl
def amp_backends_register_kernels(register):
    register(Broken())
'''


def test_a_kernel_whose_availability_question_raises_is_named(tmp_path: Path) -> None:
    """torch's kernel is used, and the reason is kept for info and warned once (it was skipped silently);
    forced by AMP_BACKENDS_KERNEL, the error names the variable and the kernel's exception."""
    root = write_distribution(tmp_path / "k", "acme-kernels", "acme_kernels", _RAISING_KERNEL, {"acmek": "acme_kernels"})
    code = """
    import json, warnings, amp_backends
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            kernel = amp_backends.get("cpu").kernel.name
        except amp_backends.AmpBackendsError as exc:
            kernel = str(exc)
    print(json.dumps({"kernel": kernel, "rejections": amp_backends.registry.default_registry().kernel_rejections("cpu"),
                      "warned": [str(w.message) for w in caught if "acme_raise" in str(w.message)]}))
    """
    out = run_json(code, [root], cpu_only_env())
    assert out["kernel"] == "torch"
    assert any("raised RuntimeError" in r and "libacme.so" in r for r in out["rejections"])
    assert len(out["warned"]) == 1
    forced = run_json(code, [root], {**cpu_only_env(), "AMP_BACKENDS_KERNEL": "acme_raise"})
    assert "AMP_BACKENDS_KERNEL='acme_raise' cannot run on 'cpu'" in forced["kernel"]
    assert "unavailable_reason() raised RuntimeError: libacme.so" in forced["kernel"]


def test_a_kernel_that_clears_found_inf_fails_its_self_check() -> None:
    """A kernel copying its own verdict into found_inf (``found_inf.copy_(local)``) loses an earlier
    group's inf: the scaler would step on it. The self-check now starts one call from found_inf = 1."""
    from amp_backends.gradients.kernel import TORCH_KERNEL
    from amp_backends.gradients.selfcheck import kernel_self_check

    class Overwrites:
        name, priority = "overwrites", 1

        def unavailable_reason(self, device_type: str) -> None:
            return None

        def grad_op_(self, group, found_inf, inv_scale=None, norm_sq=None) -> None:  # noqa: ANN001
            local = torch.zeros_like(found_inf)
            TORCH_KERNEL.grad_op_(group, local, inv_scale, norm_sq)
            found_inf.copy_(local)

    assert kernel_self_check(TORCH_KERNEL, torch.device("cpu")) is None
    problem = kernel_self_check(Overwrites(), torch.device("cpu"))  # type: ignore[arg-type]
    assert problem is not None and "cleared a found_inf already set" in problem


_SLOW_IMPORT = '''
import time, amp_backends
time.sleep(2.0)
ASK

@amp_backends.hookimpl
def amp_backends_register_backends(register):
    pass
'''


def test_another_thread_waits_for_the_plugins_and_one_asking_at_import_is_told_why(tmp_path: Path) -> None:
    """A thread asking while another loads the plugins (a slow import) used to get an empty registry
    ("unknown backend 'cpu'"); a plugin calling get() at import, the same with no reason given."""
    slow = write_distribution(tmp_path / "s", "acme-slow", "acme_slow", _SLOW_IMPORT.replace("ASK", ""),
                              {"acmeslow": "acme_slow"})
    out = run_json("""
    import json, threading, time, amp_backends
    got = {}
    loader = threading.Thread(target=lambda: got.setdefault("a", amp_backends.names()))
    loader.start()
    time.sleep(0.5)
    try:
        got["b"] = amp_backends.get("cpu").name
    except amp_backends.AmpBackendsError as exc:
        got["b"] = str(exc)
    loader.join()
    print(json.dumps(got))
    """, [slow], cpu_only_env())
    assert out["b"] == "cpu" and "cpu" in out["a"]
    asking = write_distribution(tmp_path / "r", "acme-reent", "acme_reent",
                                _SLOW_IMPORT.replace("time.sleep(2.0)", "").replace("ASK", "amp_backends.get('cpu')"),
                                {"acmer": "acme_reent"})
    out = run_json("""
    import json, amp_backends
    records = {r.name: r.error for r in amp_backends.plugins()}
    print(json.dumps({"cpu": amp_backends.get("cpu").name, "error": str(records.get("acmer"))}))
    """, [asking], cpu_only_env())
    assert out["cpu"] == "cpu" and "while its plugins are loading" in out["error"]
