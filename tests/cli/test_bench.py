"""The time bench's arithmetic on a CPU: each mode's memory alone and equal to ``bench --memory``'s,
rounds of several steps, the adapter's overhead with its range, fp8 verdicts only from compiled rows;
the models users train (Transformers') in the bench and in the ledger at full size; and the scaler's
steady-state step against torch.amp's own (host syncs, ops, allocations, nothing that grows)."""

from __future__ import annotations

import collections
import gc
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import amp_backends
from amp_backends.cli import bench
from amp_backends.cli.bench_memory import memory_rows
from amp_backends.cli.bench_models import MODELS, Bert, Mode, _classify, param_count

from sim_marks import needs_sim_device

HF = pytest.mark.skipif("hf-gpt2" not in MODELS, reason="needs transformers")

#: ops that make a new tensor (the allocations a step makes besides its ops' outputs)
_FACTORIES = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.zeros", "aten.zeros_like", "aten.full",
              "aten.full_like", "aten.ones", "aten.ones_like", "aten.new_empty", "aten.new_zeros", "aten.new_full",
              "aten.scalar_tensor", "aten.lift_fresh"}


class _Ops(TorchDispatchMode):
    """Every aten op dispatched, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _step_costs(mode: str, steps: int = 5) -> list[dict[str, int]]:
    """Per steady-state step of the bench's own ``mode`` step on a one-layer BERT: host reads, ops,
    tensor factories, Python objects alive after it."""
    be = amp_backends.get("cpu")
    torch.manual_seed(0)
    model = Bert(vocab=1000, width=64, layers=1, heads=2, positions=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    m = next(x for x in bench.modes_for(be) if x.name == mode)
    batch = (torch.randint(0, 1000, (2, 16)), torch.randint(0, 2, (2,)))
    step = bench.make_step(be, model, opt, lambda net, x, y: _classify(net(x), y), batch, m)
    for _ in range(3):  # the optimizer's state, the scaler's plan and tensors: made once
        step()
    out = []
    for _ in range(steps):
        counter = _Ops()
        with counter:
            step()
        gc.collect()
        out.append({"syncs": counter.ops["aten._local_scalar_dense"], "ops": sum(counter.ops.values()),
                    "factories": sum(v for k, v in counter.ops.items() if k in _FACTORIES),
                    "objects": len(gc.get_objects())})
    return out


@pytest.mark.filterwarnings("ignore::amp_backends.PerformanceWarning")  # float16 emulated on most CPUs: counted, not timed
def test_the_scalers_fp16_step_costs_what_torch_amps_does_and_nothing_grows():
    """amp_backends' fp16 step against torch.autocast + torch.amp.GradScaler on the same model: no more
    host reads (``.item()``: the step's skip decision, AdamW's step counters), ops or new tensors per
    step, and every steady-state step the same as the one before (no probe, recompile or telemetry that
    runs now and then, no Python object kept per step)."""
    ours, theirs = _step_costs("amp-float16"), _step_costs("torch-float16")
    for key in ("syncs", "ops", "factories"):
        assert len({s[key] for s in ours}) == 1, (key, ours)  # the same every step: nothing intermittent
        assert ours[0][key] <= theirs[0][key], (key, ours[0], theirs[0])
    assert ours[0]["syncs"] == theirs[0]["syncs"], "one skip decision per step, as torch's"
    assert ours[-1]["objects"] - ours[0]["objects"] <= 2, ours  # nothing kept per step


# -- memory per mode ------------------------------------------------------------------------------
def test_each_modes_memory_is_its_own_and_equals_bench_memorys():
    """The time bench's memory column: each mode measured alone (the same figure whether other modes
    run or not), equal to ``bench --memory``'s for the same model, mode and batch, and its fp32 row's
    parts what a direct count gives (parameters, gradients, AdamW's two moments)."""
    be = amp_backends.get("cpu")
    alone = bench.run("cpu", ["gpt2-small"], rounds=1, warmup=0, scale=0.5, modes=["fp32"])
    many = bench.run("cpu", ["gpt2-small"], rounds=1, warmup=0, scale=0.5,
                     modes=["fp32", "amp-bfloat16", "torch-bfloat16", "lean-bf16"])
    peak = {r["mode"]: r["peak_mem_bytes"] for r in many["rows"] if r["step_ms"] is not None}
    assert next(r for r in alone["rows"] if r["mode"] == "fp32")["peak_mem_bytes"] == peak["fp32"]
    batch = many["models"]["gpt2-small"]["batch"]
    assert many["models"]["gpt2-small"]["overhead_iqr_width"] == 0.0, "one round: its range is a point"
    assert alone["models"]["gpt2-small"]["overhead_iqr_width"] is None, "no torch.amp row, no overhead"
    ledger = {r["mode"]: r for r in memory_rows(be, ["gpt2-small"], size="small", scale=batch / 4,
                                                modes=("amp-bfloat16", "lean-bf16"))}
    assert ledger["fp32"]["batch"] == batch
    for mode in ("fp32", "amp-bfloat16", "lean-bf16"):
        # the same measurement: equal (the stated margin, 0.5%, is what a real step and a fake one may differ)
        assert abs(peak[mode] - ledger[mode]["peak_bytes"]) <= 0.005 * peak[mode], (mode, peak[mode], ledger[mode])
    assert abs(peak["torch-bfloat16"] - peak["amp-bfloat16"]) <= 0.005 * peak["amp-bfloat16"]
    n = param_count("gpt2-small", "small")
    parts = ledger["fp32"]["memory"]
    assert parts["parameters"] == 4 * n and parts["optimizer"] >= 8 * n
    assert peak["fp32"] >= parts["parameters"] + parts["optimizer"]
    saving = {m: r["mem_saving_pct"] for m, r in
              ((r["mode"], r) for r in many["rows"] if r["step_ms"] is not None)}
    rec = many["recommendation"][0]
    assert rec["mem_saving_pct"] == {m: v for m, v in saving.items() if m != "fp32" and not m.startswith("torch-")}
    assert rec["mem_saving_pct"]["lean-bf16"] == pytest.approx(100 * (1 - peak["lean-bf16"] / peak["fp32"]))


_LEFT_BEHIND = """
import json, warnings, torch, amp_backends
from amp_backends.cli import bench_memory
from amp_backends.cli.bench_measure import memory_alone
from amp_backends.cli.bench_models import Mode
be = amp_backends.get("mlu")
alone = bench_memory.measure_alone(be, "mlp", "small", None, "amp-float16")
kept = []
made = bench_memory.setup_for
def keeping(*args, **kwargs):  # a mode whose model and optimizer something keeps after it ends
    make = made(*args, **kwargs)
    return lambda: kept.append(make()) or kept[-1]
bench_memory.setup_for = keeping
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    leaking = bench_memory.measure_alone(be, "mlp", "small", None, "amp-float16")
bench_memory.setup_for = made
setup = kept[0]
held = sum(t.numel() * t.element_size() for t in [*setup.model.parameters(), *[p.grad for p in setup.model.parameters()],
                                                  *setup.optimizer_state()])
after = bench_memory.measure_alone(be, "mlp", "small", None, "amp-float16")
rows = bench_memory.memory_rows(be, ["mlp"], size="small", modes=("amp-float16",))
print(json.dumps({"alone": alone.allocator, "alone_left": alone.left_behind, "leaking": leaking.allocator,
                  "left": leaking.left_behind, "held": held, "after": after.allocator, "after_left": after.left_behind,
                  "time_bench": memory_alone(be, "mlp", "small", rows[-1]["batch"], Mode("amp-float16", "amp", torch.float16))[0],
                  "row": rows[-1]["memory"]["allocator_peak"], "row_left": rows[-1]["memory"]["left_behind"],
                  "warnings": [str(w.message) for w in caught]}))
"""


@needs_sim_device
def test_on_an_allocator_each_mode_counts_from_what_it_finds_and_what_it_leaves_is_warned_of():
    """On a device with an allocator (the simulated "mlu": every storage counted) a mode's peak is counted
    from what was allocated when it began: a mode whose model and optimizer something keeps after it ends
    is warned of, naming it and the bytes it left (its parameters, gradients and optimizer state), and
    the next mode measures what it measures alone, in ``bench --memory`` and in the time bench."""
    from amp_backends.testing import sim_packages_path

    from conftest import run_json

    out = run_json(_LEFT_BEHIND, [sim_packages_path("mlu")], {"AMP_SIM_MLU_CHIP": "MLU590"})
    assert out["alone_left"] == 0 and out["after_left"] == 0 and out["row_left"] == 0
    assert out["alone"] > out["held"] > 0
    assert out["left"] >= out["held"], "what the kept model and optimizer hold is reported as left behind"
    assert len(out["warnings"]) == 1 and "mlp in amp-float16 left" in out["warnings"][0]
    assert f"{out['left'] / 2**20:,.1f} MiB" in out["warnings"][0]
    for later in ("after", "row", "time_bench", "leaking"):  # nothing the earlier mode left is counted
        assert abs(out[later] - out["alone"]) <= 1024, (later, out)


# -- rounds and verdicts ----------------------------------------------------------------------------
def test_a_round_times_several_steps_and_their_mean():
    be = amp_backends.get("cpu")
    timer, kind = bench.step_timer(be)
    assert kind == "host clock between device syncs"
    calls = []
    per_step = timer(lambda: calls.append(1), 7)
    assert len(calls) == 7 and per_step >= 0
    assert bench.steps_per_round(be, 0.05) == 1, "a CPU times one step per round"
    gpu = type("Gpu", (), {"device_type": "cuda"})()
    assert bench.steps_per_round(gpu, 0.05) == 4  # 0.2 s of 50 ms steps
    assert bench.steps_per_round(gpu, 0.5) == bench.MIN_STEPS_PER_ROUND
    assert bench.steps_per_round(gpu, 0.001) == bench.MAX_STEPS_PER_ROUND


def _times(*per_round: float) -> list[float]:
    return [x / 1e3 for x in per_round]


def test_overhead_has_its_range_and_fp8_gets_a_verdict_only_compiled():
    modes = [Mode("fp32", "full"), Mode("amp-float16", "amp", torch.float16), Mode("torch-float16", "torch", torch.float16),
             Mode("amp-fp8", "amp-fp8", torch.bfloat16), Mode("torchao-fp8", "torchao-fp8", torch.bfloat16),
             Mode("bf16-fp8-baseline", "fp8-baseline", torch.bfloat16)]
    times = {"fp32": _times(100, 100, 100, 100, 100), "amp-float16": _times(50, 51, 50, 52, 50),
             "torch-float16": _times(50, 50, 50, 50, 50), "amp-fp8": _times(30, 30, 31, 30, 30),
             "torchao-fp8": _times(30, 30, 30, 30, 30), "bf16-fp8-baseline": _times(40, 40, 40, 40, 40)}
    memory = {k: (100, "ledger") for k in times}
    for compiled in (set(), {"amp-fp8", "torchao-fp8", "bf16-fp8-baseline"}):
        rows = {r["mode"]: r for r in bench._rows("m", 1, modes, times, memory, compiled=compiled)}
        amp = rows["amp-float16"]
        assert amp["overhead_vs_torch"] == pytest.approx(1.0)  # the median of 1.00, 1.02, 1.00, 1.04, 1.00
        assert amp["overhead_vs_torch_iqr"] == pytest.approx([1.0, 1.02])
        assert amp["overhead_vs_torch_range"] == pytest.approx([1.0, 1.04])
        fp8 = rows["amp-fp8"]
        assert fp8["speedup_vs_bf16"] == pytest.approx(40 / 30)
        if compiled:
            assert fp8["verdict"] == "faster than bf16 (both compiled)" and fp8["compiled"]
        else:
            assert fp8["verdict"].startswith("eager: no fp8 verdict")
        rec = bench.recommend(list(rows.values()), {"m": {}})[0]
        assert rec["fastest"] == "amp-float16", "fp8 rows (compiled) are not ranked with the eager modes"
        assert rec["fp8"]["compiled"] is bool(compiled)
    text = bench.render({"backend": "cpu", "device": "x", "torch": "t", "date": "d", "size": "full", "rounds": 5,
                         "emulated_rounds": 2, "warmup": 1, "timer": "device events", "memory": "allocator",
                         "models": {"m": {"batch": 1, "input": "i", "steps_per_round": 4, "overhead_iqr_width": 0.02}},
                         "rows": list(rows.values()), "recommendation": [rec]})
    assert "m amp-float16 1.000 [1.000-1.020]" in text and "steps per round: m 4" in text
    assert "fp8 (amp-fp8) 1.33x bf16's speed" in text
    assert "widest interquartile range 0.020: resolves 2%" in text


# -- the models users train ------------------------------------------------------------------------
@HF
def test_transformers_models_are_built_from_their_configs_with_dropout():
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        assert param_count("hf-gpt2") == sum(p.numel() for p in GPT2LMHeadModel(GPT2Config()).parameters())
        assert param_count("hf-bert") == sum(p.numel() for p in BertForSequenceClassification(BertConfig()).parameters())
    assert param_count("hf-gpt2") == MODELS["hf-gpt2"].reference_params
    model = MODELS["hf-bert"].build("small")
    assert model.training and any(isinstance(m, torch.nn.Dropout) and m.p == 0.1 for m in model.modules())
    spec = MODELS["hf-gpt2"]
    torch.manual_seed(0)
    gpt2 = spec.build("small")
    x, y = spec.batch("small", torch.device("cpu"), 2)
    gpt2.eval()  # the loss through labels= is the next-token cross-entropy of the logits
    logits = gpt2(input_ids=x).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    assert torch.allclose(spec.loss_of(gpt2, x, y), expected, rtol=1e-5)


@HF
def test_transformers_models_ledger_at_full_size_on_fake_tensors(monkeypatch):
    """GPT2LMHeadModel and BertForSequenceClassification at full size and the bench's batches, counted on
    fake tensors: parameters as counted directly, the lean mode's lazy logits on GPT-2's ``lm_head``
    (the float32 logits of its labels= loss never made whole: without the lever the same mode holds at
    least one float32 copy of them more), and no LM head lever on BERT."""
    from amp_backends.cli import bench_memory

    rows = memory_rows(amp_backends.get("cpu"), ["hf-gpt2", "hf-bert"], modes=("amp-bfloat16", "lean-bf16"))
    by = {(r["model"], r["mode"]): r for r in rows}
    assert by[("hf-gpt2", "fp32")]["memory"]["parameters"] == 124_439_808 * 4
    assert by[("hf-bert", "fp32")]["memory"]["parameters"] == 109_483_778 * 4
    assert bench_memory.LEAN_HEADS["hf-gpt2"] == "lm_head" and "hf-bert" not in bench_memory.LEAN_HEADS
    monkeypatch.delitem(bench_memory.LEAN_HEADS, "hf-gpt2")
    headless = memory_rows(amp_backends.get("cpu"), ["hf-gpt2"], modes=("lean-bf16",))[-1]["memory"]
    vocab_logits = 16 * 512 * 50257 * 4  # one float32 copy of GPT-2's logits at the bench's batch
    assert headless["peak"] - by[("hf-gpt2", "lean-bf16")]["memory"]["peak"] >= vocab_logits
    assert by[("hf-gpt2", "lean-bf16")]["saving_vs_fp32"] > by[("hf-gpt2", "amp-bfloat16")]["saving_vs_fp32"]
    assert by[("hf-bert", "lean-bf16")]["saving_vs_fp32"] > 0


def test_the_llama_block_is_the_width_where_fp8_pays():
    assert param_count("llama-block") == 2 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 4096
    spec = MODELS["llama-block"]
    torch.manual_seed(0)
    model = spec.build("small")
    x, y = spec.batch("small", torch.device("cpu"), None)
    loss = spec.loss_of(model, x, y)
    loss.backward()
    assert loss.item() > 0 and all(p.grad is not None for p in model.parameters())


# -- bench/gpu_check.py ----------------------------------------------------------------------------
def _gpu_check():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


@pytest.mark.filterwarnings("ignore::amp_backends.PerformanceWarning")
def test_gpu_check_parts_run_and_one_failure_loses_nothing_else(tmp_path, monkeypatch):
    """The GPU check's own parts at tiny sizes on a CPU: the memory and the time bench, their rows the
    same measurement (the time bench's memory column is the memory part's for the same model, mode and
    batch); a part that raises is recorded with its error and the parts after it still run; one past
    its budget is stopped and recorded; the JSON is written after every part."""
    gpu_check, _ = _gpu_check()
    out = tmp_path / "check.json"

    def broken(ctx, budget):
        raise RuntimeError("a part that fails")

    def endless(ctx, budget):
        while True:
            pass

    monkeypatch.setitem(gpu_check.PARTS, "tests", broken)
    monkeypatch.setitem(gpu_check.PARTS, "kernels", endless)
    monkeypatch.setitem(gpu_check.BUDGETS, "kernels", (1.0, 1.0))
    result = gpu_check.run(str(out), smoke=True, total=600, only=["tests", "memory", "bench", "kernels", "fp8"])
    parts = result["parts"]
    assert parts["tests"]["status"] == "error" and "a part that fails" in parts["tests"]["why"]
    assert parts["kernels"]["status"] == "timeout" and parts["kernels"]["seconds"] <= parts["kernels"]["budget_s"] + 1
    assert parts["memory"]["status"] == "ok" and parts["bench"]["status"] == "ok", parts
    assert parts["fp8"]["status"] == "ok" and "no fp8 matmul" in parts["fp8"]["result"]["skipped"]
    memory = {r["mode"]: r["peak_bytes"] for r in parts["memory"]["result"]["rows"]}
    timed = {r["mode"]: r["peak_mem_bytes"] for r in parts["bench"]["result"]["rows"] if r["step_ms"]}
    assert timed == {m: memory[m] for m in timed}
    assert json.loads(out.read_text())["parts"].keys() == parts.keys()
    h = result["header"]
    assert h["torch"] == torch.__version__ and h["date"] and h["device"]
    text = gpu_check.table(result)
    assert "memory" in text and "timeout" in text and "mlp" in text


@pytest.mark.slow
def test_gpu_check_smoke_end_to_end_in_under_a_minute(tmp_path):
    """``python bench/gpu_check.py --smoke``: one process, every part recorded (done, or stopped at its
    budget), one JSON, a table, within its budget."""
    import subprocess
    import sys
    import time

    _, path = _gpu_check()
    out = tmp_path / "gpu_check.json"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(path), "--smoke"], capture_output=True, text=True, timeout=180,
                          env={**__import__("os").environ, "OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.monotonic() - start < 90, "45 s of parts, and the interpreter's start"
    data = json.loads(out.read_text())
    assert list(data["parts"]) == ["tests", "memory", "bench", "kernels", "fp8", "scaler", "optimizer", "levers"]
    assert all(p["status"] in ("ok", "timeout", "skipped") for p in data["parts"].values()), data["parts"]
    assert data["total_s"] <= data["budget_s"] + 5
    assert "part      status" in proc.stdout and data["header"]["device"] in proc.stdout


def test_a_library_model_asked_for_where_its_library_is_missing_is_refused_naming_it(capsys, monkeypatch):
    from amp_backends.cli import bench_thirdparty
    from amp_backends import cli

    real = bench_thirdparty.importlib.util.find_spec
    monkeypatch.setattr(bench_thirdparty.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchvision" else real(name, *a))
    assert cli.main(["bench", "--models", "resnet50,tv-resnet50", "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert "tv-resnet50 needs torchvision, which is not installed (pip install torchvision)" in err
    assert err.count("\n") == 1


def test_check_of_a_library_model_whose_library_is_missing_names_it(capsys, monkeypatch):
    """``check bench:tv-resnet50`` without torchvision says what to install, as ``bench`` does (it said
    "no such bench model")."""
    from amp_backends.cli import bench_thirdparty
    from amp_backends import cli

    real = bench_thirdparty.importlib.util.find_spec
    monkeypatch.setattr(bench_thirdparty.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchvision" else real(name, *a))
    assert cli.main(["check", "bench:tv-resnet50"]) == 2
    err = capsys.readouterr().err
    assert "tv-resnet50 needs torchvision, which is not installed (pip install torchvision)" in err
    assert "no such bench model" not in err


@pytest.mark.parametrize("argv", [["bench", "--loss-steps", "5"], ["check", "bench:mlp", "--budget", "0.1"]],
                         ids=["loss-steps without --memory", "budget without --plan"])
def test_an_option_that_would_be_ignored_is_refused(capsys, argv):
    """An option that only applies with another (``--loss-steps`` with ``--memory``, ``--budget`` with
    ``--plan``) is refused, naming it, before any work (it was accepted and ignored, exit 0)."""
    from amp_backends import cli

    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert argv[-2] in err and ("--memory" in err or "--plan" in err) and "Traceback" not in err
