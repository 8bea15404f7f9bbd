"""`amp-backends demo` and `amp-backends bench` end to end, and atomic checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from amp_backends import checkpoint
from amp_backends.memory.recompute import unavailable_reason as recompute_unavailable_reason


def cli(*args: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("AMP_BACKEND")}
    full["AMP_BACKEND"] = "cpu"  # what these tests check is the CPU's behaviour, whatever else the machine has
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "amp_backends", *args], capture_output=True, text=True,
                          timeout=timeout, env=full)


@pytest.fixture
def command(monkeypatch, capsys):
    """The command's entry point in this process, as `cli` sets it up: ``run(*args)`` gives its exit
    status and what it wrote to stderr."""
    from amp_backends.cli.main import main

    for name in [k for k in os.environ if k.startswith("AMP_BACKEND")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AMP_BACKEND", "cpu")
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # main() sets the package's own

    def run(*args: str) -> tuple[int, str]:
        try:
            status = main(list(args))
        except SystemExit as exc:  # argparse's own refusals exit
            status = exc.code
        return status, capsys.readouterr().err

    return run


@pytest.mark.slow
def test_demo_default_reaches_digit_accuracy():
    proc = cli("demo", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["backend"] == "cpu" and out["dtype"] == "bfloat16" and out["amp"] is True
    assert out["test_accuracy"] >= 0.93
    assert out["train_loss"][-1] < out["train_loss"][0] / 10
    assert out["samples_per_second"] > 0 and out["peak_memory_bytes"] > 0
    assert out["scaler"]["enabled"] is False and out["scaler"]["steps"] == 8 * 23
    assert out["amp_speedup"] > 0 and set(out["native_dtypes"]) | set(out["emulated_dtypes"]) == {"bfloat16", "float16"}
    low, high = out["amp_speedup_iqr"]
    assert low <= out["amp_speedup"] <= high and out["fp32_step_ms"] > 0
    assert out["amp_verdict"] == ("not measurable" if out["host_bound"] else
                                  "faster" if low > 1.02 else "slower" if high < 0.98 else "no clear difference")


@pytest.mark.slow
def test_demo_fp16_uses_the_scaler_and_shows_progress():
    proc = cli("demo", "--dtype", "float16", "--epochs", "2")
    assert proc.returncode == 0, proc.stderr
    assert "epoch=2/2" in proc.stderr and "loss=" in proc.stderr and "scale=" in proc.stderr and "skipped=" in proc.stderr
    assert "test accuracy" in proc.stdout and "AMP float16" in proc.stdout
    assert "scaler             enabled: scale" in proc.stdout


@pytest.mark.slow
def test_demo_without_amp():
    out = json.loads(cli("demo", "--no-amp", "--epochs", "2", "--json").stdout)
    assert out["amp"] is False and out["dtype"] == "float32" and out["test_accuracy"] > 0.8


@pytest.mark.slow
def test_resume_is_bitwise_identical_to_an_uninterrupted_run(tmp_path):
    full, part, resumed = tmp_path / "full.ckpt", tmp_path / "part.ckpt", tmp_path / "resumed.ckpt"
    a = cli("demo", "--epochs", "3", "--dtype", "float16", "--checkpoint", str(full), "--json")
    b = cli("demo", "--epochs", "1", "--dtype", "float16", "--checkpoint", str(part), "--json")
    c = cli("demo", "--epochs", "3", "--dtype", "float16", "--resume", str(part), "--checkpoint", str(resumed), "--json")
    for proc in (a, b, c):
        assert proc.returncode == 0, proc.stderr
    x, y = json.loads(a.stdout), json.loads(c.stdout)
    assert y["resumed_from_epoch"] == 1
    assert x["train_loss"] == y["train_loss"] and x["test_accuracy"] == y["test_accuracy"]
    s1 = checkpoint.load(full, "demo-digits-cnn")
    s2 = checkpoint.load(resumed, "demo-digits-cnn")
    for key in s1["model"]:
        assert torch.equal(s1["model"][key], s2["model"][key]), key
    assert s1["scaler"] == s2["scaler"] and s1["epoch"] == s2["epoch"] == 3
    assert not list(tmp_path.glob(".*.tmp")), "no temporary files left behind"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "nope"], "unknown backend 'nope'"),
        (["--backend", "cdu"], "Known backends: cpu, cuda"),
        (["--dtype", "float64"], "does not support autocast dtype float64"),
        (["--dtype", "fp8x"], "is not a torch dtype"),
        (["--epochs", "0"], "--epochs must be between 1 and 10000"),
        (["--batch-size", "0"], "--batch-size must be between 1 and 1000000"),
        (["--seed", str(2**70)], "--seed must be between 0 and 2**32-1"),
        (["--seed", "-1"], "--seed must be between 0 and 2**32-1"),
        (["--lr", "1e300"], "--lr must be a number in (0, 10]"),
        (["--lr", "nan"], "--lr must be a number in (0, 10]"),
        (["--epochs", "two"], "argument --epochs: invalid int value: 'two'"),
        (["--resume", ""], "--resume needs the path of a checkpoint"),
        (["--checkpoint", ""], "the checkpoint path is empty"),
    ],
)
def test_bad_arguments_get_one_line_errors(args, message, command):
    """Through the command's entry point in this process (test_bad_checkpoints_... and the test below run
    the whole command in a process of its own): exit status 2 and one line, nothing raised."""
    status, err = command("demo", *args)
    assert status == 2, err
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert "dtype=None" not in err, "the command's words, not the Python API's"
    if args[0] == "--dtype":
        assert f"--dtype {args[1]}:" in err and "leave --dtype out" in err


def test_amp_backend_variable_is_named_when_it_cannot_be_used():
    proc = cli("demo", "--epochs", "1", env={"AMP_BACKEND": "nosuch"})
    assert proc.returncode == 2 and "AMP_BACKEND='nosuch' cannot be used: unknown backend 'nosuch'" in proc.stderr
    assert "Unset AMP_BACKEND" in proc.stderr


def test_output_into_a_closed_pipe_is_not_an_error():
    """`amp-backends info | head -1`: the reader stops early; no error, no traceback."""
    import os

    proc = subprocess.run(f"{sys.executable} -m amp_backends info -v | head -1", shell=True, capture_output=True,
                          text=True, timeout=120, executable="/bin/bash",
                          env={**os.environ, "AMP_BACKEND": "cpu"})
    assert proc.stdout.startswith("torch ") and len(proc.stdout.splitlines()) == 1
    assert proc.stderr == "" and proc.returncode == 0
    piped = subprocess.run(f"set -o pipefail; {sys.executable} -m amp_backends info | head -c 10 > /dev/null",
                           shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and "Broken pipe" not in piped.stderr


@pytest.mark.slow
def test_bad_checkpoints_get_clear_errors_before_any_data_or_model(tmp_path, monkeypatch, command):
    from amp_backends.cli import demo

    good = tmp_path / "good.ckpt"
    assert cli("demo", "--epochs", "1", "--checkpoint", str(good), "--json").returncode == 0
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[:2000])
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.ones(3)}, foreign)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    other_kind = tmp_path / "other.ckpt"
    checkpoint.save(other_kind, {"model": {}}, kind="something-else")
    cases = [
        (truncated, [], "truncated.ckpt is corrupt: its contents do not match the checksum"),
        (text, [], "notes.txt is not an amp-backends checkpoint (no checkpoint header)"),
        (foreign, [], "foreign.pt is not an amp-backends checkpoint (no checkpoint header)"),
        (other_kind, [], "is a 'something-else' checkpoint"),
        (good, ["--dtype", "float16"], "was trained with dtype='torch.bfloat16' (this run: 'torch.float16')"),
        (good, ["--batch-size", "32"], "batch_size=64 (this run: 32)"),
        (good, ["--epochs", "0"], "--epochs must be between 1 and 10000"),
        (tmp_path / "missing.ckpt", [], "no such checkpoint file"),
    ]

    # The whole command in a process of its own once: exit status 2, one line, no traceback.
    path, extra, message = cases[0]
    proc = cli("demo", "--epochs", "2", "--resume", str(path), *extra)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr

    # Every case through the same entry point, in this process: each is refused before the data are read
    # or a model is built (either would raise here), so a bad --resume costs nothing.
    def never(*args, **kwargs):
        raise AssertionError("the demo read its data or built its model before checking --resume")

    monkeypatch.setattr(demo, "load_digits", never)
    monkeypatch.setattr(demo, "build_model", never)
    for path, extra, message in cases:
        status, err = command("demo", "--epochs", "2", "--resume", str(path), *extra)
        assert status == 2, (path, err)
        assert message in err and len(err.strip().splitlines()) == 1, (message, err)


@pytest.mark.slow
def test_incompatible_model_state_is_reported(tmp_path):
    bad = tmp_path / "bad.ckpt"
    good = tmp_path / "good.ckpt"
    assert cli("demo", "--epochs", "1", "--checkpoint", str(good), "--json").returncode == 0
    state = checkpoint.load(good, "demo-digits-cnn")
    state["model"]["0.weight"] = torch.zeros(3, 3)
    checkpoint.save(bad, {k: v for k, v in state.items() if k not in ("format", "version", "kind")}, kind="demo-digits-cnn")
    proc = cli("demo", "--epochs", "2", "--resume", str(bad))
    assert proc.returncode == 2 and "does not fit this model" in proc.stderr and "Traceback" not in proc.stderr


def test_checkpoint_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "c.ckpt"
    checkpoint.save(path, {"x": torch.arange(3)}, kind="t")
    before = path.read_bytes()

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(checkpoint.CheckpointError, match="Unpicklable, which checkpoint.load"):
        checkpoint.save(path, {"x": Unpicklable()}, kind="t")
    assert path.read_bytes() == before, "a refused save leaves the old checkpoint whole"

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.io.os, "fsync", disk_full)  # the write fails after the temporary file is half written
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(path, {"x": torch.arange(5)}, kind="t")
    monkeypatch.undo()
    assert path.read_bytes() == before, "a failed save leaves the old checkpoint whole"
    assert [p.name for p in tmp_path.iterdir()] == ["c.ckpt"]
    assert torch.equal(checkpoint.load(path, "t", required=("x",))["x"], torch.arange(3))
    with pytest.raises(checkpoint.CheckpointError, match="lacks y"):
        checkpoint.load(path, "t", required=("y",))


ROW_FIELDS = {"model", "params", "mode", "step_ms", "peak_mem_bytes", "speedup_vs_fp32",
              "speedup_vs_best_full_precision", "native"}


@pytest.mark.slow
def test_bench_real_models_json_every_field(tmp_path):
    """The three real models at the CPU's size: every mode's row with its fields, TF32 n/a with the
    reason, the adapter's overhead on AMP rows, a recommendation per model."""
    proc = cli("bench", "--models", "resnet50,bert-base,gpt2-small", "--rounds", "2", "--warmup", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["backend"] == "cpu" and out["torch"] == torch.__version__ and out["date"] and out["size"] == "small"
    assert list(out["models"]) == ["resnet50", "bert-base", "gpt2-small"]
    modes = ["fp32", "tf32", "amp-float16", "torch-float16", "amp-bfloat16", "torch-bfloat16", "lean-bf16",
             "lean-bf16-max", "lean-bf16-rc", "lean-bf16-sr", "amp-fp8", "torchao-fp8", "bf16-fp8-baseline"]
    assert [(r["model"], r["mode"]) for r in out["rows"]] == [(m, x) for m in out["models"] for x in modes]
    recomputed = {r["model"] for r in out["rows"] if r["mode"] == "lean-bf16-rc" and r["step_ms"] is not None}
    no_recompute = recompute_unavailable_reason()  # torch 2.4: no selective checkpoint, every -rc row says so
    assert recomputed == (set() if no_recompute else {"bert-base", "gpt2-small"}), \
        "the transformers recompute; ResNet-50 has no blocks"
    for r in out["rows"]:
        assert ROW_FIELDS <= set(r), r
        if r["mode"] == "tf32":
            assert r["step_ms"] is None and "CUDA" in r["unavailable"]
            continue
        if r["mode"].endswith("-fp8") or r["mode"] == "bf16-fp8-baseline":
            assert r["step_ms"] is None and r["unavailable"].startswith("cpu has no fp8 matmul")
            continue
        if r["mode"] == "lean-bf16-rc" and (no_recompute or r["model"] == "resnet50"):
            assert r["step_ms"] is None and (no_recompute or "no repeated transformer blocks") in r["unavailable"]
            continue
        if r["mode"] == "lean-bf16-max":  # the built-ins call F.gelu and have no dropout (Transformers' models do)
            assert r["step_ms"] is None and "no GELU, SiLU or Mish module beside a linear and no dropout" in r["unavailable"]
            continue
        assert r["step_ms"] > 0 and r["peak_mem_bytes"] > 0 and r["params"] > 100_000
        low, high = r["speedup_vs_fp32_iqr"]
        assert low <= r["speedup_vs_fp32"] <= high
        assert ("overhead_vs_torch" in r) is (r["mode"].startswith("amp-") and not r["mode"].endswith("fp8"))
        assert r["memory_kind"] == "ledger peak (every storage; this mode alone)"
        if r["via"] in ("amp", "torch"):
            assert r["mem_saving_pct"] > -10, "autocast's weight copies cost little at these sizes"
        if r["via"] in ("lean", "lean-max", "lean-rc", "lean-sr"):
            assert "vs_amp" in r, "the lean step's time against plain AMP's, measured in the same rounds"
    recs = {r["model"]: r for r in out["recommendation"]}
    for model in out["models"]:
        fastest = min((r for r in out["rows"] if r["model"] == model and r["step_ms"] and r["via"] != "torch"),
                      key=lambda r: r["step_ms"])
        assert recs[model]["fastest"] == fastest["mode"], "the recommendation is the fastest mode measured"
        measured = ({"fp32", "amp-float16", "amp-bfloat16", "lean-bf16", "lean-bf16-sr"}
                    | ({"lean-bf16-rc"} if model in recomputed else set()))
        assert set(recs[model]["peak_mem_bytes"]) == measured


@pytest.mark.slow
def test_bench_table_progress_and_plot(tmp_path):
    proc = cli("bench", "--models", "mlp,cnn", "--scale", "0.1", "--rounds", "1", "--warmup", "0")
    assert proc.returncode == 0, proc.stderr
    assert "| model" in proc.stdout and "vs fp32 [IQR]" in proc.stdout and "vs torch [IQR] / torchao" in proc.stdout
    assert "Adapter overhead vs torch.amp" in proc.stdout and "steps per round: mlp 1, cnn 1" in proc.stdout
    assert "Recommendation (per model):" in proc.stdout and "small size for a CPU" in proc.stdout
    assert "bench=mlp: round 1/1" in proc.stderr, "progress, one line per stage off a terminal"
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    assert cli("bench", "--models", "mlp", "--scale", "0.1", "--rounds", "1", "--warmup", "0",
               "--plot", str(png)).returncode == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = cli("bench", "--rounds", "0")
    assert bad.returncode == 2 and "--rounds must be >= 1" in bad.stderr
    bad = cli("bench", "--models", "resnet50,vgg")
    assert bad.returncode == 2 and "unknown model 'vgg'" in bad.stderr and "bench --list" in bad.stderr


def test_bench_list_counts_the_reference_models_parameters():
    proc = cli("bench", "--list")
    assert proc.returncode == 0, proc.stderr
    from amp_backends.cli.bench_models import REAL_MODELS, param_count

    for name, spec in REAL_MODELS.items():
        n = param_count(name)
        assert abs(n - spec.reference_params) / spec.reference_params < 0.01, name
        assert f"{n / 1e6:.2f}M" in proc.stdout
    assert {"25.56M", "109.48M", "124.44M"} <= set(proc.stdout.split())


@pytest.mark.slow
def test_demo_with_torch_compile():
    proc = cli("demo", "--compile", "--epochs", "4", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["test_accuracy"] > 0.85 and out["dtype"] == "bfloat16"
