"""``amp-backends bench --memory``: the training memory of each model and mode, counted, and what each
mode does to the loss.

The ledger (:mod:`amp_backends.memory.ledger`) of a training step of each bench model at its full size
and real batch size, per mode: float32, AMP in each autocast dtype, and memory-lean AMP
(:func:`amp_backends.memory_lean`: bfloat16 weights with float32 masters, low-precision saves, the LM
head in blocks of rows; ``lean-bf16-max``: the same with the two exact levers that are off by default, the activations' inputs
recomputed from the MLP's up-projection input in backward (``activation_inputs=True``: a matmul a layer)
and dropouts' masks kept as bits (``dropout_masks=True``); ``lean-bf16-rc``:
the same with the transformer blocks' cheap ops recomputed in backward (``recompute=True``);
``lean-bf16-sr``: bfloat16 weights and moments, the weights rounded stochastically by
:class:`~amp_backends.memory.StochasticAdamW`, no masters). On a CPU the steps run on fake tensors: every
storage counted, no arithmetic, a few seconds per model and mode (the loss scaler's skip decision, a host read, cannot be
made there: the step is counted as one that runs). On an accelerator they run for real on the device, and
the allocator's peak is reported beside the ledger's. The loss after a few hundred steps of each mode
on the bench's data (small size, real arithmetic) is reported beside the memory.
"""

from __future__ import annotations

import functools
import datetime
import gc
import json
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from ..backend import Backend, get
from ..console import render_table
from ..errors import PerformanceWarning
from ..memory.fake import Setup, measure, on_meta_then_fake
from ..memory.activation_inputs import recompute_activation_inputs
from ..memory.lean import memory_lean
from ..memory.recompute import find_blocks
from ..memory.recompute import unavailable_reason as recompute_torch_unavailable
from ..memory.sr_adamw import StochasticAdamW
from ..memory.ledger import PARTS, Ledger, MemoryReport
from .bench_models import MODELS

__all__ = ["LEAN_HEADS", "LEFT_BEHIND_MARGIN", "Alone", "autocast_dtype", "ledger_modes", "loss_after", "main", "measure_alone",
           "mode_unavailable", "peak_kind", "memory_rows", "render_memory", "setup_for"]

#: The LM head of a bench model, where it has one (its logits are the largest tensors of the step).
LEAN_HEADS = {name: spec.lm_head for name, spec in MODELS.items() if spec.lm_head}


def ledger_modes(be: Backend) -> list[tuple[str, str | None]]:
    """(mode, why it cannot run here or None): fp32, amp-<dtype> for each autocast dtype, lean-bf16
    and lean-bf16-sr where the backend runs bf16."""
    modes: list[tuple[str, str | None]] = [("fp32", None)]
    modes += [(f"amp-{str(d).replace('torch.', '')}", None) for d in (torch.float16, torch.bfloat16)
              if d in be.supported_dtypes()]
    if torch.bfloat16 in be.supported_dtypes():
        modes += [("lean-bf16", None), ("lean-bf16-max", None), ("lean-bf16-rc", None), ("lean-bf16-sr", None)]
    return modes


@functools.lru_cache(maxsize=None)
def recompute_unavailable(name: str) -> str | None:
    """Why bench model ``name`` has no ``lean-bf16-rc`` row (this torch cannot recompute selectively, or
    no repeated blocks to recompute), or None."""
    if (why := recompute_torch_unavailable()) is not None:
        return why
    if find_blocks(MODELS[name].build("small")):
        return None
    return "no repeated transformer blocks to recompute (memory_lean(recompute=True) refuses it)"


@functools.lru_cache(maxsize=None)
def max_levers_unavailable(name: str) -> str | None:
    """Why bench model ``name`` has no ``lean-bf16-max`` row (no activation module beside a linear whose
    input could be remade, and no dropout: the row would be ``lean-bf16``'s again), or None."""
    model = MODELS[name].build("small")
    dropouts = any(isinstance(m, nn.Dropout) and 0 < m.p < 1 for m in model.modules())
    if recompute_activation_inputs(model).activations or dropouts:
        return None
    return ("no GELU, SiLU or Mish module beside a linear and no dropout (memory_lean(activation_inputs=True, "
            "dropout_masks=True) finds nothing)")


def mode_unavailable(name: str, mode: str) -> str | None:
    """Why bench model ``name`` has no row of ``mode`` although the backend runs it (its lever finds nothing), or None."""
    if mode == "lean-bf16-rc":
        return recompute_unavailable(name)
    if mode == "lean-bf16-max":
        return max_levers_unavailable(name)
    return None


def autocast_dtype(mode: str) -> torch.dtype:
    """The low-precision dtype a mode's step runs in (autocast's, and the lean weights')."""
    return torch.float16 if mode.endswith("-float16") else torch.bfloat16


def setup_for(be: Backend, name: str, size: str, batch: int | None, mode: str, *, fake: bool,
              lr: float = 1e-5) -> Callable[[], Setup]:
    """The training step of bench model ``name`` in ``mode``, as :func:`~amp_backends.memory.fake.measure`
    counts it (``fake``: the model built on the meta device, then made fake)."""
    spec = MODELS[name]
    device = torch.device("cpu") if fake else be.device()

    def make() -> Setup:
        torch.manual_seed(0)
        model = on_meta_then_fake(lambda: spec.build(size)) if fake else spec.build(size).to(device)
        x, y = spec.batch(size, device, batch)
        dtype = autocast_dtype(mode)
        through_torch = mode.startswith("torch-")  # raw torch.autocast and torch.amp.GradScaler
        master: Callable[[], list[torch.Tensor]] = list
        if mode == "lean-bf16-sr":
            opt: Any = memory_lean(model, StochasticAdamW(model.parameters(), lr=lr), backend=be, weights=torch.bfloat16,
                                   master=False, lm_head=LEAN_HEADS.get(name)).optimizer
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=lr)
            if mode in ("lean-bf16", "lean-bf16-max", "lean-bf16-rc"):
                lean = memory_lean(model, opt, backend=be, weights=torch.bfloat16, lm_head=LEAN_HEADS.get(name),
                                   recompute=mode == "lean-bf16-rc", activation_inputs=mode == "lean-bf16-max",
                                   dropout_masks=mode == "lean-bf16-max")
                opt, master = lean.optimizer, (lambda: list(lean._masters.values()))
        # a fake step cannot make the scaler's decision (a host read of found_inf): it is counted as a step
        # that runs; the scaler's own tensors are a few bytes, its unscale works in place
        full = mode in ("fp32", "tf32")
        scaler: Any = None
        if not full and not fake:
            scaler = (torch.amp.GradScaler(be.device_type, enabled=dtype == torch.float16) if through_torch
                      else be.grad_scaler(dtype))

        def autocast() -> Any:
            if through_torch:
                return torch.autocast(be.device_type, dtype=dtype)
            return be.autocast(dtype, enabled=not full)

        def step(ledger: Ledger) -> None:
            opt.zero_grad(set_to_none=True)
            with ledger.phase("forward"), autocast():
                loss = spec.loss_of(model, x, y)
            with ledger.phase("backward"):
                (scaler.scale(loss) if scaler is not None else loss).backward()
            with ledger.phase("optimizer"):
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()

        return Setup(model, opt, step, inputs=(x, y), master=master)

    return make


def peak_kind(allocator: bool) -> str:
    """What a peak figure is: the allocator's (accelerators) or the ledger's (CPUs)."""
    return "allocator peak (this mode alone)" if allocator else "ledger peak (every storage; this mode alone)"


#: Bytes a mode may leave allocated after its model and optimizer are dropped before the bench warns (the
#: allocator's own rounding of a few small tensors a library caches, e.g. a device RNG state)
LEFT_BEHIND_MARGIN = 1 << 20


class Alone(NamedTuple):
    """One mode measured alone: the ledger's report; on an accelerator the allocator's peak above what was
    allocated before the mode began (else None), and what stayed allocated after it ended (0 on a CPU)."""

    report: MemoryReport
    allocator: int | None
    left_behind: int


def measure_alone(be: Backend, name: str, size: str, batch: int | None, mode: str) -> Alone:
    """The ledger of one training step of bench model ``name`` in ``mode``, with that mode's own model
    and optimizer the only ones alive (on fake tensors on a CPU, for real on an accelerator), and on an
    accelerator the allocator's peak over the counted steps, counted from what was allocated before the
    mode began: whatever an earlier mode left behind is not this mode's. Everything the steps made is
    freed before it returns; what stays allocated on the device after that is returned, and warned of
    above :data:`LEFT_BEHIND_MARGIN` (a reference kept to the mode's model or optimizer)."""
    fake = be.device_type == "cpu"
    gc.collect()
    before = 0
    if not fake:
        be.empty_cache()
        be.synchronize()
        before = be.memory_allocated() or 0
        be.reset_peak_memory_stats()
    report = measure(setup_for(be, name, size, batch, mode, fake=fake), fake=fake)
    if fake:
        gc.collect()
        return Alone(report, None, 0)
    be.synchronize()
    allocator = (be.max_memory_allocated() or 0) - before
    gc.collect()
    be.empty_cache()
    left = (be.memory_allocated() or 0) - before
    if left > LEFT_BEHIND_MARGIN:
        warnings.warn(f"bench --memory: {name} in {mode} left {left / 2**20:,.1f} MiB allocated on {be.name} after "
                      f"its model and optimizer were dropped (something still holds them); the rows after it are "
                      f"counted from what is allocated when each begins, so their peaks leave it out",
                      RuntimeWarning, stacklevel=2)
    return Alone(report, allocator, max(left, 0))


def memory_rows(be: Backend, models: Sequence[str], size: str = "full", scale: float = 1.0,
                modes: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """One row per model and mode (``modes``: a subset of :func:`ledger_modes`'s; fp32 always runs): the
    ledger's parts at the peak, the peak, its saving against fp32; on an accelerator also the allocator's peak."""
    fake = be.device_type == "cpu"
    rows: list[dict[str, Any]] = []
    for name in models:
        spec = MODELS[name]
        batch = max(1, round(spec.batch_sizes[size] * scale))
        fp32_peak = None
        for mode, why_not in ledger_modes(be):
            if modes is not None and mode != "fp32" and mode not in modes:
                continue
            row: dict[str, Any] = {"model": name, "mode": mode, "size": size, "batch": batch, "input": spec.shapes[size],
                                   "counted": "fake tensors (no arithmetic)" if fake else f"real step on {be.name}"}
            why_not = why_not or mode_unavailable(name, mode)
            if why_not is not None:
                rows.append({**row, "memory": None, "saving_vs_fp32": None, "unavailable": why_not})
                continue
            report, allocator, left = measure_alone(be, name, size, batch, mode)
            peak = report.peak if allocator is None else allocator  # the allocator's, where the device keeps one
            fp32_peak = peak if mode == "fp32" else fp32_peak
            memory = {k: report.parts[k] for k in PARTS if k != "other"}
            memory.update(other=report.parts["other"], peak=report.peak,
                          activations_by_dtype=report.activations_by_dtype, peak_phase=report.phase)
            if allocator is not None:
                memory["allocator_peak"] = allocator
                memory["left_behind"] = left
            row.update(memory=memory, peak_bytes=peak, peak_kind=peak_kind(allocator is not None),
                       saving_vs_fp32=(1 - peak / fp32_peak) if fp32_peak else None)
            rows.append(row)
    return rows


def loss_after(be: Backend, name: str, mode: str, steps: int, lr: float = 1e-3) -> float:
    """The loss after ``steps`` steps of bench model ``name`` (small size, real arithmetic) in ``mode``."""
    spec = MODELS[name]
    setup = setup_for(be, name, "small", None, mode, fake=False, lr=lr)()
    ledger = Ledger()  # its phases only: nothing is counted outside its dispatch mode
    for _ in range(steps):
        setup.step(ledger)
    # in the dtype the mode trains in (the amp-float16 row's loss under float16 autocast)
    with torch.no_grad(), be.autocast(autocast_dtype(mode), enabled=mode not in ("fp32", "tf32")):
        x, y = setup.inputs
        return float(spec.loss_of(setup.model, x, y).float())


def _mib(n: int | None, places: int = 0) -> str:
    return "-" if n is None else f"{n / 2**20:,.{places}f}"


def _saving(r: dict[str, Any]) -> str:
    """The row's peak against fp32's, in percent ("0.0%" for the same peak, not "-0.0%")."""
    if r["mode"] == "fp32" or r.get("saving_vs_fp32") is None:
        return ""
    change = -100 * r["saving_vs_fp32"]
    return "0.0%" if round(change, 1) == 0 else f"{change:+.1f}%"


#: The table's columns (an unavailable row fills them all too).
_COLUMNS = ["model", "mode", "peak MiB", "vs fp32", "params", "grads", "optimizer", "masters", "weight copies",
            "activations (by dtype)", "other; loss"]


def render_memory(result: dict[str, Any]) -> str:
    """The ledger table, and each mode's loss beside it."""
    rows = []
    for r in result["rows"]:
        m = r["memory"]
        if m is None:
            rows.append([r["model"], r["mode"], *[""] * (len(_COLUMNS) - 3), f"n/a: {r['unavailable']}"])
            continue
        peak = r.get("peak_bytes", m["peak"])
        # whole MiB would round a small step's parts to 0, 1, 2
        mib = functools.partial(_mib, places=1 if peak < 2**30 else 0)
        low = ", ".join(f"{d} {mib(b)}" for d, b in sorted(m["activations_by_dtype"].items()))
        loss = r.get("loss")
        rows.append([r["model"], r["mode"], mib(peak), _saving(r),
                     mib(m["parameters"]), mib(m["gradients"]), mib(m["optimizer"]), mib(m["master"]),
                     mib(m["weight_copies"]), f"{mib(m['activations'])} ({low})" if low else mib(m["activations"]),
                     mib(m["other"]) + (f"; loss {loss:.4g}" if loss is not None else "")])
    table = render_table(_COLUMNS, rows, markdown=True, right=(2, 3, 4, 5, 6, 7, 8))
    kinds = ", ".join(dict.fromkeys(r["peak_kind"] for r in result["rows"] if r.get("peak_kind"))) or "-"
    sizes = ", ".join(dict.fromkeys(f"{r['model']} batch {r['batch']} x {r['input']}" for r in result["rows"]))
    loss = (f"loss after {result['loss_steps']} AdamW steps (lr {result['loss_lr']:g}) at small size on the bench's data"
            if result["loss_steps"] else "no loss measured (--loss-steps 0)")
    allocator = any("allocator_peak" in (r["memory"] or {}) for r in result["rows"])
    kernels = ("activations as this device's kernels keep them; the peak is the allocator's" if allocator else
               "activations as this machine's kernels keep them (a CPU's attention keeps its probabilities and its "
               "dropout a noise tensor, which a GPU's fused kernels do not); on a GPU, budget with the allocator's "
               "figure (bench --memory there)")
    return "\n".join([
        f"amp-backends bench --memory: backend {result['backend']}, torch {result['torch']}, {result['date']}",
        f"{result['size']} size: {sizes}; counted: {result['counted']}; MiB at the step's peak, by part; "
        f"peak: {kinds}",
        kernels,
        f"{loss}",
        "",
        table,
    ])


def main(backend: str | None, models: Sequence[str], size: str, scale: float, loss_steps: int, as_json: bool,
         loss_lr: float = 1e-4) -> int:
    """``amp-backends bench --memory`` (the CLI has checked the arguments)."""
    be = get(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        rows = memory_rows(be, models, size, scale)
        if loss_steps:
            for row in rows:
                if row["memory"] is not None:
                    row["loss"] = loss_after(be, row["model"], row["mode"], loss_steps, loss_lr)
    result = {"backend": be.name, "torch": torch.__version__, "date": datetime.date.today().isoformat(), "size": size,
              "counted": rows[0]["counted"] if rows else "", "loss_steps": loss_steps, "loss_lr": loss_lr, "rows": rows}
    print(json.dumps(result, indent=2) if as_json else render_memory(result))
    return 0
