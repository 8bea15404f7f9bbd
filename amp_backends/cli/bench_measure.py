"""How the time bench measures one mode: its peak memory alone (``bench --memory``'s measurement of the
same model, mode and batch, or for the fp8 rows their step built alone), and a round's steps timed by
the device's events or the host clock."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable

import torch

from ..backend import Backend
from ..memory.ledger import Ledger
from .bench_memory import measure_alone, peak_kind
from .bench_models import MODELS
from .bench_spec import Mode

__all__ = ["MAX_STEPS_PER_ROUND", "MIN_STEPS_PER_ROUND", "ROUND_SECONDS", "free", "memory_alone", "peak_memory",
           "step_timer", "steps_per_round"]

#: On an accelerator each round times at least this long a run of steps of one mode...
ROUND_SECONDS = 0.2
#: ...and between these many steps.
MIN_STEPS_PER_ROUND, MAX_STEPS_PER_ROUND = 3, 16


def peak_memory(be: Backend, step: Callable[[], None], baseline: int = 0) -> tuple[int, str]:
    """Peak bytes of one step whose model and optimizer are the only ones alive: the allocator's peak where
    the device keeps one (after a first step has made the optimizer's state), above ``baseline`` (what
    was allocated before the step's model was built), else the ledger's (every storage live at the
    step's peak)."""
    step()  # the optimizer's state exists from here, as in every later step
    be.synchronize()
    be.reset_peak_memory_stats()
    if be.max_memory_allocated() is not None:
        step()
        be.synchronize()
        return int(be.max_memory_allocated() or 0) - baseline, peak_kind(True)
    model, optimizer = step.model, step.optimizer  # type: ignore[attr-defined]
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    masters = list(getattr(optimizer, "masters", {}).values())
    params = list(model.parameters())
    ledger = Ledger()
    ledger.register([*model.buffers(), *state, *masters, *[p.grad for p in params if p.grad is not None]],
                    params=params)
    with ledger:
        step()
    return ledger.peak, peak_kind(False)


def memory_alone(be: Backend, name: str, size: str, batch: int, mode: Mode) -> tuple[int, str]:
    """Mode ``mode``'s peak training memory on bench model ``name``, with its own model and optimizer the
    only ones alive: ``bench --memory``'s measurement of the same model, mode and batch
    (:func:`~.bench_memory.measure_alone`: the allocator's peak on an accelerator, the ledger's on a CPU;
    TF32 counted as fp32, whose storages it shares); the fp8 rows' steps built alone and measured the
    same way."""
    if mode.via in ("amp-fp8", "torchao-fp8", "fp8-baseline"):
        from .bench_fp8 import make_fp8_steps

        spec = MODELS[name]
        free(be)
        baseline = be.memory_allocated() or 0
        torch.manual_seed(0)
        model = spec.build(size).to(be.device())
        data = spec.batch(size, be.device(), batch)
        steps, _ = make_fp8_steps(be, model, spec.loss_of, data, modes=[mode.name])
        del model
        if mode.name not in steps:
            return 0, "-"
        try:
            return peak_memory(be, steps[mode.name], baseline)
        finally:
            del steps
            free(be)
    report, allocator, _ = measure_alone(be, name, size, batch, "fp32" if mode.name == "tf32" else mode.name)
    if allocator is not None:
        return allocator, peak_kind(True)
    return report.peak, peak_kind(False)


def free(be: Backend) -> None:
    gc.collect()
    if be.device_type != "cpu":
        be.empty_cache()


def step_timer(be: Backend) -> tuple[Callable[[Callable[[], None], int], float], str]:
    """A timer of ``k`` consecutive steps (seconds per step): the device's events where it has them
    (what ran on the device's stream between the first step's start and the last one's end), else the
    host clock between device syncs."""
    module = getattr(torch, be.device_type, None) if be.device_type != "cpu" else None
    event = getattr(module, "Event", None)
    if event is not None:
        def by_events(step: Callable[[], None], k: int) -> float:
            start, end = event(enable_timing=True), event(enable_timing=True)
            start.record()
            for _ in range(k):
                step()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / k
        return by_events, "device events"

    def by_clock(step: Callable[[], None], k: int) -> float:
        be.synchronize()
        t0 = time.perf_counter()
        for _ in range(k):
            step()
        be.synchronize()
        return (time.perf_counter() - t0) / k
    return by_clock, "host clock between device syncs"


def steps_per_round(be: Backend, step_s: float) -> int:
    """Steps each round times on ``be`` for a step of ``step_s`` seconds: on an accelerator enough for
    ``ROUND_SECONDS`` (launch jitter and a stray host stall spread over several steps), at most
    ``MAX_STEPS_PER_ROUND``; on a CPU one (its small-size steps take tens of ms, and its runs stay short)."""
    if be.device_type == "cpu" or step_s <= 0:
        return 1
    return max(MIN_STEPS_PER_ROUND, min(MAX_STEPS_PER_ROUND, math.ceil(ROUND_SECONDS / step_s)))


