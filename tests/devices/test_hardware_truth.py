"""Telling the truth about the hardware (native vs emulated dtypes, the warning, info, the
demo's and bench's advice) and a CLI whose checkpoints and inputs hold up."""

from __future__ import annotations

import io
import json
import os
import platform
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

import amp_backends
from amp_backends import PerformanceWarning, checkpoint, cli
from amp_backends.devices import contract as dtypes, hardware
from amp_backends.cli.bench import recommend
from amp_backends.console import ProgressBar, render_table

EMULATED = frozenset({"avx", "avx2", "fma3"})  # an AVX2-only x86 CPU (AMD Zen 3, older Intel)
NATIVE_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
x86_only = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 feature flags")


@pytest.fixture(autouse=True)
def _cpu_backend(monkeypatch):
    """These tests are about the CPU: the CLI's demo and bench run on it whatever else is here."""
    monkeypatch.setenv("AMP_BACKEND", "cpu")


@pytest.fixture
def fake_cpu(monkeypatch):
    """Fake this CPU's feature flags (what torch.cpu.get_capabilities would report)."""

    def use(features: frozenset[str]) -> None:
        monkeypatch.setattr(hardware, "cpu_features", lambda: features)
        monkeypatch.setattr(hardware, "_arch", lambda: "x86")
        # autocast() validates a dtype once per backend instance: the hardware does not change
        # under a running process, except here
        amp_backends.get("cpu").__dict__.pop("_autocast_dtypes", None)

    monkeypatch.setattr(dtypes, "_WARNED_EMULATED", set())
    return use


def test_native_dtypes_follow_the_cpu_flags(fake_cpu):
    be = amp_backends.get("cpu")
    fake_cpu(EMULATED)
    assert be.native_dtypes() == ()
    assert "AVX512_BF16 or AMX_BF16" in be.emulation_reason(torch.bfloat16)
    fake_cpu(NATIVE_BF16)
    assert be.native_dtypes() == (torch.bfloat16,)
    fake_cpu(NATIVE_BF16 | {"avx512_fp16"})
    assert be.native_dtypes() == (torch.bfloat16,), "AVX512-FP16 alone leaves torch's fp16 convolutions slow"
    fake_cpu(NATIVE_BF16 | {"amx_fp16"})
    assert be.native_dtypes() == (torch.bfloat16, torch.float16)
    assert hardware.cpu_native_dtypes(frozenset({"bf16"})) == ()  # an arm flag means nothing on x86


def test_emulated_autocast_warns_once_per_process_and_can_be_silenced(fake_cpu):
    be = amp_backends.get("cpu")
    fake_cpu(EMULATED)
    assert issubclass(PerformanceWarning, UserWarning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with be.autocast():
                pass
        with be.autocast(enabled=False):
            pass
    perf = [w for w in caught if issubclass(w.category, PerformanceWarning)]
    assert len(perf) == 1, "once per process, whatever the filter"
    text = str(perf[0].message)
    assert "bfloat16 autocast on cpu is emulated" in text and "lacks AVX512_BF16 or AMX_BF16" in text
    assert "slower than float32" in text and "halved" not in text, "no saving is claimed that the model at hand was not measured for"
    assert "--no-amp" in text and perf[0].filename == __file__, "points at the caller's line"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=PerformanceWarning)
        with be.autocast(torch.float16):
            pass
    assert not caught, "the standard filter silences it"


def test_native_autocast_does_not_warn(fake_cpu):
    fake_cpu(NATIVE_BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        with amp_backends.get("cpu").autocast(torch.bfloat16):
            pass


@pytest.mark.parametrize(("features", "native", "emulated"), [
    (EMULATED, [], ["bfloat16", "float16"]),
    (NATIVE_BF16, ["bfloat16"], ["float16"]),
])
def test_info_shows_native_and_emulated_dtypes(fake_cpu, capsys, features, native, emulated):
    fake_cpu(features)
    assert cli.main(["info", "--json"]) == 0
    row = {b["name"]: b for b in json.loads(capsys.readouterr().out)["backends"]}["cpu"]
    assert row["native_dtypes"] == native and sorted(row["emulated_dtypes"]) == emulated
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert ("Emulated (slower than float32 here):" in text) and "cpu float16: this CPU" in text
    assert ("cpu bfloat16: this CPU" in text) is ("bfloat16" in emulated)


@pytest.mark.parametrize(("features", "line"), [
    (EMULATED, "native dtypes      none; emulated: bfloat16, float16"),
    (NATIVE_BF16, "native dtypes      bfloat16; emulated: float16"),
])
def test_demo_says_what_is_native_and_measures_amp_against_fp32(fake_cpu, capsys, features, line):
    fake_cpu(features)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["demo", "--epochs", "1", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert line in out and "AMP vs fp32 here" in out
    assert "not measurable on this model" in out or "on this small model; amp-backends bench measures" in out
    assert "--no-amp trains faster" not in out and "slows this device down" not in out, "no advice from a toy"
    assert any(issubclass(w.category, PerformanceWarning) for w in caught) is (features == EMULATED)


def _info_in(env_vars: dict[str, str]) -> tuple[dict, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("AMP_BACKEND", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                                                             "ATEN_CPU_CAPABILITY")}
    proc = subprocess.run([sys.executable, "-m", "amp_backends", "info", "--json"], capture_output=True, text=True,
                          env={**env, **env_vars}, timeout=120)
    data = json.loads(proc.stdout)
    return data, {b["name"]: b for b in data["backends"]}["cpu"]


_MM_RATIO = """
import json, time, torch
torch.set_num_threads(1)
x = torch.randn(256, 256)
def best(t):
    t @ t
    runs = []
    for _ in range(5):
        start = time.perf_counter(); t @ t; runs.append(time.perf_counter() - start)
    return min(runs)
print(json.dumps(best(x.bfloat16()) / best(x)))
"""


@x86_only
@pytest.mark.parametrize("var", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
def test_onednn_capped_below_bf16_leaves_nothing_native_in_a_fresh_process(var):
    """torch's bf16 matmuls run in oneDNN: capped at AVX2 it emulates them on any x86 CPU (measured here:
    a 256x256 bf16 matmul at least 5x fp32's, 30-500x on the CPUs tried), and info says so."""
    data, cpu = _info_in({var: "avx2"})
    assert cpu["native_dtypes"] == [] and data["cpu"].endswith("oneDNN up to AVX2")
    proc = subprocess.run([sys.executable, "-c", _MM_RATIO], capture_output=True, text=True, timeout=120,
                          env={**os.environ, var: "AVX2"})
    assert json.loads(proc.stdout) > 5.0, "oneDNN capped at AVX2 emulates bf16 (slower than fp32 on any CPU)"


@x86_only
def test_torch_dispatch_capability_alone_does_not_change_what_is_native():
    """ATEN_CPU_CAPABILITY=avx2 moves ATen's own kernels, not oneDNN's: the native dtypes stay this CPU's."""
    _, default = _info_in({})
    data, capped = _info_in({"ATEN_CPU_CAPABILITY": "avx2"})
    assert data["cpu"].endswith("AVX2 kernels") and capped["native_dtypes"] == default["native_dtypes"]


def test_onednn_caps_remove_only_the_flags_above_them(monkeypatch):
    monkeypatch.setattr(hardware, "_arch", lambda: "x86")
    monkeypatch.setattr(hardware, "_proc_cpuinfo_flags", lambda: {"avx2", "avx512_bf16", "amx_bf16", "amx_fp16"})
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {}, raising=False)
    expect = {"AVX512_CORE": set(), "avx512_core_bf16": {"avx512_bf16"},
              "AVX10_1_512_AMX": {"avx512_bf16", "amx_bf16"}, "AVX512_CORE_AMX_FP16": {"avx512_bf16", "amx_bf16", "amx_fp16"},
              "ALL": {"avx512_bf16", "amx_bf16", "amx_fp16"}, "no-such-isa": {"avx512_bf16", "amx_bf16", "amx_fp16"}}
    for cap, kept in expect.items():
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        hardware.cpu_features.cache_clear()
        try:
            assert hardware.cpu_features() & {"avx512_bf16", "amx_bf16", "amx_fp16"} == kept, cap
        finally:
            hardware.cpu_features.cache_clear()


def test_onednn_off_makes_nothing_native_on_x86(monkeypatch):
    monkeypatch.setattr(hardware, "_arch", lambda: "x86")
    assert hardware.cpu_native_dtypes(NATIVE_BF16) == (torch.bfloat16,)
    monkeypatch.setattr(hardware, "_proc_cpuinfo_flags", lambda: set(NATIVE_BF16))
    with torch.backends.mkldnn.flags(enabled=False):
        assert hardware.cpu_native_dtypes(NATIVE_BF16) == ()
        assert hardware.cpu_summary().endswith("oneDNN off")
        assert "torch.backends.mkldnn.enabled" in amp_backends.get("cpu").emulation_reason(torch.bfloat16)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    hardware.cpu_features.cache_clear()
    try:
        assert "capped at AVX2" in amp_backends.get("cpu").emulation_reason(torch.bfloat16)
    finally:
        hardware.cpu_features.cache_clear()


def _row(model, mode, rounds, via=None):
    return {"model": model, "mode": mode, "via": via or ("full" if mode in ("fp32", "tf32") else "amp"),
            "step_ms": sorted(rounds)[len(rounds) // 2], "step_ms_rounds": rounds, "peak_mem_bytes": 100,
            "speedup_vs_fp32": 1.0, "mem_saving_pct": 10.0}


def test_bench_recommends_only_what_the_rounds_show():
    rows = [
        _row("a", "fp32", [10.0, 10.2, 9.9, 10.1]), _row("a", "amp-bfloat16", [7.0, 7.1, 6.9, 7.2]),
        _row("a", "torch-bfloat16", [5.0, 5.0, 5.0, 5.0], via="torch"),  # never recommended: the same math
        _row("b", "fp32", [10.0, 14.0, 9.0, 13.0]), _row("b", "amp-bfloat16", [9.8, 13.5, 10.0, 12.0]),
        _row("c", "fp32", [2.0, 2.1, 2.0, 2.2]), _row("c", "amp-bfloat16", [1.0, 1.0, 1.1, 1.0]),
    ]
    recs = {r["model"]: r for r in recommend(rows, {"a": {}, "b": {}, "c": {"host_bound": True}})}
    assert recs["a"]["fastest"] == "amp-bfloat16" and recs["a"]["clear"]
    assert recs["b"]["fastest"] == "amp-bfloat16" and not recs["b"]["clear"] and "no clear difference" in recs["b"]["why"]
    assert not recs["c"]["clear"] and "real-size model" in recs["c"]["why"], "a host-bound step gives no verdict"
    assert recs["a"]["mem_saving_pct"] == {"amp-bfloat16": 10.0}


@pytest.mark.parametrize(("low", "high", "expected"), [
    (1.05, 1.3, "faster"), (0.5, 0.9, "slower"), (0.9, 1.1, "no clear difference"), (1.0, 1.01, "no clear difference"),
])
def test_speed_verdict_needs_the_whole_range_on_one_side(low, high, expected):
    from amp_backends.cli.bench import verdict

    assert verdict(low, high) == expected


def test_bench_host_bound_model_gets_no_verdict(capsys):
    """A toy on a CPU whose fp32 step takes a few ms: every row says so, no recommendation is clear."""
    assert cli.main(["bench", "--models", "cnn", "--scale", "0.1", "--rounds", "3", "--warmup", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    fp32 = next(r["step_ms"] for r in data["rows"] if r["mode"] == "fp32")
    for r in data["rows"]:
        if r["step_ms"] is not None:
            assert (r["verdict"] == "host-bound: no verdict") is (max(r["step_ms"], fp32) < 10.0), r
    if data["models"]["cnn"]["host_bound"]:
        assert not data["recommendation"][0]["clear"]
    assert all(isinstance(r["native"], bool) for r in data["rows"])
    assert cli.main(["bench", "--models", "cnn", "--scale", "0.1", "--rounds", "1", "--warmup", "0"]) == 0
    text = capsys.readouterr().out
    assert "| model" in text and "| native" in text and "  cnn: " in text


# -- checkpoints --------------------------------------------------------------------------
def _demo_checkpoint(tmp_path, capsys) -> str:
    path = str(tmp_path / "demo.ckpt")
    assert cli.main(["demo", "--epochs", "1", "--checkpoint", path, "--json"]) == 0
    capsys.readouterr()
    return path


def test_a_flipped_bit_is_refused_naming_the_file(tmp_path, capsys):
    path = _demo_checkpoint(tmp_path, capsys)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10  # inside the tensor data
    open(path, "wb").write(bytes(data))
    assert cli.main(["demo", "--epochs", "2", "--resume", path]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{path} is corrupt" in err


@pytest.mark.parametrize(("field", "value", "message"), [
    ("epoch", "abc", "field 'epoch' must be a whole number >= 1, got str 'abc'"),
    ("epoch", True, "field 'epoch' must be a whole number >= 1, got bool True"),
    ("epoch", 0, "field 'epoch' must be a whole number >= 1"),
    ("history", 5, "field 'history' must be a list of numbers, got int"),
    ("history", [0.5, 0.4], "field 'history' has 2 losses for 1 epochs"),
    ("config", [1, 2], "field 'config' must be a dict of options, got list"),
    ("model", "weights", "field 'model' must be a state_dict (a dict), got str"),
    ("scaler", None, "field 'scaler' must be a state_dict (a dict), got NoneType"),
])
def test_crafted_fields_are_refused_in_one_line(tmp_path, capsys, field, value, message):
    path = _demo_checkpoint(tmp_path, capsys)
    state = checkpoint.load(path, "demo-digits-cnn")
    state[field] = value
    checkpoint.save(path, {k: v for k, v in state.items() if k not in ("format", "version", "kind")}, "demo-digits-cnn")
    assert cli.main(["demo", "--epochs", "2", "--resume", path]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0


def test_a_save_killed_mid_write_leaves_a_temp_file_the_next_save_removes(tmp_path):
    target = tmp_path / "c.ckpt"
    script = (
        "import os, signal, sys, torch\n"
        "from amp_backends import checkpoint\n"
        "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # die after writing, before the rename\n"
        f"checkpoint.save({str(target)!r}, {{'x': torch.ones(1000)}}, 't')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    stale = list(tmp_path.glob(".c.ckpt.*.tmp"))
    assert len(stale) == 1 and not target.exists()
    checkpoint.save(target, {"x": torch.zeros(2)}, "t")
    assert [p.name for p in tmp_path.iterdir()] == ["c.ckpt"]
    assert torch.equal(checkpoint.load(target, "t")["x"], torch.zeros(2))


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_checkpoint_mode_follows_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = checkpoint.save(tmp_path / "m.ckpt", {"x": torch.ones(1)}, "t")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == mode


@pytest.mark.parametrize("where", ["directory", "under-a-file", "unwritable"])
def test_a_bad_checkpoint_destination_fails_before_training(tmp_path, capsys, where):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    dest = {"directory": str(tmp_path), "under-a-file": str(blocker / "c.ckpt"), "unwritable": "/proc/amp/c.ckpt"}[where]
    start = time.perf_counter()
    assert cli.main(["demo", "--checkpoint", dest]) == 2
    captured = capsys.readouterr()
    assert time.perf_counter() - start < 60 and "epoch=" not in captured.err, "no training was spent"
    expected = {"directory": "is a directory", "under-a-file": "is a file, not a directory", "unwritable": "cannot write"}
    assert expected[where] in captured.err and captured.err.count("\n") == 1


# -- other bad CLI input ------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "--scale", "inf"], "--scale must be in (0, 8], got inf"),
    (["bench", "--scale", "0"], "--scale must be in (0, 8]"),
    (["bench", "--rounds", "0"], "--rounds must be >= 1"),
    (["bench", "--plot", "/nonexistent/x.png"], "--plot: the folder '/nonexistent' does not exist"),
    (["bench", "--plot", "x.txt"], "--plot 'x.txt': matplotlib writes .png"),
    (["bench", "--list", "--models", "bogus"], "--models: unknown model 'bogus'; choose from resnet50"),
    (["bench", "--models", "mlp,,bogus2"], "unknown model 'bogus2'"),
])
def test_bad_bench_input_is_refused_before_any_work(capsys, argv, message):
    start = time.perf_counter()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert time.perf_counter() - start < 60, "refused before any work (a bench run takes minutes)"


def test_bench_list_as_json():
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["bench", "--list", "--json", "--models", "mlp,cnn"]) == 0
    listed = json.loads(out.getvalue())
    assert {entry["model"] for entry in listed} >= {"mlp", "cnn"}


def test_amp_backend_naming_no_backend_is_said_by_info(monkeypatch, capsys):
    monkeypatch.setenv("AMP_BACKEND", "bogus")
    assert cli.main(["info"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("error: AMP_BACKEND='bogus' cannot be used: unknown backend 'bogus'")
    assert "Known backends: cpu" in out
    assert cli.main(["info", "--json"]) == 1
    assert "bogus" in json.loads(capsys.readouterr().out)["env_error"]


# -- console ------------------------------------------------------------------------------
def test_progress_is_plain_lines_off_a_terminal():
    stream = io.StringIO()
    bar = ProgressBar(10, stream=stream)
    calls = []
    for i in range(10):
        bar.update(i + 1, lambda: calls.append(1) or {"x": 1})
    bar.line(lambda: {"epoch": "1/1", "loss": "0.5"})
    bar.close()
    assert stream.getvalue() == "epoch=1/1 loss=0.5\n" and calls == [], "fields read only when shown"


def test_tables_render_aligned_or_as_markdown():
    text = render_table(["name", "n"], [["a", "1"], ["bbb", "22"]], right=(1,))
    lines = text.splitlines()
    assert lines[0].split() == ["name", "n"] and lines[-1].split() == ["bbb", "22"] and "\x1b" not in text
    md = render_table(["name", "n"], [["a", "1"]], markdown=True)
    assert md.splitlines()[0].startswith("| name") and md.splitlines()[1].startswith("|--")


@pytest.mark.parametrize(("extra", "shown"), [
    ({"host_bound": True, "amp_verdict": "not measurable", "amp_step_ms": 2.0},
     "not measurable on this model: a step takes 3.0 ms in fp32, 2.0 ms with AMP"),
    ({"host_bound": False, "amp_verdict": "slower", "amp_speedup_iqr": [0.5, 0.8]},
     "0.70x [0.50-0.80 over rounds] (slower on this small model"),
    ({"host_bound": False, "amp_verdict": "no clear difference", "amp_speedup_iqr": [0.31, 1.16]},
     "0.70x [0.31-1.16 over rounds] (no clear difference on this small model"),
])
def test_demo_speed_line_says_what_the_measurement_can_show(extra, shown):
    from amp_backends.cli.demo import format_summary

    result = {"scaler": {"enabled": False, "scale": 1.0, "steps": 1, "skipped": 0, "overflows": 0},
              "native_dtypes": ["bfloat16"], "emulated_dtypes": [], "backend": "cpu", "device": "cpu", "amp": True,
              "dtype": "bfloat16", "test_accuracy": 0.9, "samples_per_second": 1.0, "peak_memory_bytes": 0,
              "peak_memory_kind": "saved tensors", "train_loss": [0.1], "amp_speedup": 0.7,
              "amp_speedup_iqr": [0.6, 0.8], "fp32_step_ms": 3.0, **extra}
    out = format_summary(result)
    assert shown in out
    assert "--no-amp trains faster" not in out and "slows this device down" not in out

def test_concurrent_writers_of_one_checkpoint_never_fail(tmp_path):
    """Three processes saving to one path 20 times each: every save succeeds (none deletes
    another's temporary file), and the file left is one whole checkpoint."""
    target = tmp_path / "shared.ckpt"
    script = (
        "import sys, torch\n"
        "from amp_backends import checkpoint\n"
        "for i in range(20):\n"
        f"    checkpoint.save({str(target)!r}, {{'x': torch.full((20000,), float(sys.argv[1]))}}, 't')\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(w)], stderr=subprocess.PIPE, text=True) for w in range(3)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    x = checkpoint.load(target, "t")["x"]
    assert x.shape == (20000,) and float(x[0]) in (0.0, 1.0, 2.0) and bool((x == x[0]).all())
    assert not list(tmp_path.glob(".shared.ckpt.*.tmp"))


def test_a_live_writers_temporary_file_is_left_alone(tmp_path):
    target = tmp_path / "c.ckpt"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        live = tmp_path / f".c.ckpt.{checkpoint.io._HOST}.{other.pid}.abc.tmp"
        live.write_bytes(b"in progress")
        foreign = tmp_path / ".c.ckpt.otherhost.1.abc.tmp"
        foreign.write_bytes(b"another machine's")
        checkpoint.save(target, {"x": torch.ones(2)}, "t")
        assert live.exists() and foreign.exists(), "not provably abandoned: kept"
    finally:
        other.kill()
        other.wait()
    checkpoint.save(target, {"x": torch.ones(2)}, "t")
    assert not live.exists() and foreign.exists(), "its writer is gone now: removed"


@pytest.mark.parametrize("key", ["kind", "format", "version"])
def test_state_keys_cannot_override_the_checkpoints_metadata(tmp_path, key):
    target = tmp_path / "c.ckpt"
    with pytest.raises(checkpoint.CheckpointError, match=f"uses '{key}'"):
        checkpoint.save(target, {key: "x", "w": torch.ones(1)}, "t")
    assert not target.exists() and not list(tmp_path.iterdir())


def test_saving_through_a_symlink_writes_its_target(tmp_path):
    real = tmp_path / "store" / "real.ckpt"
    real.parent.mkdir()
    link = tmp_path / "latest.ckpt"
    link.symlink_to(real)
    checkpoint.save(link, {"x": torch.ones(3)}, "t")
    assert link.is_symlink() and real.is_file()
    assert torch.equal(checkpoint.load(link, "t")["x"], torch.ones(3))
