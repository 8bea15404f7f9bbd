"""``amp-backends bench``: what AMP buys on this machine, per model, with its uncertainty.

One training step (forward, loss, backward, AdamW) of each model is timed in every mode, the
modes interleaved round by round after warm-up, so that drift of the machine hits them alike:

- ``fp32``; ``tf32`` (fp32 with TF32 matmuls and convolutions, on CUDA compute capability 8.0+;
  elsewhere the row says n/a and why);
- ``amp-<dtype>`` for each autocast dtype of the backend, through amp_backends (autocast and
  the backend's scaler);
- ``torch-<dtype>``: the same step through raw ``torch.autocast`` + ``torch.amp.GradScaler``,
  so ``overhead_vs_torch`` is the adapter's cost;
- ``amp-fp8`` and ``torchao-fp8`` where the device has fp8 matmuls: the fp8 recipe's Linear layers in
  fp8 under bf16 autocast, through a precision policy and through torchao directly
  (``overhead_vs_torchao``); elsewhere the rows say why (:mod:`amp_backends.cli.bench_fp8`).

Speedups are medians of per-round ratios (the modes of one round ran back to back), with the
interquartile range of those ratios; a verdict ("faster", "slower") is given only when that
range lies wholly on one side of 1, else "no clear difference". Where both a mode's step and
fp32's are shorter than ``HOST_BOUND_MS``, kernel launches and host work decide them, not the
device's arithmetic: that row carries no verdict, and a model all of whose steps are that short
gets no recommendation but a pointer to the real-size models. Dtypes the device emulates are measured in fewer rounds and labelled.

Peak memory is the device allocator's peak where the device has one; on a CPU it is the ledger's
(:mod:`amp_backends.memory.ledger`): every storage live at the step's peak, parameters, gradients and
optimizer state included, counted through a real step at the measured size. ``--memory`` gives the
ledger of each model at its full size and real batch, by part (:mod:`amp_backends.cli.bench_memory`).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..backend import Backend
from .bench_models import MODELS, REAL_MODELS, Mode
from ..errors import PerformanceWarning
from ..memory.lean import memory_lean
from ..memory.ledger import Ledger
from ..registry.registry import get
from .bench_memory import LEAN_HEADS
from .bench_report import list_models, plot, render

__all__ = ["DEFAULT_MODELS", "HOST_BOUND_MS", "Mode", "modes_for", "run", "recommend", "render", "list_models"]

DEFAULT_MODELS = tuple(REAL_MODELS)
#: Steps shorter than this are launch- and host-bound: no speed verdict from them.
HOST_BOUND_MS = 10.0
#: Rounds for a dtype the device emulates (many times slower than fp32): enough to show that.
EMULATED_ROUNDS = 2
#: A ratio's interquartile range must clear 1 by this much for a verdict.
MARGIN = 0.02


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "float32" if dtype is None else str(dtype).replace("torch.", "")


def tf32_unavailable(be: Backend) -> str | None:
    """Why TF32 cannot run on this backend's device, or None where it can."""
    if be.device_type != "cuda":
        return f"TF32 is a CUDA tensor-core mode; {be.name} has none"
    if getattr(torch.version, "hip", None):
        return "not measured on ROCm (TF32 there depends on the hipBLASLt build)"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"TF32 needs compute capability 8.0 (Ampere) or newer; this GPU is {major}.{minor}"
    return None


def modes_for(be: Backend) -> list[Mode]:
    """The modes this backend's device can run, and the TF32 row either way."""
    native = be.native_dtypes()
    modes = [Mode("fp32", "full"), Mode("tf32", "full", unavailable=tf32_unavailable(be))]
    for dtype in (torch.float16, torch.bfloat16):
        if dtype in be.supported_dtypes():
            name = _dtype_name(dtype)
            modes += [Mode(f"amp-{name}", "amp", dtype, dtype in native), Mode(f"torch-{name}", "torch", dtype, dtype in native)]
    if torch.bfloat16 in be.supported_dtypes():
        modes.append(Mode("lean-bf16", "lean", torch.bfloat16, torch.bfloat16 in native))
    from .bench_fp8 import FP8_MODES, fp8_unavailable

    why_not = fp8_unavailable(be)
    modes += [Mode(name, via, torch.bfloat16, unavailable=why_not) for name, via in FP8_MODES]
    return modes


@contextlib.contextmanager
def _tf32(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def make_step(be: Backend, model: torch.nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
              batch: tuple[torch.Tensor, torch.Tensor], mode: Mode, lm_head: str | None = None) -> Callable[[], None]:
    """One training step of ``model`` in ``mode`` (the model and optimizer are shared by the modes; the lean
    mode trains a copy of its own, its weights bf16). The step carries its ``model`` and ``optimizer``."""
    x, y = batch
    if mode.via == "full":
        tf32 = mode.name == "tf32"

        def full_step() -> None:
            with _tf32(tf32):
                opt.zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                opt.step()
        full_step.model, full_step.optimizer = model, opt  # type: ignore[attr-defined]  # the step carries what the ledger classifies
        return full_step
    fp16 = mode.dtype == torch.float16
    net, optimizer = model, opt
    if mode.via == "lean":
        net = copy.deepcopy(model)
        lean = memory_lean(net, torch.optim.AdamW(net.parameters(), lr=1e-5), backend=be, weights=torch.bfloat16,
                           lm_head=lm_head)
        optimizer = lean.optimizer
    if mode.via in ("amp", "lean"):
        scaler: Any = be.grad_scaler(mode.dtype)
        autocast: Callable[[], Any] = lambda: be.autocast(mode.dtype)  # noqa: E731 - one of two one-line choices
    else:
        scaler = torch.amp.GradScaler(be.device_type, enabled=fp16)
        autocast = lambda: torch.autocast(be.device_type, dtype=mode.dtype)  # noqa: E731 - one of two one-line choices

    def amp_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_fn(net(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    amp_step.model, amp_step.optimizer = net, optimizer  # type: ignore[attr-defined]  # the step carries what the ledger classifies
    return amp_step


def peak_memory(be: Backend, step: Callable[[], None]) -> tuple[int, str]:
    """Peak bytes of one step: the allocator's peak where the device keeps one, else the ledger's (every
    storage live at the step's peak, the first step's optimizer state made before it)."""
    be.synchronize()
    be.reset_peak_memory_stats()
    if be.max_memory_allocated() is not None:
        step()
        be.synchronize()
        return int(be.max_memory_allocated() or 0), "allocator peak"
    model, optimizer = step.model, step.optimizer  # type: ignore[attr-defined]  # set on the step function above
    step()  # the optimizer's state exists from here, as in every later step
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    masters = list(getattr(optimizer, "masters", {}).values())
    params = list(model.parameters())
    ledger = Ledger()
    ledger.register([*model.buffers(), *state, *masters, *[p.grad for p in params if p.grad is not None]],
                    params=params)
    with ledger:
        step()
    return ledger.peak, "ledger peak (every storage)"


def _quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    if len(ordered) < 4:
        return ordered[0], statistics.median(ordered), ordered[-1]
    q = statistics.quantiles(ordered, n=4, method="inclusive")
    return q[0], q[1], q[2]


def _ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Per-round ratios num/den over the rounds both modes ran."""
    return [a / b for a, b in zip(num, den)]


def verdict(low: float, high: float) -> str:
    """'faster' / 'slower' when the ratio's range lies wholly on one side of 1, else no verdict."""
    if low > 1 + MARGIN:
        return "faster"
    if high < 1 - MARGIN:
        return "slower"
    return "no clear difference"


class _Progress:
    """Progress on stderr: a live bar on a terminal, else one line per model and mode."""

    def __init__(self, total: int, enabled: bool) -> None:
        from ..console import ProgressBar

        self.bar = ProgressBar(total, enabled)
        self.done = 0
        self.what = ""

    def start(self, what: str) -> None:
        self.what = what
        self.bar.line(lambda: {"bench": what})

    def step(self) -> None:
        self.done += 1
        self.bar.update(self.done, lambda: {"now": self.what})

    def close(self) -> None:
        self.bar.close()


def _oom(exc: BaseException) -> bool:
    return isinstance(exc, getattr(torch, "OutOfMemoryError", ())) or "out of memory" in str(exc).lower()


def _fit(be: Backend, name: str, size: str, batch: int, make: Callable[[int], Any]) -> tuple[Any, int]:
    """Build the model's steps at ``batch``, halving it until one step of every mode fits the
    device's memory (accelerators only; a CPU takes what it is given)."""
    while True:
        try:
            return make(batch), batch
        except (RuntimeError, MemoryError) as exc:
            if not _oom(exc) or batch <= 1:
                raise
            batch //= 2
            if be.device_type != "cpu":
                getattr(torch, be.device_type).empty_cache()


def run(backend: str | None, models: Sequence[str] = DEFAULT_MODELS, size: str = "auto", rounds: int | None = None,
        warmup: int = 2, scale: float = 1.0, progress: bool = False) -> dict[str, Any]:
    """Measure every mode on every model; return the result as a JSON-ready dict."""
    be = get(backend)
    if size == "auto":
        size = "small" if be.device_type == "cpu" else "full"
    if rounds is None:
        rounds = 5 if size == "small" else 20
    modes = modes_for(be)
    runnable = [m for m in modes if m.unavailable is None]
    per_model = sum((rounds if m.native else min(rounds, EMULATED_ROUNDS)) + warmup + 1 for m in runnable)
    bar = _Progress(per_model * len(models), progress)
    rows: list[dict[str, Any]] = []
    notes: dict[str, dict[str, Any]] = {}
    try:
        for name in models:
            spec = MODELS[name]
            target = max(1, round(spec.batch_sizes[size] * scale))

            def build(batch: int) -> Any:
                torch.manual_seed(0)
                model = spec.build(size).to(be.device())
                opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
                data = spec.batch(size, be.device(), batch)
                steps = {m.name: make_step(be, model, opt, spec.loss, data, m, LEAN_HEADS.get(name))
                         for m in runnable if not _fp8(m)}
                reasons = {}
                if any(_fp8(m) for m in runnable):
                    from .bench_fp8 import make_fp8_steps

                    fp8_steps, why_not = make_fp8_steps(be, model, spec.loss, data)
                    steps.update(fp8_steps)
                    reasons.update({m.name: why_not for m in runnable if _fp8(m) and why_not})
                bar.start(f"{name}: peak memory")
                memory = {}
                for m in runnable:
                    if m.name in steps:
                        memory[m.name] = peak_memory(be, steps[m.name])
                    bar.step()
                return model, steps, memory, reasons

            (model, steps, memory, reasons), batch = _fit(be, name, size, target, build)
            active = [m for m in runnable if m.name in steps]
            params = sum(p.numel() for p in model.parameters())
            bar.start(f"{name}: warm-up")
            for m in active:
                for _ in range(warmup):
                    steps[m.name]()
                    bar.step()
            times: dict[str, list[float]] = {m.name: [] for m in active}
            for r in range(rounds):
                bar.start(f"{name}: round {r + 1}/{rounds}")
                order = active if r % 2 == 0 else active[::-1]
                for m in order:
                    if not m.native and r >= EMULATED_ROUNDS:
                        continue  # emulated: measured briefly, labelled
                    be.synchronize()
                    t0 = time.perf_counter()
                    steps[m.name]()
                    be.synchronize()
                    times[m.name].append(time.perf_counter() - t0)
                    bar.step()
            del model, steps
            rows += _rows(name, params, modes, times, memory, reasons)
            longest_ms = 1e3 * max(statistics.median(t) for t in times.values())
            notes[name] = {"batch": batch, "input": spec.shapes[size], "size": size,
                           "host_bound": longest_ms < HOST_BOUND_MS}
    finally:
        bar.close()
    fp32_ms = {r["model"]: r["step_ms"] for r in rows if r["mode"] == "fp32"}
    for row in rows:  # both steps of a few ms: launches and host work decide, not the arithmetic
        if row["step_ms"] is not None and max(row["step_ms"], fp32_ms[row["model"]]) < HOST_BOUND_MS:
            row["verdict"] = "host-bound: no verdict"
    if be.device_type == "cuda":
        device_name = torch.cuda.get_device_name()
    else:
        device_name = f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    return {
        "backend": be.name,
        "device": device_name,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "size": size,
        "rounds": rounds,
        "emulated_rounds": EMULATED_ROUNDS,
        "warmup": warmup,
        "models": notes,
        "rows": rows,
        "recommendation": recommend(rows, notes),
    }


def _fp8(mode: Mode) -> bool:
    return mode.via in ("amp-fp8", "torchao-fp8")


def _rows(model: str, params: int, modes: list[Mode], times: dict[str, list[float]],
          memory: dict[str, tuple[int, str]], reasons: dict[str, str] | None = None) -> list[dict[str, Any]]:
    fp32 = times["fp32"]
    full = [m.name for m in modes if m.via == "full" and m.name in times]
    best_full = min(full, key=lambda n: statistics.median(times[n]))
    fp32_mem = memory["fp32"][0]
    rows = []
    for m in modes:
        row: dict[str, Any] = {"model": model, "params": params, "mode": m.name, "via": m.via,
                               "dtype": _dtype_name(m.dtype) if m.via != "full" else m.name, "native": m.native}
        if m.name not in times:
            row.update(step_ms=None, peak_mem_bytes=None, speedup_vs_fp32=None, speedup_vs_best_full_precision=None,
                       unavailable=m.unavailable or (reasons or {}).get(m.name), verdict="n/a")
            rows.append(row)
            continue
        t = times[m.name]
        low, mid, high = _quartiles(_ratios(fp32, t))
        peak = memory[m.name][0]
        row.update(
            step_ms=1e3 * statistics.median(t),
            step_ms_range=[1e3 * min(t), 1e3 * max(t)],
            step_ms_rounds=[1e3 * x for x in t],
            rounds=len(t),
            peak_mem_bytes=peak,
            mem_saving_pct=100 * (1 - peak / fp32_mem) if fp32_mem else 0.0,
            memory_kind=memory[m.name][1],
            speedup_vs_fp32=mid,
            speedup_vs_fp32_iqr=[low, high],
            speedup_vs_best_full_precision=statistics.median(_ratios(times[best_full], t)),
            verdict=verdict(low, high) if m.name != "fp32" else "baseline",
        )
        if m.via == "amp":
            theirs = times.get(f"torch-{_dtype_name(m.dtype)}")
            if theirs:
                row["overhead_vs_torch"] = statistics.median(_ratios(t, theirs))
        if m.via == "lean" and times.get(f"amp-{_dtype_name(m.dtype)}"):
            row["vs_amp"] = statistics.median(_ratios(t, times[f"amp-{_dtype_name(m.dtype)}"]))
        if m.via == "amp-fp8" and times.get("torchao-fp8"):
            row["overhead_vs_torchao"] = statistics.median(_ratios(t, times["torchao-fp8"]))
        rows.append(row)
    return rows


def recommend(rows: list[dict[str, Any]], notes: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Per model: the fastest mode measured (fp32, TF32 or an AMP dtype through amp_backends),
    whether the rounds show it clearly, and each mode's peak memory."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and r.get("step_ms") is not None
                and r["via"] not in ("torch", "torchao-fp8")]
        ranked = sorted(mine, key=lambda r: r["step_ms"])
        best, runner = ranked[0], (ranked[1] if len(ranked) > 1 else None)
        host_bound = bool((notes or {}).get(model, {}).get("host_bound"))
        clear = runner is not None and not host_bound and _clearly_faster(best, runner)
        if host_bound:
            why = (f"every step takes under {HOST_BOUND_MS:g} ms: launches and host work, not the device's "
                   "arithmetic, decide them. Measure a real-size model (--models resnet50,bert-base,gpt2-small)")
        elif clear:
            why = f"faster than {runner['mode']} in the rounds' interquartile range"
        else:
            why = f"within the rounds' spread of {runner['mode']}: no clear difference" if runner else "only mode measured"
        out.append({
            "model": model,
            "fastest": best["mode"],
            "clear": clear,
            "speedup_vs_fp32": best["speedup_vs_fp32"],
            "why": why,
            "peak_mem_bytes": {r["mode"]: r["peak_mem_bytes"] for r in mine},
            "mem_saving_pct": {r["mode"]: r["mem_saving_pct"] for r in mine if r["mode"] != "fp32"},
        })
    return out


def _clearly_faster(best: dict[str, Any], runner: dict[str, Any]) -> bool:
    """Whether ``best`` beats ``runner`` beyond the rounds' spread: the interquartile range of
    their per-round step-time ratios (runner / best, rounds run back to back) clears 1."""
    ratios = _ratios(runner["step_ms_rounds"], best["step_ms_rounds"])
    return bool(ratios) and _quartiles(ratios)[0] > 1 + MARGIN


def main(backend: str | None, models: Sequence[str], size: str, rounds: int | None, warmup: int, scale: float,
         as_json: bool, plot_path: str | None) -> int:
    """Run and print the bench (the CLI has checked the arguments)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)  # the table says which dtypes are native
        result = run(backend, models, size, rounds, warmup, scale, progress=True)
    if plot_path:
        plot(result, plot_path)
    print(json.dumps(result, indent=2) if as_json else render(result))
    return 0
