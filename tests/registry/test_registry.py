"""Discovery through real entry points, errors, duplicates and the environment variables."""

from __future__ import annotations

import json
import re

import pytest

import amp_backends
from amp_backends import BackendUnavailableError, UnknownBackendError

from conftest import ACME_SOURCE, run_json, run_python, write_distribution


def test_builtin_backends_come_from_the_entry_point_group(no_amp_env):
    plugins = {p.name: p for p in amp_backends.plugins()}
    assert {"cpu", "cuda"} <= set(plugins)
    for name in ("cpu", "cuda"):
        assert plugins[name].builtin and plugins[name].package == "amp-backends"
        assert plugins[name].status == "loaded" and plugins[name].backends == [name]
    assert {"cpu", "cuda"} <= set(amp_backends.names())
    assert amp_backends.available()[-1] == "cpu"


def test_cpu_backend_contract(no_amp_env):
    import torch

    be = amp_backends.get("cpu")
    assert (be.name, be.device_type, be.default_dtype, be.dist_backend) == ("cpu", "cpu", torch.bfloat16, "gloo")
    assert be.supported_dtypes() == (torch.bfloat16, torch.float16)
    assert be.is_available() and be.unavailable_reason() is None
    assert be.device() == torch.device("cpu") and be.device(0) == torch.device("cpu", 0)
    assert be.max_memory_allocated() is None  # the CPU keeps no peak-memory counter
    assert be.memory_allocated() is None
    be.empty_cache()  # nothing cached: a no-op, not an error
    be.synchronize()


def test_auto_prefers_accelerators_and_AMP_BACKEND_overrides(no_amp_env, monkeypatch):
    import torch

    available = amp_backends.available()
    assert available[-1] == "cpu", "accelerators come before the CPU"
    assert ("cuda" in available) is torch.cuda.is_available()
    expected = available[0]
    assert amp_backends.get().name == expected
    assert amp_backends.get("auto").name == expected
    monkeypatch.setenv("AMP_BACKEND", "cpu")
    assert amp_backends.get().name == "cpu"
    monkeypatch.setenv("AMP_BACKEND", "nope")
    with pytest.raises(UnknownBackendError, match="AMP_BACKEND='nope' cannot be used: unknown backend 'nope'"):
        amp_backends.get()


def test_unknown_backend_lists_known_and_closest(no_amp_env):
    with pytest.raises(UnknownBackendError) as info:
        amp_backends.get("cdua")
    message = str(info.value)
    assert "Did you mean 'cuda'?" in message and "Known backends: cpu, cuda" in message
    assert isinstance(info.value, LookupError)
    with pytest.raises(TypeError, match="must be a string"):
        amp_backends.get(3)  # type: ignore[arg-type]  # the wrong type on purpose: the refusal is the test


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA is available here")
def test_cuda_unavailable_says_why(no_amp_env):
    with pytest.raises(BackendUnavailableError, match="torch was built without CUDA|no CUDA device visible"):
        amp_backends.get("cuda")


def test_third_party_plugin_found_through_entry_point_and_trains(acme_plugin):
    out = run_json(
        """
        import json, torch, amp_backends
        be = amp_backends.get("acme")
        rec = [p for p in amp_backends.plugins() if p.name == "acme"][0]
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(64, 8); y = x.sum(1, keepdim=True)
        scaler = be.grad_scaler()
        losses = []
        for _ in range(30):
            opt.zero_grad()
            with be.autocast():
                out = model(x)
                dtype = str(out.dtype)
                loss = torch.nn.functional.mse_loss(out.float(), y)
            scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
            losses.append(loss.item())
        print(json.dumps({"names": amp_backends.names(), "package": rec.package, "version": rec.version,
                          "builtin": rec.builtin, "dtype": dtype, "first": losses[0], "last": losses[-1]}))
        """,
        [acme_plugin],
    )
    assert "acme" in out["names"] and out["package"] == "acme-amp" and out["version"] == "1.0"
    assert out["builtin"] is False and out["dtype"] == "torch.bfloat16"
    assert out["last"] < out["first"] * 0.2


def test_plugin_failing_on_import_breaks_nothing_else(tmp_path):
    root = write_distribution(tmp_path / "b", "broken-amp", "broken_amp", "raise ImportError('libfoo.so missing')\n",
                              {"broken": "broken_amp"})
    out = run_json(
        """
        import json, amp_backends
        try:
            amp_backends.get("broken")
        except amp_backends.PluginLoadError as e:
            err = str(e)
        rec = [p for p in amp_backends.plugins() if p.name == "broken"][0]
        print(json.dumps({"cpu": amp_backends.get("cpu").name, "err": err, "status": rec.status,
                          "tb": "libfoo" in rec.traceback}))
        """,
        [root],
    )
    assert out["cpu"] == "cpu" and out["status"] == "failed" and out["tb"]
    assert "broken-amp" in out["err"] and "libfoo.so missing" in out["err"]
    assert "AMP_BACKENDS_DISABLE_PLUGINS=broken" in out["err"]


def test_plugin_failing_in_its_hook_is_isolated(tmp_path):
    source = ACME_SOURCE.replace("register(AcmeBackend())", "register(AcmeBackend()); raise RuntimeError('boom')")
    root = write_distribution(tmp_path / "h", "hooky-amp", "hooky_amp", source, {"hooky": "hooky_amp"})
    out = run_json(
        """
        import json, amp_backends
        errs = []
        for name in ("hooky", "acme"):
            try:
                amp_backends.get(name)
            except Exception as e:
                errs.append(f"{type(e).__name__}: {e}")
        print(json.dumps({"names": amp_backends.names(), "errs": errs}))
        """,
        [root],
    )
    assert "acme" not in out["names"], "a failed plugin's partial registrations are dropped"
    assert out["errs"][0].startswith("PluginLoadError") and "boom" in out["errs"][0]
    assert out["errs"][1].startswith("UnknownBackendError") and "hooky (hooky-amp): RuntimeError: boom" in out["errs"][1]


def test_duplicate_names_are_refused_naming_both_packages(tmp_path):
    a = write_distribution(tmp_path / "a", "acme-amp", "acme_amp", ACME_SOURCE, {"acme": "acme_amp"})
    b = write_distribution(tmp_path / "b", "other-amp", "other_amp", ACME_SOURCE, {"other": "other_amp"})
    proc = run_python(
        """
        import amp_backends
        print(amp_backends.get("cpu").name)
        amp_backends.get("acme")
        """,
        [a, b],
    )
    assert proc.returncode != 0 and proc.stdout.strip() == "cpu"
    assert "DuplicateBackendError" in proc.stderr
    assert "acme-amp" in proc.stderr and "other-amp" in proc.stderr and "override=True" in proc.stderr


def test_explicit_override_replaces_a_builtin(tmp_path):
    source = ACME_SOURCE.replace('name = "acme"', 'name = "cpu"').replace(
        "register(AcmeBackend())", "register(AcmeBackend(), override=True)"
    )
    root = write_distribution(tmp_path / "o", "fastcpu-amp", "fastcpu_amp", source, {"fastcpu": "fastcpu_amp"})
    out = run_json(
        "import json, amp_backends; print(json.dumps(type(amp_backends.get('cpu')).__name__))", [root]
    )
    assert out == "AcmeBackend"


@pytest.mark.parametrize(
    ("env", "acme_loaded", "reason"),
    [
        ({"AMP_BACKENDS_DISABLE_PLUGINS": "1"}, False, "third-party plugins disabled"),
        ({"AMP_BACKENDS_DISABLE_PLUGINS": "acme"}, False, "disabled by AMP_BACKENDS_DISABLE_PLUGINS"),
        ({"AMP_BACKENDS_DISABLE_PLUGINS": "acme-amp"}, False, "disabled by AMP_BACKENDS_DISABLE_PLUGINS"),
        ({"AMP_BACKENDS_PLUGINS": "somethingelse"}, False, "allow-list"),
        ({"AMP_BACKENDS_PLUGINS": "acme"}, True, ""),
        ({}, True, ""),
    ],
)
def test_environment_controls_which_plugins_are_imported(acme_plugin, env, acme_loaded, reason):
    out = run_json(
        """
        import json, sys, amp_backends
        names = amp_backends.names()
        rec = [p for p in amp_backends.plugins() if p.name == "acme"][0]
        err = ""
        try:
            amp_backends.get("acme")
        except amp_backends.BackendUnavailableError as e:
            err = str(e)
        print(json.dumps({"names": names, "imported": "acme_amp" in sys.modules, "error": rec.error, "err": err}))
        """,
        [acme_plugin],
        env,
    )
    assert ("acme" in out["names"]) is acme_loaded
    assert out["imported"] is acme_loaded, "a disabled plugin's code is never imported"
    assert "cpu" in out["names"], "built-in plugins still load"
    if not acme_loaded:
        assert reason in out["error"] and reason in out["err"]


def test_builtin_plugin_can_be_disabled_by_name():
    out = run_json(
        "import json, amp_backends; print(json.dumps(amp_backends.names()))",
        env={"AMP_BACKENDS_DISABLE_PLUGINS": "cuda"},
    )
    assert "cuda" not in out and "cpu" in out


def test_in_process_plugin_registration(no_amp_env):
    import torch

    class Local(amp_backends.Backend):
        name, device_type, default_dtype = "local", "cpu", torch.float16

        def is_available(self) -> bool:
            return False

    class Plugin:
        @amp_backends.hookimpl
        def amp_backends_register_backends(self, register):
            register(Local())

    amp_backends.register_plugin(Plugin(), name="local-plugin")
    try:
        assert "local" in amp_backends.names() and "local" not in amp_backends.available()
        with pytest.raises(BackendUnavailableError, match=r"Local.is_available\(\) returned False"):
            amp_backends.get("local")
    finally:
        amp_backends.registry.default_registry().unregister_plugin("local-plugin")
    assert "local" not in amp_backends.names()


def test_register_rejects_non_backends(tmp_path):
    source = "import amp_backends\n@amp_backends.hookimpl\ndef amp_backends_register_backends(register):\n    register('cpu')\n"
    root = write_distribution(tmp_path / "w", "wrong-amp", "wrong_amp", source, {"wrong": "wrong_amp"})
    out = run_json(
        "import json, amp_backends; r=[p for p in amp_backends.plugins() if p.name=='wrong'][0]; "
        "print(json.dumps([r.status, r.error, amp_backends.get('cpu').name]))",
        [root],
    )
    assert out[0] == "failed" and "takes an amp_backends.Backend instance, got str" in out[1] and out[2] == "cpu"


def test_import_and_get_cpu_import_no_optional_device_library():
    out = run_json(
        """
        import json, sys, amp_backends
        amp_backends.get("cpu")
        amp_backends.testing.grad_op_(amp_backends.get("cpu"), [], __import__("torch").zeros(()), __import__("torch").ones(()))
        print(json.dumps([m for m in ("triton", "torch_mlu") if m in sys.modules]))
        """
    )
    assert out == []


def test_info_lists_backends_reasons_and_failed_plugins(tmp_path, acme_plugin):
    broken = write_distribution(tmp_path / "x", "broken-amp", "broken_amp", "raise ValueError('bad build')\n",
                                {"broken": "broken_amp"})
    proc = run_python("from amp_backends.cli import main; main(['info'])", [acme_plugin, broken])
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert re.search(r"^cpu\s+yes\s", text, re.M) and "acme" in text and "acme-amp 1.0 (third-party)" in text
    assert "cuda" in text and "Why not available" in text
    assert "broken (broken-amp 1.0): failed: ValueError: bad build" in text
    assert "AMP_BACKENDS_DISABLE_PLUGINS=broken" in text
    proc = run_python("from amp_backends.cli import main; main(['info', '--json'])", [acme_plugin, broken])
    data = json.loads(proc.stdout)
    rows = {b["name"]: b for b in data["backends"]}
    assert rows["cpu"]["available"] and rows["cpu"]["kernel"] == "torch" and rows["cpu"]["dist_backend"] == "gloo"
    assert rows["acme"]["package"] == "acme-amp" and not rows["acme"]["builtin"]
    assert [p["status"] for p in data["plugins"] if p["name"] == "broken"] == ["failed"]


def test_python_dash_m_and_console_script():
    import shutil
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "amp_backends", "info", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0 and json.loads(proc.stdout)["best"] == amp_backends.available()[0]
    exe = shutil.which("amp-backends")
    assert exe is not None, "the console script is installed"
    proc = subprocess.run([exe, "info"], capture_output=True, text=True)
    assert proc.returncode == 0 and "backend" in proc.stdout


KERNEL_SOURCE = '''
import torch
import amp_backends

class Doubling(amp_backends.TorchKernel):
    """Counts its calls; runs torch's op underneath."""
    name = "counting"
    priority = 5
    calls = 0

    def auto_select(self, device_type):
        return device_type == "cpu"

    def grad_op_(self, group, found_inf, inv_scale=None, norm_sq=None):
        if inv_scale is not None:
            type(self).calls += 1
        super().grad_op_(group, found_inf, inv_scale, norm_sq)

class Clash(amp_backends.TorchKernel):
    name = "torch"

@amp_backends.hookimpl
def amp_backends_register_kernels(register):
    register(Doubling())
'''


def test_third_party_kernel_through_entry_point_is_selected_and_used(tmp_path):
    root = write_distribution(tmp_path / "k", "counting-kernel", "counting_kernel", KERNEL_SOURCE,
                              {"counting": "counting_kernel"})
    code = """
        import json, torch, amp_backends, counting_kernel
        be = amp_backends.get("cpu")
        name = be.kernel.name  # adopting it runs its self-check first
        checks = counting_kernel.Doubling.calls
        p = torch.nn.Parameter(torch.ones(3)); opt = torch.optim.SGD([p], lr=0.1)
        scaler = amp_backends.GradScaler(be)
        scaler.scale(p.sum()).backward(); scaler.step(opt); scaler.update()
        rec = [r for r in amp_backends.plugins() if r.name == "counting"][0]
        print(json.dumps({"kernel": name, "calls": counting_kernel.Doubling.calls - checks, "kernels": rec.kernels,
                          "self_checked": checks > 0 or name == "torch"}))
    """
    out = run_json(code, [root])
    assert out == {"kernel": "counting", "calls": 1, "kernels": ["counting"], "self_checked": True}
    forced = run_json(code, [root], {"AMP_BACKENDS_KERNEL": "torch"})
    assert forced["kernel"] == "torch" and forced["calls"] == 0


def test_kernel_name_clash_fails_only_that_plugin(tmp_path):
    source = KERNEL_SOURCE.replace("register(Doubling())", "register(Clash())")
    root = write_distribution(tmp_path / "c", "clash-kernel", "clash_kernel", source, {"clash": "clash_kernel"})
    out = run_json(
        "import json, amp_backends; r = [p for p in amp_backends.plugins() if p.name == 'clash'][0]; "
        "print(json.dumps([r.status, r.error, amp_backends.get('cpu').kernel.name]))",
        [root],
    )
    assert out[0] == "failed" and "kernel name 'torch' is already registered by amp-backends" in out[1]
    assert out[2] == "torch"


def test_submodules_load_on_first_use():
    out = run_json(
        """
        import json, sys, amp_backends
        before = [m for m in ("amp_backends.distributed", "amp_backends.checkpoint") if m in sys.modules]
        ok = callable(amp_backends.distributed.init_process_group) and callable(amp_backends.checkpoint.save)
        print(json.dumps([before, ok]))
        """
    )
    assert out == [[], True]
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        amp_backends.nope  # noqa: B018 - the attribute read is the test


@pytest.mark.parametrize(("env", "acme_loaded", "warned"), [
    ({"AMP_BACKENDS_DISABLE_PLUGINS": "acmee"}, True, "AMP_BACKENDS_DISABLE_PLUGINS names 'acmee', which no installed"),
    ({"AMP_BACKENDS_DISABLE_PLUGINS": "acme_amp"}, False, None),  # the import name is the distribution's
    ({"AMP_BACKENDS_DISABLE_PLUGINS": "ACME"}, False, None),
    ({"AMP_BACKENDS_PLUGINS": "acme,nosuch"}, True, "AMP_BACKENDS_PLUGINS names 'nosuch'"),
    ({"AMP_BACKENDS_PLUGINS": ""}, True, "AMP_BACKENDS_PLUGINS is set but empty and is ignored"),
    ({"AMP_BACKENDS_PLUGINS": " , "}, True, "AMP_BACKENDS_PLUGINS is set but empty and is ignored"),
], ids=["typo", "import-name", "case", "allow-unknown", "allow-empty", "allow-commas"])
def test_plugin_variables_that_name_nothing_are_said(acme_plugin, env, acme_loaded, warned):
    out = run_json(
        """
        import json, warnings, amp_backends
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            names = amp_backends.names()
        print(json.dumps({"names": names, "warnings": [str(w.message) for w in caught]}))
        """,
        [acme_plugin],
        env,
    )
    assert ("acme" in out["names"]) is acme_loaded and "cpu" in out["names"]
    if warned is None:
        assert out["warnings"] == []
    else:
        assert [w for w in out["warnings"] if warned in w], out["warnings"]
        if "names '" in warned:
            assert "plugins here: acme, cpu" in out["warnings"][0]
