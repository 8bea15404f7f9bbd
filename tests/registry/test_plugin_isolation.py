"""Faulty third-party plugins, installed as real distributions: Ctrl-C and exit propagate, built-in
backends and their kernels cannot be silently taken or replaced, availability probes are bounded."""

from __future__ import annotations

import json
import signal
import time

import pytest

from conftest import ACME_SOURCE, cpu_only_env, run_json, run_python, write_distribution

# Each test installs plugin distributions and runs fresh processes: pluggy and entry points, not torch.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("where", ["import", "hook"])
def test_ctrl_c_in_a_plugin_propagates_and_the_registry_loads_afresh_after(tmp_path, where):
    if where == "import":
        source = "raise KeyboardInterrupt\n" + ACME_SOURCE
    else:
        source = ACME_SOURCE.replace("register(AcmeBackend())", "raise KeyboardInterrupt")
    root = write_distribution(tmp_path / "p", "rude-amp", "rude_amp", source, {"rude": "rude_amp"})
    proc = run_python("import amp_backends; amp_backends.names(); print('carried on')", [root])
    assert proc.returncode == -signal.SIGINT and "carried on" not in proc.stdout
    assert "KeyboardInterrupt" in proc.stderr
    # caught by the caller, the interrupted load is not kept: the next call loads again
    out = run_json("""
    import json, amp_backends
    try:
        amp_backends.names()
    except KeyboardInterrupt:
        pass
    try:
        amp_backends.names()
    except KeyboardInterrupt:
        pass
    print(json.dumps(amp_backends.registry.default_registry()._loaded))
    """, [root])
    assert out is False, "an interrupted load leaves nothing half-loaded behind"


@pytest.mark.parametrize(("where", "code"), [("import", 0), ("import", 7), ("hook", 0)])
def test_a_plugin_calling_sys_exit_is_a_failed_plugin_not_an_exit(tmp_path, where, code):
    """`amp-backends info` and the demo must not exit silently because a plugin called sys.exit."""
    if where == "import":
        source = f"import sys; sys.exit({code})\n" + ACME_SOURCE
    else:
        source = ACME_SOURCE.replace("register(AcmeBackend())", f"import sys; sys.exit({code})")
    root = write_distribution(tmp_path / "p", "rude-amp", "rude_amp", source, {"rude": "rude_amp"})
    proc = run_python("from amp_backends import cli; raise SystemExit(cli.main(['info', '-v']))", [root],
                      cpu_only_env())
    assert proc.returncode == 0 and "best available backend: cpu" in proc.stdout
    assert f"called sys.exit({code})" in proc.stdout
    js = run_python("from amp_backends import cli; raise SystemExit(cli.main(['info', '--json']))", [root])
    assert js.returncode == 0 and '"rude"' in js.stdout


def _cpu_clone(tmp_path, override: bool):
    source = ACME_SOURCE.replace('name = "acme"', 'name = "cpu"')
    if override:
        source = source.replace("register(AcmeBackend())", "register(AcmeBackend(), override=True)")
    return write_distribution(tmp_path / "c", "fastcpu-amp", "fastcpu_amp", source, {"fastcpu": "fastcpu_amp"})


SHOW = """
import json, warnings, amp_backends
from amp_backends import cli
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    chosen = type(amp_backends.get("cpu")).__name__
    auto = type(amp_backends.get()).__name__
import io, contextlib
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    cli.main(["info"])
print(json.dumps({"chosen": chosen, "auto": auto, "warnings": [str(w.message) for w in caught],
                  "info": buf.getvalue()}))
"""


def test_a_plugin_cannot_take_a_builtin_name_without_override(tmp_path):
    out = run_json(SHOW, [_cpu_clone(tmp_path, override=False)], cpu_only_env())
    assert out["chosen"] == out["auto"] == "CPUBackend", "the built-in stays"
    assert len(out["warnings"]) == 1, "said once, where the user meets it"
    said = out["warnings"][0]
    assert "'fastcpu' from fastcpu-amp 1.0 also registers a backend named 'cpu'" in said
    assert "AMP_BACKENDS_DISABLE_PLUGINS=fastcpu" in said
    assert "also registers a backend named 'cpu'" in out["info"]


def test_an_override_of_a_builtin_is_named_wherever_it_takes_effect(tmp_path):
    out = run_json(SHOW, [_cpu_clone(tmp_path, override=True)], cpu_only_env())
    assert out["chosen"] == out["auto"] == "AcmeBackend"
    assert any("overrides the built-in 'cpu' backend" in w for w in out["warnings"])
    assert "overrides the built-in 'cpu' backend" in out["info"]
    demo = run_python("from amp_backends import cli; cli.main(['demo', '--epochs', '1'])",
                      [_cpu_clone(tmp_path / "d", override=True)], cpu_only_env())
    assert "overrides the built-in 'cpu' backend" in demo.stderr


KERNEL_SOURCE = '''
import torch
import amp_backends
from amp_backends.gradients.kernel import add_sum_of_squares


def ok(grads, found_inf, inv_scale):  # torch's op, as a kernel should run it
    torch._amp_foreach_non_finite_check_and_unscale_(list(grads), found_inf, inv_scale)


class Kernel(amp_backends.TorchKernel):
    name = "fast"
    priority = 100

    def auto_select(self, device_type):
        return True

    def grad_op_(self, group, found_inf, inv_scale=None, norm_sq=None):
        if inv_scale is None:
            return super().grad_op_(group, found_inf, inv_scale, norm_sq)
        self.unscale(group, [group.buffer] if hasattr(group, "buffer") else list(group.tensors), found_inf, inv_scale)
        if norm_sq is not None:
            add_sum_of_squares(group.gradients(), norm_sq)

    def unscale(self, group, grads, found_inf, inv_scale):
        BODY

@amp_backends.hookimpl
def amp_backends_register_kernels(register):
    register(Kernel())
'''

STEP = """
import json, math, warnings, torch, amp_backends
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    be = amp_backends.get("cpu")
    kernel = be.kernel.name
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = amp_backends.GradScaler(be, init_scale=4.0)
scaler.scale(model(torch.ones(1, 4)).sum()).backward()
model.weight.grad[0, 0] = math.inf
before = model.weight.detach().clone()
scaler.step(opt)
print(json.dumps({"kernel": kernel, "skipped": scaler.last_step_skipped,
                  "unchanged": bool(torch.equal(before, model.weight)),
                  "warnings": [str(w.message) for w in caught]}))
"""


@pytest.mark.parametrize(("body", "adopted", "problem"), [
    ("ok(grads, found_inf, inv_scale)", True, None),
    ("raise RuntimeError('kernel crashed')", False, "raised RuntimeError: kernel crashed"),
    ("torch._foreach_mul_(list(grads), inv_scale)", False, "missed an inf/NaN in torch.float32 gradients"),
    ("ok(grads, found_inf, inv_scale * 1.0001)", False, "values differ from torch's"),
    # cheats the small checks alone would not catch: blind past 64 elements, in bf16, or on an arena buffer
    ("ok([g[:64] for g in grads], found_inf, inv_scale)\n"
     "        tails = [g[64:] for g in grads if g.numel() > 64]\n"
     "        if tails:\n"
     "            torch._foreach_mul_(tails, inv_scale)",
     False, "missed an inf/NaN at element 8194 of a float32 gradient"),
    ("if grads and grads[0].dtype == torch.bfloat16:\n"
     "            return torch._foreach_mul_(list(grads), inv_scale)\n"
     "        ok(grads, found_inf, inv_scale)",
     False, "missed an inf/NaN at element 8194 of a bfloat16 gradient"),
    ("if hasattr(group, 'buffer'):\n"
     "            return torch._foreach_mul_([group.buffer], inv_scale)\n"
     "        ok(grads, found_inf, inv_scale)",
     False, "its op missed an inf/NaN in a float32 arena buffer"),
])
def test_a_third_party_kernel_must_pass_a_self_check_before_builtins_adopt_it(tmp_path, body, adopted, problem):
    root = write_distribution(tmp_path / "k", "fastk-amp", "fastk_amp", KERNEL_SOURCE.replace("BODY", body),
                              {"fastk": "fastk_amp"})
    out = run_json(STEP, [root])
    assert out["kernel"] == ("fast" if adopted else "torch")
    assert out["skipped"] and out["unchanged"], "an inf gradient never reaches the weights"
    if problem:
        assert any(problem in w and "fastk-amp" in w for w in out["warnings"]), out["warnings"]
        info = run_python("from amp_backends import cli; cli.main(['info'])", [root])
        assert "failed its self-check" in info.stdout


PROBE_SOURCE = '''
import time, torch, amp_backends

class Odd(amp_backends.Backend):
    name = "NAME"
    device_type = "cpu"
    priority = 1000

    def is_available(self):
        BODY

@amp_backends.hookimpl
def amp_backends_register_backends(register):
    register(Odd())
'''


def test_a_hanging_probe_is_bounded_and_asked_once(tmp_path):
    source = PROBE_SOURCE.replace("NAME", "hang").replace("BODY", "time.sleep(60); return True")
    root = write_distribution(tmp_path / "h", "hang-amp", "hang_amp", source, {"hang": "hang_amp"})
    code = """
    import json, time, amp_backends
    from amp_backends import cli
    t = time.perf_counter()
    best = amp_backends.get().name
    try:
        amp_backends.get("hang")
    except amp_backends.BackendUnavailableError as e:
        err = str(e)
    cli.main(["info"])
    print(json.dumps({"best": best, "err": err, "seconds": time.perf_counter() - t}))
    """
    start = time.perf_counter()
    out = run_json(code, [root], {"AMP_BACKENDS_PROBE_TIMEOUT": "1", **cpu_only_env()})
    assert out["best"] == "cpu" and "did not return within 1 s" in out["err"]
    assert out["seconds"] < 10 and time.perf_counter() - start < 60, "one wait of 1 s, not one per question"


def _probe(tmp_path, name: str, body: str, then: str, env: dict | None = None) -> dict:
    """Install a plugin whose backend ``name`` answers is_available() with ``body``, ask for it in a
    fresh interpreter, and return what ``then`` (a json.dumps expression over ``err``) prints."""
    source = PROBE_SOURCE.replace("NAME", name).replace("BODY", body)
    root = write_distribution(tmp_path / name, f"{name}-amp", f"{name}_amp", source, {name: f"{name}_amp"})
    return run_json(f"""
    import json, amp_backends
    try:
        amp_backends.get({name!r})
    except amp_backends.BackendUnavailableError as e:
        err = str(e)
    print(json.dumps({then}))
    """, [root], env)


def test_a_probe_must_answer_a_bool(tmp_path):
    out = _probe(tmp_path, "vague", "return 'no'", '{"best": amp_backends.get().name, "err": err}', cpu_only_env())
    assert out["best"] == "cpu" and "is_available() returned str 'no', not True or False" in out["err"]


def test_a_forced_kernel_that_raises_is_refused_clearly(tmp_path):
    root = write_distribution(tmp_path / "f", "fastk-amp", "fastk_amp",
                              KERNEL_SOURCE.replace("BODY", "raise RuntimeError('kernel crashed')"), {"fastk": "fastk_amp"})
    out = run_json("""
    import json, amp_backends
    try:
        amp_backends.get("cpu").kernel
        err = ""
    except amp_backends.BackendUnavailableError as e:
        err = str(e)
    print(json.dumps(err))
    """, [root], {"AMP_BACKENDS_KERNEL": "fast"})
    assert "AMP_BACKENDS_KERNEL='fast' cannot run on 'cpu': it failed its self-check (raised RuntimeError: kernel crashed)" in out


def test_conformance_suite_skips_with_the_reason_when_the_probe_raises(tmp_path):
    """README's 15-line backend installed on a machine without the device: ``torch.acme`` does not
    exist, ``is_available()`` raises; every check skips, saying why, instead of erroring."""
    source = PROBE_SOURCE.replace("NAME", "acmedev").replace("BODY", "return torch.acme.is_available()")
    root = write_distribution(tmp_path / "a", "acmedev-amp", "acmedev_amp", source, {"acmedev": "acmedev_amp"})
    proc = run_python(
        "import sys, pytest; sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', '--pyargs', "
        "'amp_backends.testing', '--amp-backend', 'acmedev']))",
        [root],
    )
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "error" not in proc.stdout.splitlines()[-1] and " skipped" in proc.stdout.splitlines()[-1]
    assert "is_available() raised AttributeError" in proc.stdout


BAD_FIELD_SOURCE = '''
import torch, amp_backends

class Bad(amp_backends.Backend):
    name = NAME
    device_type = "cpu"
    FIELD

    def is_available(self):
        return True

@amp_backends.hookimpl
def amp_backends_register_backends(register):
    register(Bad())
'''


@pytest.mark.parametrize(("name", "field", "said"), [
    ('"badprio"', 'priority = "high"', "priority must be an int"),
    ('"auto"', "priority = 500", "is reserved"),
    ('" acme "', "priority = 500", "must be a non-empty string without spaces"),
    ('"strdtype"', 'default_dtype = "float16"', "default_dtype must be torch.float16 or torch.bfloat16"),
    ('"fp64dtype"', "default_dtype = torch.float64", "default_dtype must be torch.float16 or torch.bfloat16"),
    ('"acmex"', "priority = 500\n    device_type = 'acmex'", "is not a device type torch knows"),
    ('"boolprobe"', "priority = 500\n    def unavailable_reason(self):\n        return True", "not a bool"),
    ('"defnotsup"', "priority = 500\n    default_dtype = torch.float16\n    def supported_dtypes(self):\n"
                    "        return (torch.bfloat16,)", "the default must be one of them"),
    ('"builtfor"', "built_for_torch = (2, 4)", "built_for_torch must be"),
    ('"fusedtypo"', "fused_found_inf = {'Adam': 'honours'}", "neither a kind"),
    ('"fusedstatus"', "fused_found_inf = {'sgd': 'honors'}", "status is one of"),
    ('"baddtypes"', "priority = 500\n    def supported_dtypes(self):\n        raise RuntimeError('driver gone')",
     "supported_dtypes() raised RuntimeError: driver gone"),
])
def test_a_backend_with_bad_fields_is_never_chosen_and_is_named(tmp_path, name, field, said):
    """Installed as a real entry-point plugin: get() still gives the best good backend, the usual loop
    trains on it, and info names what is wrong with the bad one."""
    source = BAD_FIELD_SOURCE.replace("NAME", name).replace("FIELD", field)
    root = write_distribution(tmp_path / "b", "bad-amp", "bad_amp", source, {"bad": "bad_amp"})
    out = run_json("""
    import json, io, contextlib, torch, amp_backends
    from amp_backends import cli
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["info"])
    be = amp_backends.get()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = be.grad_scaler()
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        with be.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
        losses.append(loss.item())
    print(json.dumps({"best": be.name, "info": buf.getvalue(), "rc": rc, "losses": losses}))
    """, [root], cpu_only_env())
    assert out["best"] == "cpu" and out["rc"] == 0
    assert said in out["info"], out["info"]
    assert out["losses"][-1] < out["losses"][0], "the best good backend trains"


def test_a_plugin_printing_while_it_loads_keeps_info_json_parseable(tmp_path):
    source = "print('hello from a chatty plugin')\n" + ACME_SOURCE.replace(
        "register(AcmeBackend())", "print('registering'); register(AcmeBackend())")
    root = write_distribution(tmp_path / "p", "chatty-amp", "chatty_amp", source, {"chatty": "chatty_amp"})
    proc = run_python("from amp_backends import cli; raise SystemExit(cli.main(['info', '--json']))", [root])
    assert proc.returncode == 0
    data = json.loads(proc.stdout)
    assert "acme" in [b["name"] for b in data["backends"]]
    assert "hello from a chatty plugin" in proc.stderr and "registering" in proc.stderr


def test_an_unavailable_backend_is_asked_once_per_probe(tmp_path):
    """A slow is_available() that answers False costs its time once per question, not twice."""
    out = _probe(tmp_path, "slowno", "type(self).calls = getattr(type(self), 'calls', 0) + 1; return False",
                 '{"err": err, "calls": [type(b).calls for b, _ in amp_backends.registry.default_registry().backends()'
                 ' if b.name == "slowno"][0]}')
    assert out["calls"] == 1 and "is_available() returned False" in out["err"]


def test_availability_is_cached_per_process_and_reprobe_asks_again(tmp_path):
    """A slow answer costs its time once per process, not on every get(); reprobe() asks again."""
    body = "time.sleep(0.5); type(self).calls = getattr(type(self), 'calls', 0) + 1; return False"
    source = PROBE_SOURCE.replace("NAME", "slowcount").replace("BODY", body)
    root = write_distribution(tmp_path / "sc", "slowcount-amp", "slowcount_amp", source, {"slowcount": "slowcount_amp"})
    out = run_json("""
    import json, amp_backends
    def calls():
        return [type(b).calls for b, _ in amp_backends.registry.default_registry().backends() if b.name == "slowcount"][0]
    amp_backends.get(); amp_backends.get(); amp_backends.available()
    try:
        amp_backends.get("slowcount")
    except amp_backends.BackendUnavailableError:
        pass
    first = calls()
    amp_backends.reprobe()
    amp_backends.available()
    print(json.dumps({"first": first, "again": calls()}))
    """, [root], cpu_only_env())
    assert out["first"] == 1, "get(), get(), available() and get(name): one question"
    assert out["again"] == 2, "reprobe() forgets the answer"


HOOK_HANG = ACME_SOURCE.replace("    register(AcmeBackend())", "    import time; time.sleep(60); register(AcmeBackend())")


def test_a_hanging_register_hook_is_bounded_and_the_others_load(tmp_path):
    root = write_distribution(tmp_path / "hh", "hookhang-amp", "hookhang_amp", HOOK_HANG, {"hookhang": "hookhang_amp"})
    code = """
    import json, time, amp_backends
    t = time.perf_counter()
    best = amp_backends.get("cpu").name
    seconds = time.perf_counter() - t
    rec = [p for p in amp_backends.plugins() if p.name == "hookhang"][0]
    print(json.dumps({"best": best, "seconds": seconds, "status": rec.status, "error": rec.error,
                      "names": amp_backends.names()}))
    """
    start = time.perf_counter()
    out = run_json(code, [root], {"AMP_BACKENDS_PROBE_TIMEOUT": "1", **cpu_only_env()})
    assert out["best"] == "cpu" and out["seconds"] < 10 and time.perf_counter() - start < 60
    assert out["status"] == "failed" and "did not return within 1 s" in out["error"]
    assert "acme" not in out["names"], "what a timed-out hook registers late is ignored"


KERNEL_HANG = '''
import time, torch, amp_backends

class Slow(amp_backends.Kernel):
    name = "slowkernel"
    priority = 1000

    def auto_select(self, device_type):
        return device_type == "cpu"

    def grad_op_(self, group, found_inf, inv_scale=None, norm_sq=None):
        time.sleep(60)

@amp_backends.hookimpl
def amp_backends_register_kernels(register):
    register(Slow())
'''


def test_a_kernel_whose_ops_hang_is_rejected_in_bounded_time(tmp_path):
    root = write_distribution(tmp_path / "kh", "kernelhang-amp", "kernelhang_amp", KERNEL_HANG, {"kh": "kernelhang_amp"})
    code = """
    import json, time, warnings, amp_backends
    t = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel = amp_backends.get("cpu").kernel.name
    print(json.dumps({"kernel": kernel, "seconds": time.perf_counter() - t,
                      "warnings": [str(w.message) for w in caught]}))
    """
    out = run_json(code, [root], {"AMP_BACKENDS_PROBE_TIMEOUT": "1", **cpu_only_env()})
    assert out["kernel"] == "torch" and out["seconds"] < 10
    assert any("slowkernel" in w and "did not finish within 1 s" in w for w in out["warnings"])
