"""``amp-backends bench``: what AMP buys on this machine, per model, with its uncertainty.

Training steps (forward, loss, backward, AdamW) of each model are timed in every mode, the modes
interleaved round by round after warm-up, so that drift of the machine hits them alike:

- ``fp32``; ``tf32`` (fp32 with TF32 matmuls and convolutions, on CUDA compute capability 8.0+;
  elsewhere the row says n/a and why);
- ``amp-<dtype>`` for each autocast dtype of the backend, through amp_backends (autocast and
  the backend's scaler);
- ``torch-<dtype>``: the same step through raw ``torch.autocast`` + ``torch.amp.GradScaler``,
  so ``overhead_vs_torch`` is the adapter's cost (median of per-round ratios, with its
  interquartile range and full range);
- ``lean-bf16`` (:func:`amp_backends.memory_lean`, fp32 masters), ``lean-bf16-max`` (the same with
  the exact levers off by default, ``activation_inputs=True`` and ``dropout_masks=True``: models with a
  GELU, SiLU or Mish module beside a linear, or a dropout), ``lean-bf16-rc`` (the same with
  ``recompute=True``: models with repeated blocks) and ``lean-bf16-sr``
  (:class:`~amp_backends.memory.StochasticAdamW` rounding bf16 stochastically, no masters);
- ``amp-fp8``, ``torchao-fp8`` and their baseline ``bf16-fp8-baseline`` where the device has fp8
  matmuls, compiled as torchao documents (:mod:`amp_backends.cli.bench_fp8`); elsewhere the rows say why.

Each round times several consecutive steps of one mode on an accelerator (``steps_per_round``:
enough for ``ROUND_SECONDS`` of them, timed by the device's events where it has them), one on a CPU; the
default 20 rounds at full size are meant to give the overhead ratios an interquartile range narrower
than 2% (``overhead_iqr_width`` per model says whether they did).
Speedups are medians of per-round ratios (the modes of one round ran back to back), with the
interquartile range of those ratios; a verdict ("faster", "slower") is given only when that
range lies wholly on one side of 1 by ``MARGIN``, else "no clear difference". Where both a mode's step and
fp32's are shorter than ``HOST_BOUND_MS``, kernel launches and host work decide them, not the
device's arithmetic: that row carries no verdict, and a model all of whose steps are that short
gets no recommendation but a pointer to the real-size models. Dtypes the device emulates are measured in fewer rounds and labelled.

Peak memory is each mode's alone: before the timed rounds, every mode is built with its own model and
optimizer, nothing else alive, and measured as ``bench --memory`` measures it
(:func:`amp_backends.cli.bench_memory.measure_alone`): the allocator's peak (after a reset) where the
device keeps one, on a CPU the ledger's (:mod:`amp_backends.memory.ledger`: every storage live at the
step's peak, counted on fake tensors at the measured size). The savings and the recommendation's come
from these figures. ``--memory`` gives the ledger of each model at its full size and real batch, by part.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import platform
import statistics
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..backend import Backend
from .bench_models import DEFAULT_MODELS, MODELS, Mode
from ..errors import PerformanceWarning
from ..memory.lean import memory_lean
from ..memory.sr_adamw import StochasticAdamW
from ..registry.registry import get
from .bench_measure import (  # noqa: F401 - the round's constants and peak_memory stay importable from here
    MAX_STEPS_PER_ROUND,
    MIN_STEPS_PER_ROUND,
    ROUND_SECONDS,
    free,
    memory_alone,
    peak_memory,
    step_timer,
    steps_per_round,
)
from .bench_memory import LEAN_HEADS, mode_unavailable, peak_kind
from .bench_report import list_models, plot, render

__all__ = ["DEFAULT_MODELS", "HOST_BOUND_MS", "MAX_STEPS_PER_ROUND", "MIN_STEPS_PER_ROUND", "Mode", "ROUND_SECONDS",
           "memory_alone", "modes_for", "peak_memory", "run", "recommend", "render", "list_models", "step_timer",
           "steps_per_round"]

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


#: the lean modes' ways of training (each compared with plain AMP's step in the same rounds)
LEAN_VIAS = ("lean", "lean-max", "lean-rc", "lean-sr")


def modes_for(be: Backend) -> list[Mode]:
    """The modes this backend's device can run, and the TF32, stochastic-rounding and fp8 rows either way."""
    native = be.native_dtypes()
    modes = [Mode("fp32", "full"), Mode("tf32", "full", unavailable=tf32_unavailable(be))]
    for dtype in (torch.float16, torch.bfloat16):
        if dtype in be.supported_dtypes():
            name = _dtype_name(dtype)
            modes += [Mode(f"amp-{name}", "amp", dtype, dtype in native), Mode(f"torch-{name}", "torch", dtype, dtype in native)]
    if torch.bfloat16 in be.supported_dtypes():
        bf16 = torch.bfloat16 in native
        modes.append(Mode("lean-bf16", "lean", torch.bfloat16, bf16))
        modes.append(Mode("lean-bf16-max", "lean-max", torch.bfloat16, bf16))
        modes.append(Mode("lean-bf16-rc", "lean-rc", torch.bfloat16, bf16))
        modes.append(Mode("lean-bf16-sr", "lean-sr", torch.bfloat16, bf16))
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


def make_step(be: Backend, model: torch.nn.Module, opt: torch.optim.Optimizer,
              loss_of: Callable[[torch.nn.Module, Any, Any], torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor],
              mode: Mode, lm_head: str | None = None) -> Callable[[], None]:
    """One training step of ``model`` in ``mode`` (the model and optimizer are shared by the fp32, TF32,
    AMP and torch.amp modes; the lean modes train a copy of their own, its weights bf16).
    ``loss_of(model, inputs, targets)`` is the model's loss. The step carries its ``model`` and ``optimizer``."""
    x, y = batch
    if mode.via == "full":
        tf32 = mode.name == "tf32"

        def full_step() -> None:
            with _tf32(tf32):
                opt.zero_grad(set_to_none=True)
                loss_of(model, x, y).backward()
                opt.step()
        full_step.model, full_step.optimizer = model, opt  # type: ignore[attr-defined]  # the step carries what the ledger classifies
        return full_step
    fp16 = mode.dtype == torch.float16
    net, optimizer = model, opt
    if mode.via in ("lean", "lean-max", "lean-rc"):
        net = copy.deepcopy(model)
        lean = memory_lean(net, torch.optim.AdamW(net.parameters(), lr=1e-5), backend=be, weights=torch.bfloat16,
                           lm_head=lm_head, recompute=mode.via == "lean-rc", activation_inputs=mode.via == "lean-max",
                           dropout_masks=mode.via == "lean-max")
        optimizer = lean.optimizer
    elif mode.via == "lean-sr":
        net = copy.deepcopy(model)
        optimizer = memory_lean(net, StochasticAdamW(net.parameters(), lr=1e-5), backend=be, weights=torch.bfloat16,
                                master=False, lm_head=lm_head).optimizer
    if mode.via == "amp" or mode.via in LEAN_VIAS:
        scaler: Any = be.grad_scaler(mode.dtype)
        autocast: Callable[[], Any] = lambda: be.autocast(mode.dtype)  # noqa: E731 - one of two one-line choices
    else:
        scaler = torch.amp.GradScaler(be.device_type, enabled=fp16)
        autocast = lambda: torch.autocast(be.device_type, dtype=mode.dtype)  # noqa: E731 - one of two one-line choices

    def amp_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_of(net, x, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    amp_step.model, amp_step.optimizer = net, optimizer  # type: ignore[attr-defined]  # the step carries what the ledger classifies
    return amp_step


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
                be.empty_cache()


def run(backend: str | None, models: Sequence[str] = DEFAULT_MODELS, size: str = "auto", rounds: int | None = None,
        warmup: int = 2, scale: float = 1.0, progress: bool = False, steps: int | None = None,
        modes: Sequence[str] | None = None,
        memory_cache: dict[tuple[str, str, int, str], tuple[int, str]] | None = None) -> dict[str, Any]:
    """Measure every mode on every model; return the result as a JSON-ready dict. ``steps``: steps per
    round (None: :func:`steps_per_round`); ``modes``: the modes to run (None: all; fp32 always runs);
    ``memory_cache``: (model, size, batch, mode) -> (peak bytes, kind) already measured alone by
    ``bench --memory``'s :func:`~.bench_memory.measure_alone` (TF32 is read as fp32), not measured again."""
    be = get(backend)
    if size == "auto":
        size = "small" if be.device_type == "cpu" else "full"
    if rounds is None:
        rounds = 5 if size == "small" else 20
    all_modes = [m for m in modes_for(be) if modes is None or m.name == "fp32" or m.name in modes]
    runnable = [m for m in all_modes if m.unavailable is None]
    per_model = sum((rounds if m.native else min(rounds, EMULATED_ROUNDS)) + warmup + 1 for m in runnable)
    bar = _Progress(per_model * len(models), progress)
    timer, timer_kind = step_timer(be)
    rows: list[dict[str, Any]] = []
    notes: dict[str, dict[str, Any]] = {}
    try:
        for name in models:
            spec = MODELS[name]
            target = max(1, round(spec.batch_sizes[size] * scale))

            lever_finds_nothing = {m.name: why for m in runnable if (why := mode_unavailable(name, m.name))}
            here = [m for m in runnable if m.name not in lever_finds_nothing]

            def measure_memory(batch: int) -> dict[str, tuple[int, str]]:
                memory = {}
                for m in here:  # each mode alone: its own model and optimizer, nothing else alive
                    known = (memory_cache or {}).get((name, size, batch, "fp32" if m.name == "tf32" else m.name))
                    if known is not None:
                        memory[m.name] = known
                        continue
                    bar.start(f"{name}: peak memory of {m.name} alone")
                    memory[m.name] = memory_alone(be, name, size, batch, m)
                    free(be)
                return memory

            def build(batch: int) -> Any:
                memory = measure_memory(batch)
                torch.manual_seed(0)
                model = spec.build(size).to(be.device())
                opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
                data = spec.batch(size, be.device(), batch)
                steps_of = {m.name: make_step(be, model, opt, spec.loss_of, data, m, LEAN_HEADS.get(name))
                            for m in here if not _fp8(m)}
                reasons = dict(lever_finds_nothing)
                if any(_fp8(m) for m in runnable):
                    from .bench_fp8 import make_fp8_steps

                    fp8_steps, why_not = make_fp8_steps(be, model, spec.loss_of, data,
                                                        modes=[m.name for m in runnable if _fp8(m)])
                    steps_of.update(fp8_steps)
                    reasons.update({m.name: why_not for m in runnable if _fp8(m) and why_not})
                for m in runnable:
                    bar.step()
                return model, steps_of, {k: v for k, v in memory.items() if k in steps_of}, reasons

            (model, steps_of, memory, reasons), batch = _fit(be, name, size, target, build)
            active = [m for m in runnable if m.name in steps_of]
            params = sum(p.numel() for p in model.parameters())
            bar.start(f"{name}: warm-up")
            warm_s = 0.0
            for m in active:
                for _ in range(warmup):
                    t = timer(steps_of[m.name], 1)
                    warm_s = t if m.name == "fp32" else warm_s
                    bar.step()
            k = steps if steps is not None else steps_per_round(be, warm_s)
            times: dict[str, list[float]] = {m.name: [] for m in active}
            for r in range(rounds):
                bar.start(f"{name}: round {r + 1}/{rounds}")
                order = active if r % 2 == 0 else active[::-1]
                for m in order:
                    if not m.native and r >= EMULATED_ROUNDS:
                        continue  # emulated: measured briefly, labelled
                    times[m.name].append(timer(steps_of[m.name], 1 if not m.native else k))
                    bar.step()
            compiled = {n for n, st in steps_of.items() if getattr(st, "compiled", False)}
            del model, steps_of
            free(be)
            mine = _rows(name, params, all_modes, times, memory, reasons, compiled)
            rows += mine
            longest_ms = 1e3 * max(statistics.median(t) for t in times.values())
            widths = [r["overhead_vs_torch_iqr"][1] - r["overhead_vs_torch_iqr"][0] for r in mine
                      if r.get("overhead_vs_torch_iqr")]
            notes[name] = {"batch": batch, "input": spec.shapes[size], "size": size, "steps_per_round": k,
                           "host_bound": longest_ms < HOST_BOUND_MS,
                           "overhead_iqr_width": max(widths) if widths else None}
    finally:
        bar.close()
    base_ms = {(r["model"], r["mode"]): r["step_ms"] for r in rows if r["mode"] in ("fp32", "bf16-fp8-baseline")}
    for row in rows:  # both steps of a few ms: launches and host work decide, not the arithmetic
        fp8 = row["via"] in _FP8_VIAS
        if fp8 and not (row.get("compiled") and row.get("speedup_vs_bf16")):
            continue  # an eager or unavailable fp8 row, or their baseline: its verdict already says why
        base = base_ms.get((row["model"], "bf16-fp8-baseline" if fp8 else "fp32"))
        if row["step_ms"] is not None and base is not None and max(row["step_ms"], base) < HOST_BOUND_MS:
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
        "timer": timer_kind,
        "memory": "each mode alone (its own model and optimizer; bench --memory's measurement of the same "
                  f"model, mode and batch): {peak_kind(be.max_memory_allocated() is not None)}",
        "models": notes,
        "rows": rows,
        "recommendation": recommend(rows, notes),
    }


#: the ``via`` of the fp8 rows (compared with their bf16 baseline, not fp32)
_FP8_VIAS = ("amp-fp8", "torchao-fp8", "fp8-baseline")


def _fp8(mode: Mode) -> bool:
    return mode.via in _FP8_VIAS


def _iqr(ratios: Sequence[float]) -> dict[str, Any]:
    """A ratio's median, interquartile range and full range over the rounds."""
    low, mid, high = _quartiles(ratios)
    return {"median": mid, "iqr": [low, high], "range": [min(ratios), max(ratios)]}


def _rows(model: str, params: int, modes: list[Mode], times: dict[str, list[float]],
          memory: dict[str, tuple[int, str]], reasons: dict[str, str] | None = None,
          compiled: set[str] | frozenset[str] = frozenset()) -> list[dict[str, Any]]:
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
                over = _iqr(_ratios(t, theirs))
                row.update(overhead_vs_torch=over["median"], overhead_vs_torch_iqr=over["iqr"],
                           overhead_vs_torch_range=over["range"])
        if m.via in LEAN_VIAS and times.get(f"amp-{_dtype_name(m.dtype)}"):
            row["vs_amp"] = statistics.median(_ratios(t, times[f"amp-{_dtype_name(m.dtype)}"]))
        if _fp8(m):
            row["compiled"] = m.name in compiled
            if m.via == "fp8-baseline":
                row["verdict"] = "the fp8 rows' baseline"
            elif times.get("bf16-fp8-baseline"):
                fp8_speed = _iqr(_ratios(times["bf16-fp8-baseline"], t))
                row.update(speedup_vs_bf16=fp8_speed["median"], speedup_vs_bf16_iqr=fp8_speed["iqr"])
                row["verdict"] = (verdict(*fp8_speed["iqr"]) + " than bf16 (both compiled)" if row["compiled"]
                                  else "eager: no fp8 verdict (torchao's fp8 is measured compiled)")
        if m.via == "amp-fp8" and times.get("torchao-fp8"):
            over = _iqr(_ratios(t, times["torchao-fp8"]))
            row.update(overhead_vs_torchao=over["median"], overhead_vs_torchao_iqr=over["iqr"])
        rows.append(row)
    return rows


def recommend(rows: list[dict[str, Any]], notes: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Per model: the fastest mode measured (fp32, TF32 or an AMP dtype through amp_backends),
    whether the rounds show it clearly, and each mode's peak memory."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and r.get("step_ms") is not None
                and r["via"] != "torch" and r["via"] not in _FP8_VIAS]
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
            **_fp8_advice(rows, model),
        })
    return out


def _fp8_advice(rows: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """The fp8 line of a model's recommendation: fp8 through amp_backends against bf16, both compiled,
    where that was measured (eager fp8 rows give none)."""
    row = next((r for r in rows if r["model"] == model and r["mode"] == "amp-fp8" and r.get("speedup_vs_bf16")), None)
    if row is None:
        return {}
    return {"fp8": {"speedup_vs_bf16": row["speedup_vs_bf16"], "iqr": row["speedup_vs_bf16_iqr"],
                    "compiled": row["compiled"], "verdict": row["verdict"]}}


def _clearly_faster(best: dict[str, Any], runner: dict[str, Any]) -> bool:
    """Whether ``best`` beats ``runner`` beyond the rounds' spread: the interquartile range of
    their per-round step-time ratios (runner / best, rounds run back to back) clears 1."""
    ratios = _ratios(runner["step_ms_rounds"], best["step_ms_rounds"])
    return bool(ratios) and _quartiles(ratios)[0] > 1 + MARGIN


def main(backend: str | None, models: Sequence[str], size: str, rounds: int | None, warmup: int, scale: float,
         as_json: bool, plot_path: str | None, steps: int | None = None) -> int:
    """Run and print the bench (the CLI has checked the arguments)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)  # the table says which dtypes are native
        result = run(backend, models, size, rounds, warmup, scale, progress=True, steps=steps)
    if plot_path:
        plot(result, plot_path)
    print(json.dumps(result, indent=2) if as_json else render(result))
    return 0
