"""Everything a GPU can show that a CPU cannot, in one command that fits a short lease:

    python bench/gpu_check.py                           # on one GPU: under 8 minutes
    # (where amp-backends is not installed it first runs pip install --no-deps --no-build-isolation -e .,
    #  offline: the built-in backends are found through the distribution's entry points)
    python bench/gpu_check.py --json out.json --budget 420
    python bench/gpu_check.py --smoke                   # on a CPU: tiny sizes, under a minute

Parts, each with a hard time budget (a part past it is stopped and recorded as timed out) and its
own try/except (a part that fails is recorded with its error; the others still run):

1. ``tests``: the suite's GPU tests (tests/plugins/test_cuda.py, test_triton_kernels.py, test_fp8.py, and
   test_memory.py's allocator tests) through pytest in a process of its own (8 xdist workers where
   pytest-xdist is installed);
2. ``memory``: ``amp-backends bench --memory``'s measurement, each mode alone on the allocator
   (fp32, AMP per dtype, lean-bf16, lean-bf16-sr), on the bench models and
   the Transformers/torchvision ones;
3. ``bench``: the time bench at full size on the same models (fp32, TF32, amp-*, torch-*, lean-bf16,
   lean-bf16-sr), few rounds of several steps each, its memory column the ``memory`` part's figures;
4. ``kernels``: bench/unscale.py's kernel figures, in a process of its own;
5. ``fp8``: the fp8 rows compiled (amp-fp8, torchao-fp8, their bf16 baseline) on the width-4096
   Llama-style block, where torchao is importable and the GPU has fp8 matmuls;
6. ``scaler``: the fp16 step of BERT through amp_backends and through torch.amp, step by step: each
   step's device time, host syncs (CUDA's sync debug mode), garbage collections and the ops dispatched,
   so that an intermittent cost of the adapter shows which step it hit and what ran there;
7. ``optimizer``: bench/sr_step.py, the stochastic-rounding step (``StochasticAdamW``, torchao's
   ``_AdamW`` with and without ``compile_once``) against AdamW on float32 masters, on BERT-base's shapes;
8. ``levers``: bench/lean_profile.py, the hooked levers' host cost where Python and launches bound the
   step (``--host``: BERT's structure at width 16 on the GPU, each lever alone, with its Python calls)
   and each lever of ``memory_lean`` alone, all of them, and all but each one, on Transformers' BERT-base
   at full size (``--levers``).

It writes one JSON (``--json``; default ``$OUT/gpu_check.json`` where ``OUT`` is set, else
``gpu_check.json``) after every part, so a run cut short keeps what it finished, and prints a short
table at the end with the device, the versions of torch, Triton, torchao and Transformers, and the date.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT / "plugins", ROOT):  # the checkout's code, installed or not
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

#: part -> seconds it may take (full run, smoke run); the whole run stays under ``--budget``.
BUDGETS: dict[str, tuple[float, float]] = {
    "tests": (120, 20), "memory": (70, 8), "bench": (150, 10), "kernels": (35, 3), "fp8": (100, 3), "scaler": (25, 8),
    "optimizer": (60, 8), "levers": (75, 8),
}
#: the whole run's default budget, seconds (a lease's 8 minutes, less the interpreter's start)
TOTAL_BUDGET = 450.0
SMOKE_BUDGET = 45.0

GPU_TESTS = ["tests/plugins/test_cuda.py", "tests/plugins/test_triton_kernels.py", "tests/precision/test_fp8.py", "tests/memory/test_memory.py"]
#: every test of the files above but test_memory.py's, of which only the allocator's
GPU_TESTS_K = "allocator or not test_memory"
#: pytest-xdist workers for the GPU tests (one GPU, a process each: their compiles run side by side)
TEST_WORKERS = 8
SMOKE_TESTS = ["tests/cli/test_bench.py"]
SMOKE_TESTS_K = "round_times or fp8_gets"

# BERT first (its fp16 overhead is the open question), then GPT-2 and ResNet-50; the libraries' before the built-ins
BENCH_MODELS = ["hf-bert", "bert-base", "hf-gpt2", "gpt2-small", "tv-resnet50", "resnet50"]
SMOKE_MODELS = ["mlp"]
TIME_MODES = ["fp32", "tf32", "amp-float16", "torch-float16", "amp-bfloat16", "torch-bfloat16", "lean-bf16",
              "lean-bf16-max", "lean-bf16-rc", "lean-bf16-sr"]
FP8_MODES = ["amp-bfloat16", "amp-fp8", "torchao-fp8", "bf16-fp8-baseline"]


class PartTimeout(Exception):
    """A part ran past its budget."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`PartTimeout` in the main thread after ``seconds`` (at the next Python bytecode:
    a device op in flight finishes first)."""
    def expire(signum: int, frame: Any) -> None:
        raise PartTimeout(f"past its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:  # noqa: BLE001 - a missing or broken library is reported as absent
        return None


def ensure_installed() -> str | None:
    """Install this checkout (editable, no dependencies, offline) where amp-backends is not installed: its
    built-in backends are found through the distribution's entry points. Returns what was done, or None."""
    try:
        importlib.metadata.version("amp-backends")
        return None
    except importlib.metadata.PackageNotFoundError:
        pass
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "-e", str(ROOT)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    importlib.invalidate_caches()
    if proc.returncode:
        return f"`{' '.join(cmd[2:])}` failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-500:]}"
    return f"installed this checkout: {' '.join(cmd[2:])}"


def header(smoke: bool) -> dict[str, Any]:
    """Where and with what the check ran."""
    import torch

    cuda = torch.cuda.is_available()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001 - a copy without git history
        commit = None
    try:
        installed = importlib.metadata.version("amp-backends")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()}, {os.cpu_count()} cores)",
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "torchao": _version("torchao"),
        "transformers": _version("transformers"),
        "torchvision": _version("torchvision"),
        "commit": commit,
        "amp_backends_installed": installed,
        "smoke": smoke,
    }


# -- the parts -----------------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "plugins"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def part_tests(ctx: dict[str, Any], budget: float) -> dict[str, Any]:
    """The suite's GPU tests (a CPU smoke run: two of the bench's own tests), pytest in its own process."""
    files, k = (SMOKE_TESTS, SMOKE_TESTS_K) if ctx["smoke"] else (GPU_TESTS, GPU_TESTS_K)
    cmd = [sys.executable, "-m", "pytest", "-q", "--maxfail=10", "-p", "no:cacheprovider", "-k", k, *files]
    if not ctx["smoke"] and importlib.util.find_spec("xdist") is not None:
        cmd[3:3] = ["-n", str(TEST_WORKERS)]  # Triton's compiles and the fp8 tests' in parallel: 120 s held one
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=budget)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        raise PartTimeout(f"pytest past its budget of {budget:.0f} s; last output: {out[-400:]}") from None
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {what: int(n) for n, what in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", summary)}
    return {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "summary": summary, "counts": counts,
            "tail": (proc.stdout + proc.stderr)[-3000:] if proc.returncode else ""}


def _size(ctx: dict[str, Any]) -> tuple[str, float]:
    return ("small", 0.25) if ctx["smoke"] else ("full", 1.0)


def _models(ctx: dict[str, Any], names: list[str]) -> list[str]:
    from amp_backends.cli.bench_models import MODELS

    names = ctx.get("models") or names
    return [m for m in names if m in MODELS]


def _modes(ctx: dict[str, Any], modes: list[str]) -> list[str]:
    """``modes`` less those ``--modes`` leaves out (fp32, the baseline, always runs)."""
    wanted = ctx.get("modes")
    return [m for m in modes if wanted is None or m == "fp32" or m in wanted]


def part_memory(ctx: dict[str, Any], budget: float) -> dict[str, Any]:
    """``bench --memory`` per mode alone (the allocator on a GPU, the ledger on fake tensors on a CPU)."""
    import amp_backends
    from amp_backends.cli.bench_memory import memory_rows

    be = amp_backends.get()
    size, scale = _size(ctx)
    rows: list[dict[str, Any]] = []
    done = []
    result = {"backend": be.name, "size": size, "rows": rows, "models_done": done}
    ctx["memory"] = result
    for name in _models(ctx, SMOKE_MODELS if ctx["smoke"] else BENCH_MODELS):
        rows += memory_rows(be, [name], size, scale, modes=("amp-bfloat16",) if ctx["smoke"] else ctx.get("modes"))
        done.append(name)
    return result


def part_bench(ctx: dict[str, Any], budget: float) -> dict[str, Any]:
    """The time bench, model by model (what finished is kept if the budget runs out), its memory column
    the ``memory`` part's figures for the same model, mode and batch where that part measured them."""
    from amp_backends.cli import bench

    size, scale = _size(ctx)
    cache = {(r["model"], size, r["batch"], r["mode"]): (r["peak_bytes"], r["peak_kind"])
             for r in ctx.get("memory", {}).get("rows", []) if r.get("peak_bytes") is not None}
    result: dict[str, Any] = {"rows": [], "models": {}, "recommendation": []}
    ctx["bench"] = result
    modes = ["fp32", "amp-bfloat16"] if ctx["smoke"] else _modes(ctx, TIME_MODES)
    for name in _models(ctx, SMOKE_MODELS if ctx["smoke"] else BENCH_MODELS):
        one = bench.run(None, [name], size, rounds=2 if ctx["smoke"] else 5, warmup=0 if ctx["smoke"] else 2,
                        scale=scale, modes=modes, memory_cache=cache)
        result.update({k: v for k, v in one.items() if k not in ("rows", "models", "recommendation")})
        result["rows"] += one["rows"]
        result["models"].update(one["models"])
        result["recommendation"] += one["recommendation"]
    return result


def _script(name: str, args: list[str], budget: float, env: dict[str, str] | None = None) -> str:
    """Run ``bench/<name>`` in a process of its own within ``budget`` seconds; its standard output."""
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / name), *args], cwd=ROOT, env=env or _env(),
                              capture_output=True, text=True, timeout=budget)
    except subprocess.TimeoutExpired:
        raise PartTimeout(f"bench/{name} past its budget of {budget:.0f} s") from None
    if proc.returncode:
        raise RuntimeError(f"bench/{name} exited {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}")
    return proc.stdout


def part_kernels(ctx: dict[str, Any], budget: float) -> dict[str, Any]:
    """bench/unscale.py's figures (its own process; ``--smoke`` under Triton's interpreter on a CPU)."""
    out = Path(ctx["json"]).with_name("unscale.json")
    env = _env()
    if ctx["smoke"]:
        env["TRITON_INTERPRET"] = "1"
    _script("unscale.py", ["--json", str(out), *(["--smoke"] if ctx["smoke"] else [])], budget, env)
    return json.loads(out.read_text())


def part_optimizer(ctx: dict[str, Any], budget: float) -> dict[str, Any]:
    """bench/sr_step.py's figures: the stochastic-rounding step (StochasticAdamW, torchao's) against AdamW on
    float32 masters, on BERT-base's parameter shapes (its own process; ``--smoke``: small, without torchao's
    compiles)."""
    out = _script("sr_step.py", ["--json", *(["--smoke", "--skip-torchao"] if ctx["smoke"] else [])], budget)
    return json.loads(out[out.index("{"):])


def part_levers(ctx: dict[str, Any], budget: float) -> dict[str, Any]:
    """bench/lean_profile.py's figures: ``--host`` (the hooked levers' host cost, BERT at width 16) and,
    in a full run with the budget left, ``--levers`` on BERT-base at full size (each in a process of its
    own; ``--smoke``: the first only, few steps)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return {"skipped": "Transformers is not installed (pip install transformers)"}
    start = time.monotonic()
    host = Path(ctx["json"]).with_name("lean_host.json")
    _script("lean_profile.py", ["--host", "--json", str(host), *(["--smoke"] if ctx["smoke"] else [])], budget)
    result: dict[str, Any] = {"host": json.loads(host.read_text())}
    left = budget - (time.monotonic() - start)
    if not ctx["smoke"] and left > 20:
        alone = Path(ctx["json"]).with_name("lean_levers.json")
        _script("lean_profile.py", ["--levers", "--models", "hf-bert", "--steps", "8", "--json", str(alone)], left)
        result["levers"] = json.loads(alone.read_text())
    return result


def part_fp8(ctx: dict[str, Any], budget: float) -> dict[str, Any]:
    """The fp8 rows compiled against bf16 compiled, on the width-4096 Llama-style block."""
    import amp_backends
    from amp_backends.cli import bench
    from amp_backends.cli.bench_fp8 import compiled, fp8_unavailable

    be = amp_backends.get()
    why = fp8_unavailable(be)
    if why is not None:
        return {"skipped": why}
    size, scale = _size(ctx)
    result = bench.run(None, ["llama-block"], size, rounds=3 if ctx["smoke"] else 5, warmup=1 if ctx["smoke"] else 3,
                       scale=scale, modes=FP8_MODES)
    result["compiled"] = compiled(be)
    return result


def part_scaler(ctx: dict[str, Any], budget: float) -> dict[str, Any]:
    """BERT's fp16 step through amp_backends and through torch.amp, each step timed alone (device
    events), with its host syncs, garbage collections, the Triton kernel's blocks cut on the host (once per
    set of gradient sizes: a new arrangement of the same gradients is only placed) and one step's ops dispatched:
    first each mode's steps back to back, then the two interleaved as the time bench's rounds run them
    (another mode's step between, which can move the caching allocator's blocks). What an intermittent
    cost of the adapter is, and which steps it hit."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import amp_backends
    from amp_backends.cli import bench
    from amp_backends.cli.bench_models import MODELS

    be = amp_backends.get()
    name = "transformer" if ctx["smoke"] else "hf-bert" if "hf-bert" in MODELS else "bert-base"
    spec = MODELS[name]
    size = _size(ctx)[0]
    batch = 1 if ctx["smoke"] else spec.batch_sizes[size]
    steps = 2 if ctx["smoke"] else 40
    cuda = torch.cuda.is_available()
    timer, _ = bench.step_timer(be)
    cuts = _CutCount()

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    def timed(step: Callable[[], None], seen_gc: list[int]) -> dict[str, Any]:
        before, built = len(seen_gc), cuts.calls
        with _sync_warnings(cuda) as warned:
            ms = 1e3 * timer(step, 1)
        return {"ms": ms, "syncs": len(warned) if cuda else None, "gc": len(seen_gc) - before,
                "cuts_built": cuts.calls - built}

    def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
        per = [r["ms"] for r in records]
        slow = statistics.median(per) * 1.25
        return {"step_ms": per, "median_ms": statistics.median(per), "max_ms": max(per),
                "slow_steps": [i for i, t in enumerate(per) if t > slow],
                "host_syncs_per_step": [r["syncs"] for r in records] if cuda else "n/a (CUDA's sync debug mode only)",
                "gc_collections_per_step": [r["gc"] for r in records],
                "triton_cuts_built_per_step": [r["cuts_built"] for r in records]}

    out: dict[str, Any] = {"model": name, "size": size, "batch": batch, "steps": steps}
    made: dict[str, Callable[[], None]] = {}
    for mode_name in ("amp-float16", "torch-float16"):
        mode = next((m for m in bench.modes_for(be) if m.name == mode_name), None)
        if mode is None:
            out[mode_name] = {"skipped": f"{be.name} has no float16 autocast"}
            continue
        torch.manual_seed(0)
        model = spec.build(size).to(be.device())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        made[mode_name] = bench.make_step(be, model, opt, spec.loss_of, spec.batch(size, be.device(), batch), mode)
        for _ in range(1 if ctx["smoke"] else 3):
            made[mode_name]()
    seen_gc: list[int] = []
    on_gc = lambda phase, info: seen_gc.append(info["generation"]) if phase == "start" else None  # noqa: E731
    gc.callbacks.append(on_gc)
    try:
        for mode_name, step in made.items():  # back to back
            out[mode_name] = summary([timed(step, seen_gc) for _ in range(steps)])
            counter = Ops()
            with counter:
                step()
            out[mode_name].update(local_scalar_dense_per_step=counter.ops["aten._local_scalar_dense"],
                                  ops_per_step=sum(counter.ops.values()))
        if len(made) == 2:  # interleaved, the order alternating round by round as the time bench's
            records: dict[str, list[dict[str, Any]]] = {m: [] for m in made}
            for r in range(steps // 2):
                for mode_name in (list(made) if r % 2 == 0 else list(made)[::-1]):
                    records[mode_name].append(timed(made[mode_name], seen_gc))
            out["interleaved"] = {m: summary(v) for m, v in records.items()}
    finally:
        gc.callbacks.remove(on_gc)
        cuts.restore()
    amp, ref = out.get("amp-float16", {}), out.get("torch-float16", {})
    if "median_ms" in amp and "median_ms" in ref:
        out["overhead_median"] = amp["median_ms"] / ref["median_ms"]
    inter = out.get("interleaved")
    if inter:
        out["overhead_median_interleaved"] = inter["amp-float16"]["median_ms"] / inter["torch-float16"]["median_ms"]
    return out


class _CutCount:
    """Counts the Triton kernel's blocks cut on the host (``_cuts``: per block, the work a new set of
    gradient sizes costs; a new arrangement of the same sizes is only placed on the device).
    Read-only instrumentation; nothing where the plugin does not import."""

    def __init__(self) -> None:
        self.calls = 0
        self._module: Any = None
        try:
            from amp_backends_plugins.triton import _kernels
        except Exception:  # noqa: BLE001 - no Triton: nothing to count
            return
        self._module, self._real = _kernels, _kernels._cuts

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self._real(*args, **kwargs)
        _kernels._cuts = counting

    def restore(self) -> None:
        if self._module is not None:
            self._module._cuts = self._real


@contextlib.contextmanager
def _sync_warnings(cuda: bool) -> Iterator[list[Any]]:
    """The host syncs inside the block, as CUDA's sync debug mode warns of them (nothing elsewhere)."""
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    seen[:] = [w for w in seen if "synchroniz" in str(w.message).lower()]


PARTS: dict[str, Callable[[dict[str, Any], float], dict[str, Any]]] = {
    "tests": part_tests, "memory": part_memory, "bench": part_bench, "kernels": part_kernels, "fp8": part_fp8,
    "scaler": part_scaler, "optimizer": part_optimizer, "levers": part_levers,
}


# -- the run ------------------------------------------------------------------------------------------
def run(json_path: str, smoke: bool, total: float, only: list[str] | None = None,
        models: list[str] | None = None, modes: list[str] | None = None) -> dict[str, Any]:
    """Run the parts within ``total`` seconds, writing the JSON after each; return what was written.
    ``models``/``modes``: the memory and time parts' models and modes instead of the defaults."""
    start = time.monotonic()
    result: dict[str, Any] = {"header": header(smoke), "budget_s": total, "parts": {}}
    ctx: dict[str, Any] = {"smoke": smoke, "json": json_path, "models": models, "modes": modes}
    names = [p for p in PARTS if only is None or p in only]
    factor = max(1.0, total / (SMOKE_BUDGET if smoke else TOTAL_BUDGET))  # a longer run gives every part more
    for i, name in enumerate(names):
        left = total - (time.monotonic() - start)
        later = sum(min(BUDGETS[n][smoke], 5.0) for n in names[i + 1:])  # a few seconds kept for each part after
        budget = min(BUDGETS[name][smoke] * factor, left - later)
        t0 = time.monotonic()
        record: dict[str, Any]
        if budget < 1:
            record = {"status": "skipped", "why": "the run's budget was spent"}
        else:
            try:
                with deadline(budget):
                    record = {"status": "ok", "result": PARTS[name](ctx, budget)}
            except PartTimeout as exc:
                record = {"status": "timeout", "why": str(exc), "partial": ctx.get(name)}
            except Exception as exc:  # noqa: BLE001 - one part's failure is recorded; the others run
                record = {"status": "error", "why": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc()[-3000:], "partial": ctx.get(name)}
        record.update(seconds=round(time.monotonic() - t0, 1), budget_s=round(max(budget, 0), 1))
        result["parts"][name] = record
        result["total_s"] = round(time.monotonic() - start, 1)
        Path(json_path).write_text(json.dumps(result, indent=2, default=str))
        gc.collect()
    return result


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def table(result: dict[str, Any]) -> str:
    """The short table printed at the end."""
    h = result["header"]
    lines = [f"gpu_check on {h['device']} (capability {h['capability']}), {h['date']}; torch {h['torch']} "
             f"(CUDA {h['cuda']}), triton {h['triton']}, torchao {h['torchao']}, transformers {h['transformers']}, "
             f"torchvision {h['torchvision']}; commit {h['commit']}; amp-backends installed: {h['amp_backends_installed']}"
             f"; total {result.get('total_s')} s of {result['budget_s']:.0f}", ""]
    lines.append(f"{'part':<9} {'status':<8} {'s':>6}  what")
    for name, rec in result["parts"].items():
        lines.append(f"{name:<9} {rec['status']:<8} {rec['seconds']:>6.1f}  {_summary(name, rec)}")
    bench = (result["parts"].get("bench") or {}).get("result") or (result["parts"].get("bench") or {}).get("partial")
    if bench and bench.get("rows"):
        lines += ["", f"{'model':<12} {'mode':<15} {'step ms':>8} {'vs fp32':>8} {'mem':>8} {'vs torch [IQR]':>22}"]
        for r in bench["rows"]:
            if r.get("step_ms") is None:
                continue
            over = ""
            if r.get("overhead_vs_torch") is not None:
                lo, hi = r["overhead_vs_torch_iqr"]
                over = f"{r['overhead_vs_torch']:.3f} [{lo:.3f}-{hi:.3f}]"
            elif r.get("vs_amp") is not None:
                over = f"vs amp {r['vs_amp']:.2f}"
            mem = _pct(-r["mem_saving_pct"]) if r["mode"] != "fp32" else f"{r['peak_mem_bytes'] / 2**20:,.0f}M"
            lines.append(f"{r['model']:<12} {r['mode']:<15} {r['step_ms']:>8.1f} {r['speedup_vs_fp32']:>7.2f}x "
                         f"{mem:>8} {over:>22}")
    return "\n".join(lines)


def _summary(name: str, rec: dict[str, Any]) -> str:
    if rec["status"] != "ok":
        return rec.get("why", "")[:150]
    r = rec["result"]
    if name == "tests":
        return r["summary"]
    if name == "memory":
        from amp_backends.cli.bench_memory import LEFT_BEHIND_MARGIN

        left = "; ".join(f"{x['model']} {x['mode']} left {x['memory']['left_behind'] / 2**20:,.0f} MiB" for x in r["rows"]
                         if (x.get("memory") or {}).get("left_behind", 0) > LEFT_BEHIND_MARGIN)
        saved = "; ".join(f"{x['model']} {x['mode']} {_pct(-100 * x['saving_vs_fp32'])}" for x in r["rows"]
                          if x.get("saving_vs_fp32") is not None and x["mode"] != "fp32")
        return (f"LEFT BEHIND: {left} | " if left else "") + saved[:400]
    if name == "bench":
        return f"{len(r['models'])} models, {sum(1 for x in r['rows'] if x.get('step_ms'))} rows"
    if name == "kernels":
        return "; ".join(f"{x['case']} {x['pct_of_copy']:.0f}%" for x in r.get("rows", []) if "pct_of_copy" in x)[:400]
    if name == "fp8":
        if "skipped" in r:
            return f"skipped: {r['skipped']}"
        return "; ".join(f"{x['mode']} bf16/fp8 {x['speedup_vs_bf16']:.2f}x ({x['verdict']})" for x in r["rows"]
                         if x.get("speedup_vs_bf16") is not None)
    if name == "optimizer":
        return "; ".join(f"{x['step']} {x['ms']:.2f} ms ({x['vs_foreach_masters']:.2f}x foreach masters)"
                         for x in r["rows"])[:400]
    if name == "levers":
        if "skipped" in r:
            return f"skipped: {r['skipped']}"
        host = "; ".join(f"{k} {x['excess_ms']:+.2f} ms ({x['python_calls'] - r['host']['none']['python_calls']:+d} calls)"
                         for k, x in r["host"].items() if k != "none")
        alone = "; ".join(f"{k} {v / row['levers_ms']['amp']:.2f}x" for row in r.get("levers", [])
                          for k, v in row["levers_ms"].items() if k != "amp")
        return (f"host (width 16): {host}" + (f" | full size vs amp: {alone}" if alone else ""))[:900]
    if name == "scaler":
        parts = [f"{m} median {r[m]['median_ms']:.1f} ms max {r[m]['max_ms']:.1f} slow steps {r[m]['slow_steps']} "
                 f"blocks cut {sum(r[m]['triton_cuts_built_per_step'])}"
                 for m in ("amp-float16", "torch-float16") if "median_ms" in r.get(m, {})]
        inter = r.get("interleaved", {}).get("amp-float16")
        if inter:
            parts.append(f"interleaved: amp median {inter['median_ms']:.1f} max {inter['max_ms']:.1f}, blocks cut "
                         f"{sum(inter['triton_cuts_built_per_step'])}; overhead {r['overhead_median_interleaved']:.3f}")
        return "; ".join(parts)
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = str(Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else "gpu_check.json"
    parser.add_argument("--json", default=default, help=f"where the JSON goes (default: {default})")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on any device (a CPU: under a minute)")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for the whole run (default {TOTAL_BUDGET:g}; {SMOKE_BUDGET:g} with --smoke)")
    parser.add_argument("--parts", default=None, help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--models", default=None, help="the memory and time parts' models (default: "
                        f"{','.join(BENCH_MODELS)})")
    parser.add_argument("--modes", default=None, help="the memory and time parts' modes (fp32 always runs; "
                        f"default: {','.join(TIME_MODES)})")
    args = parser.parse_args(argv)
    only = [p.strip() for p in args.parts.split(",")] if args.parts else None
    if only and (bad := [p for p in only if p not in PARTS]):
        parser.error(f"--parts: unknown part {', '.join(bad)}; choose from {', '.join(PARTS)}")
    total = args.budget if args.budget is not None else (SMOKE_BUDGET if args.smoke else TOTAL_BUDGET)
    if not args.smoke:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: run on a GPU, or with --smoke to check the script", file=sys.stderr)
            return 2
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    installed = ensure_installed()
    if installed:
        print(installed, file=sys.stderr)
    split = (lambda text: [t.strip() for t in text.split(",") if t.strip()] if text else None)  # noqa: E731
    result = run(args.json, args.smoke, total, only, split(args.models), split(args.modes))
    result["header"]["install"] = installed
    Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    print(table(result))
    print(f"\nwritten: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
