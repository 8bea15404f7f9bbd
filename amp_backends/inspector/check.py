"""What AMP will do to a model, before it trains: :func:`check_model` and ``amp-backends check``.

One forward under the backend's autocast, with backward passes taken with ``torch.autograd.grad``
inside :func:`~amp_backends.tracing.isolation.untouched` (the model, its buffers, gradients, modes and hooks
and the global RNG are exactly as before; no user hook or optimizer sees the check's backward), and
the same forward and backward in float32 as the reference:

- every matmul-like op, forward and backward, with its module, the dtype it ran in (seen below
  autocast by a ``TorchDispatchMode``), its FLOPs (torch's ``FlopCounterMode`` formulas, and stated
  ones where it has none: :mod:`amp_backends.tracing.opcount`) and whether its shape suits low-precision
  matrix units (dimensions, per convolution group, multiples of 8);
- the modules left in float32, and why (a precision policy; autocast's float32 op lists; a float32
  input);
- float16's range, measured: the scaled backward run at every power of two from 2**-24 to 2**30
  (:mod:`.scales`), each gradient element judged against the float32 reference (an element lost is
  zero in float16's gradient and not in float32's); with fp8 layers, the values lost at every scale
  that the same model without fp8 does not lose at every scale are fp8's, reported apart; every
  parameter counted once; a model whose loss is inf/NaN, or whose gradients hold inf/NaN at every one
  of those scales, is said to be beyond loss scaling;
- the first op that produced inf/NaN, forward and backward (:mod:`amp_backends.tracing.produced`: an
  overflow or a NaN made by arithmetic, not an inf written on purpose): module, op, dtype, shape, count;
- per module, the relative error of its outputs and of its gradients against float32;
- what is inf/NaN in float32 too (an inf held in a buffer, a NaN in a weight, ``sqrt`` at 0 in the
  backward) is no precision problem: said apart (the first module whose float32 output holds it,
  the modules whose float32 gradients do), not counted as float16's overflow, and not taken as a
  model beyond loss scaling.

While it runs, :func:`~amp_backends.quant_stats` hooks on the model pause (its forwards are no
training steps).
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..precision.fp8 import engine as fp8
from ..precision.stats import paused
from ..backend import Backend
from ..devices.autocast_lists import MODULE_OPS
from ..memory.by_module import ModuleMemory, saved_by_module
from ..errors import AmpBackendsError
from ..tracing.isolation import call_args, untouched
from ..tracing.opcount import NonFinite, Op, OpRecorder
from ..torch_private import tree_leaves
from . import scales as measured
from .outputs import Outputs, over, rel
from .report import ModelReport, ModuleRow

__all__ = ["CheckError", "CheckTypeError", "ModelReport", "ModuleRow", "check_model"]
_LOW = (torch.float16, torch.bfloat16)


class CheckError(AmpBackendsError, ValueError):
    """A value check_model cannot use (an argument, the inputs, what loss_fn returned); nothing changed."""


class CheckTypeError(AmpBackendsError, TypeError):
    """An argument of the wrong kind; nothing ran."""


# -- arguments ---------------------------------------------------------------------------------
def _loss_scale(loss_scale: Any) -> float:
    if loss_scale is None:
        return 2.0**16
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, numbers.Real):
        raise CheckTypeError(f"check_model: loss_scale must be a positive number (the scaler's scale, default 2**16), "
                         f"got {type(loss_scale).__name__} {loss_scale!r}")
    scale = float(loss_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise CheckError(f"check_model: loss_scale must be a positive finite number, got {loss_scale!r}")
    return scale


def _check_devices(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], be: Backend) -> None:
    """The model and the inputs must be on the backend's device: autocast acts on that device type only."""
    where = {t.device.type for t in (*model.parameters(), *model.buffers())}
    where |= {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    other = sorted(where - {be.device_type})
    if other:
        raise CheckError(
            f"check_model: backend {be.name!r} autocasts {be.device_type!r} tensors, but the model or the inputs "
            f"are on {', '.join(map(repr, other))}: nothing there would run in the low dtype. Move both with "
            f".to(amp_backends.get({be.name!r}).device()), or check on that device's backend"
        )


def _check_inputs_finite(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    bad = sum(int((~torch.isfinite(t)).sum()) for t in tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor) and t.is_floating_point())
    if bad:
        raise CheckError(f"check_model: the example inputs hold {bad} inf/NaN values: the report would describe "
                         "them, not what AMP does to the model. Pass finite inputs")


def _loss_of(output: Any, loss_fn: Callable[[Any], Any] | None, params: list[torch.Tensor]) -> torch.Tensor | None:
    """The scalar to differentiate: ``loss_fn(output)`` (checked), else the mean of the floating outputs
    that require grad; None where no parameter requires grad (forward only)."""
    if loss_fn is None:
        floats = [t for t in tree_leaves(output)
                  if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
        return sum(t.float().mean() for t in floats) if floats and params else None  # type: ignore[return-value]  # a sum of 0-dim tensors is a tensor
    loss = loss_fn(output)
    if not isinstance(loss, torch.Tensor):
        raise CheckError(f"check_model: loss_fn must return a scalar tensor, got {type(loss).__name__} {loss!r}")
    if loss.numel() != 1:
        raise CheckError(f"check_model: loss_fn must return a scalar tensor, got one of shape {tuple(loss.shape)} "
                         "(reduce it: .mean() or .sum())")
    if not params:
        return None
    if not loss.is_floating_point() or not loss.requires_grad:
        raise CheckError("check_model: loss_fn's result does not depend on any parameter that requires grad "
                         "(no backward to check): return a loss computed from the model's output")
    return loss.reshape(())


# -- the runs ------------------------------------------------------------------------------------
def check_model(
    model: nn.Module,
    example_inputs: Any,
    backend: str | Backend | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    loss_scale: float | None = None,
    compare: bool = True,
    memory: bool = True,
) -> ModelReport:
    """Run ``model`` on ``example_inputs`` (a tensor, a tuple of positional arguments, or a mapping of
    keyword arguments, on the backend's device) under the backend's autocast and in float32, and report
    what ran in which precision and what float16 would lose (see the module docstring). ``loss_fn(output)``
    makes the loss (default: the mean of the floating outputs that require grad); ``loss_scale`` is
    the scale the per-module gradient figures are judged at (default 2**16, the scaler's start);
    ``compare=False`` skips the per-module comparison with float32 (keeps less memory); ``memory=False``
    skips the per-module memory ledger (what each module holds for backward, and under memory_lean:
    two more forwards, one on a copy of the model).

    Nothing of the model changes: buffers, gradients, modes, hooks and the global RNG are as before,
    and no hook or optimizer of the user's sees the check's backward."""
    from ..precision.policy import fp32_modules
    from ..registry.registry import resolve_backend

    if not isinstance(model, nn.Module):
        raise CheckTypeError(f"check_model takes a torch.nn.Module, got {type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise CheckTypeError(f"check_model: loss_fn must be callable (output -> scalar loss), got "
                        f"{type(loss_fn).__name__} {loss_fn!r}")
    be = resolve_backend(backend)
    low = be.resolve_dtype(dtype)
    scale = _loss_scale(loss_scale)
    args, kwargs = call_args(example_inputs)
    _check_devices(model, args, kwargs, be)
    _check_inputs_finite(args, kwargs)
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    fp16 = low == torch.float16
    with untouched(model, be.device_type) as rng, paused(model):
        ref: _Reference | None = None
        kept: list[str] = []
        if compare or fp16:  # the float32 reference (fp8 layers as plain Linear layers)
            with fp8.as_linear(model) as kept:
                ref = _reference(model, args, kwargs, be, loss_fn, params, compare)
            rng.restore()
        ref_grads = None if ref is None else ref.grads
        without_fp8 = None
        if fp16 and ref_grads is not None and any(fp8.is_fp8(m) for m in model.modules()):
            without_fp8 = functools.partial(_loss_without_fp8, model, args, kwargs, be, low, loss_fn, params, rng)
        run = _low_run(model, args, kwargs, be, low, loss_fn, params, scale, ref, compare, without_fp8)
        held = None
        if memory:
            rng.restore()
            held = saved_by_module(model, args, kwargs, be, low)
    report = _report(model, be, low, scale, run, ref, params, set(fp32_modules(model)))
    if held is not None:
        _add_memory(report, *held)
    weights = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()} & {"float16", "bfloat16"})
    if weights and ref_grads is not None:
        report.notes.append(f"the model's weights are {' and '.join(weights)}: the float32 reference ran float32 "
                            "copies of them")
    if kept:
        also = (" (and in the model without fp8 that tells fp8's losses from float16's: what fp8 loses there "
                "counts as float16's)" if fp16 else "")
        report.notes.append(f"fp8 layers with submodules of their own ran in fp8 in the float32 reference too (a plain "
                            f"Linear would drop what they add): {', '.join(kept)}; their errors leave out fp8's{also}")
    return report


def _loss_without_fp8(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], be: Backend, low: torch.dtype,
                      loss_fn: Any, params: list[torch.Tensor], rng: Any) -> torch.Tensor | None:
    """The loss of the same model without fp8 (its fp8 layers as plain Linear layers holding the same
    parameters) under the same autocast and dropout masks, its graph kept."""
    rng.restore()
    with fp8.as_linear(model), be.autocast(low):
        return _loss_of(model(*args, **kwargs), loss_fn, params)


def _add_memory(report: ModelReport, held: dict[str, ModuleMemory], why: str | None) -> None:
    """Each row's saves for backward, and the model's totals (plain and under memory_lean)."""
    for row in report.rows:
        mine = held.get(row.name)
        if mine is not None:
            row.saved, row.weight_copies, row.lean_held = dict(mine.saved), mine.weight_copies, mine.lean
    by_dtype: dict[str, int] = defaultdict(int)
    for mine in held.values():
        for dtype, nbytes in mine.saved.items():
            by_dtype[dtype] += nbytes
    report.saved_by_dtype = dict(by_dtype)
    report.weight_copies = sum(m.weight_copies for m in held.values())
    report.lean_held = None if why is not None else sum(m.lean or 0 for m in held.values())
    if why is not None:
        report.notes.append(why)


@dataclass
class _Reference:
    """The float32 run: each module's outputs (and where they hold inf/NaN), the parameters'
    gradients, whether the loss is finite (None: no loss)."""

    outputs: Outputs
    grads: list[torch.Tensor | None] | None
    loss_finite: bool | None


def _reference(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], be: Backend, loss_fn: Any,
               params: list[torch.Tensor], keep: bool) -> _Reference:
    """Each module's outputs and the parameters' gradients with autocast off, in float32: a model whose
    weights are float16/bfloat16 runs float32 copies of them (and its low-precision inputs in float32),
    the gradients taken in float32."""
    from ..precision.fp32_forward import float32_copies
    from ..torch_private import reparametrize_module, tree_map

    copies = float32_copies(model)
    by_id = {id(p): copies[name] for name, p in model.named_parameters(remove_duplicate=False) if name in copies}
    seen = Outputs(model, keep=keep, marks=True)
    ref_grads, finite = None, None
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.autocast(be.device_type, enabled=False))
            if copies:
                stack.enter_context(reparametrize_module(model, copies))
                args, kwargs = tree_map(_float32_input, (args, kwargs))
            output = model(*args, **kwargs)
        loss = _loss_of(output, loss_fn, params)
        if loss is not None:
            finite = bool(torch.isfinite(loss.detach()).all())
            ref_grads = measured.grads(loss, [by_id.get(id(p), p) for p in params], 1.0, retain=False)
    finally:
        seen.remove()
    return _Reference(seen, ref_grads, finite)


def _float32_input(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16) else x


@dataclass
class _Run:
    ops: list[Op]
    outputs: Outputs
    grads: list[torch.Tensor | None] | None
    forward_bad: NonFinite | None
    backward_bad: NonFinite | None
    scales: dict[float, tuple[int, int]]
    backwards: int
    forward_only: bool
    #: whether the low-precision loss is finite (None: no loss)
    loss_finite: bool | None = None
    #: per scale, the values lost to the fp8 layers ({}: no fp8 layer, or not float16)
    fp8_scales: dict[float, int] = field(default_factory=dict)
    #: per parameter, where the fp8 layers lose values at the scale checked (None: not told apart)
    fp8_lost: list[torch.Tensor | None] | None = None


def _low_run(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], be: Backend, low: torch.dtype,
             loss_fn: Any, params: list[torch.Tensor], scale: float, ref: _Reference | None,
             compare: bool, without_fp8: Callable[[], torch.Tensor | None] | None = None) -> _Run:
    """The forward under autocast and the backward at ``scale``, every op recorded; then, for float16,
    more backwards on the same graph at every scale of :data:`.scales.SCALE_RANGE`, each judged against
    ``ref_grads``; ``without_fp8`` makes the loss of the same model without fp8, run at each scale too to
    tell what fp8 loses from what float16 loses."""
    from ..tracing.attribution import Attribution

    attribution = Attribution(model)
    recorder = OpRecorder(attribution.where)
    seen = Outputs(model, keep=compare, reference=None if ref is None else ref.outputs)
    ref_grads = None if ref is None else ref.grads
    grads = None
    try:
        with recorder:
            with attribution, be.autocast(low):
                output = model(*args, **kwargs)
                loss = _loss_of(output, loss_fn, params)
            if loss is not None:
                grads = measured.grads(loss, params, scale if low == torch.float16 else 1.0,
                                       retain=low == torch.float16)
    finally:
        seen.remove()
        attribution.remove()
    forward_bad, backward_bad = recorder.first_nonfinite(False), recorder.first_nonfinite(True)
    sweep = measured.Sweep({}, 0)
    if low == torch.float16 and grads is not None and ref_grads is not None:
        plain = without_fp8() if without_fp8 is not None else None
        sweep = measured.measure(loss, params, ref_grads, scale, grads, plain)
        del plain
    finite = None if loss is None else bool(torch.isfinite(loss.detach()).all())
    del loss
    return _Run(recorder.ops, seen, grads, forward_bad, backward_bad, sweep.scales,
                (1 if grads is not None else 0) + sweep.backwards, grads is None, finite,
                fp8_scales=sweep.fp8, fp8_lost=sweep.fp8_at_scale)


def _report(model: nn.Module, be: Backend, low: torch.dtype, scale: float, run: _Run, ref: _Reference | None,
            params: list[torch.Tensor], policed: set[str]) -> ModelReport:
    ref_outputs = None if ref is None else ref.outputs.outputs
    ref_grads = None if ref is None else ref.grads
    by_module: dict[str, list[Op]] = defaultdict(list)
    for op in run.ops:
        by_module[op.module].append(op)
    index = {id(p): i for i, p in enumerate(params)}
    grads = run.grads
    fp16 = low == torch.float16
    # lost to float16 at the scale checked: against float32, less what fp8's quantisation loses at every scale
    fp8_lost = run.fp8_lost or [None] * len(params)
    masks = measured.lost_masks(grads, ref_grads) if grads is not None and ref_grads is not None else []
    lost = [0 if m is None else int((m & ~f).sum() if f is not None else m.sum()) for m, f in zip(masks, fp8_lost)] \
        if masks else [0] * len(params)
    lost_fp8 = [0 if f is None else int(f.sum()) for f in fp8_lost]
    nonfinite = measured.nonfinite(grads) if grads is not None else [0] * len(params)
    # inf/NaN where the float32 reference has them too: the model's, not the precision's
    ref_bad = measured.nonfinite(ref_grads) if ref_grads is not None else [0] * len(params)
    shared = [n - m for n, m in zip(nonfinite, measured.nonfinite(grads, ref_grads))] \
        if grads is not None and ref_grads is not None else [0] * len(params)
    fp32_bad_grads: list[str] = []
    rows: list[ModuleRow] = []
    for name, module in model.named_modules():
        row = ModuleRow(name, type(module).__name__, output_dtype=_first_dtype(run.outputs.outputs.get(name)))
        forward = [o for o in by_module.get(name, []) if not o.backward]
        backward = [o for o in by_module.get(name, []) if o.backward]
        if forward:
            row.compute = _dtypes(forward)
            row.flops = sum(o.flops for o in forward)
            row.low_flops = sum(o.flops for o in forward if o.dtype in _LOW)
            row.misaligned = list(dict.fromkeys(o.shape for o in forward if o.misaligned))
            row.misaligned_flops = sum(o.flops for o in forward if o.misaligned)
        if backward:
            row.backward_compute = _dtypes(backward)
            row.backward_flops = sum(o.flops for o in backward)
        if fp8.is_fp8(module):
            row.fp8 = f"fp8 ({fp8.describe_layer(module)})"
            row.fp8_flops = row.flops
            row.low_flops = 0
            fp8_compute = f"float8{' (emulated)' if 'emulated' in row.fp8 else ''}"
            row.compute = fp8_compute if forward else row.compute
            row.backward_compute = fp8_compute if backward else row.backward_compute
        elif isinstance(module, nn.Linear):
            row.fp8 = fp8.eligibility(module) or "eligible"
        if not row.fp8_flops:
            row.fp32_reason = _fp32_reason(name, row, forward, run.outputs.inputs.get(name), policed,
                                           be.autocast_lists.module_policy(module),
                                           isinstance(module, tuple(MODULE_OPS)))
        own = [p for p in module.parameters(recurse=False) if id(p) in index]
        row.params_over = sum(_finite_over(p) for p in module.parameters(recurse=False))
        row.outputs_over = run.outputs.over.get(name, 0)
        if any(ref_bad[index[id(p)]] for p in own):
            fp32_bad_grads.append(name)
        if grads is not None and own:
            mine = [g for g in (grads[index[id(p)]] for p in own) if g is not None]
            row.grads_nonfinite = sum(nonfinite[index[id(p)]] for p in own)
            row.grads_underflow = sum(lost[index[id(p)]] for p in own) if fp16 else 0
            row.grads_lost_fp8 = sum(lost_fp8[index[id(p)]] for p in own)
            row.grads_over = sum(_finite_over(g) for g in mine)
            if mine:
                row.grad_norm = _norm(mine)
            if ref_grads is not None:
                pairs = [(grads[index[id(p)]], ref_grads[index[id(p)]]) for p in own]
                pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
                if pairs:
                    row.grad_error = rel(torch.cat([a.flatten() for a, _ in pairs]),
                                         torch.cat([b.flatten() for _, b in pairs]))
        if ref_outputs is not None and run.outputs.outputs.get(name) and ref_outputs.get(name):
            mine_out, theirs = run.outputs.outputs[name], ref_outputs[name]
            if len(mine_out) == len(theirs) and all(a.shape == b.shape for a, b in zip(mine_out, theirs)):
                row.output_error = rel(torch.cat([a.float().flatten() for a in mine_out]),
                                       torch.cat([b.float().flatten() for b in theirs]))
        rows.append(row)
    forward_ops = [o for o in run.ops if not o.backward]
    fp8_modules = {r.name for r in rows if r.fp8 and r.fp8.startswith("fp8 (")}
    present = [g for g in (grads or []) if g is not None]
    unique_finite = [torch.where(torch.isfinite(g), g, torch.zeros_like(g)) for g in present]
    best, safe = measured.choose(run.scales) if fp16 and run.scales else ([], None)
    # measured: a loss that is inf/NaN (the forward overflowed, and scaling comes after it), or inf/NaN
    # gradients at every scale tried; an overflow in the forward that the loss never sees does not decide it,
    # nor does what is inf/NaN in float32 too (the sweep leaves those gradient values out)
    fp32_loss_bad = ref is not None and ref.loss_finite is False
    beyond = fp16 and not run.forward_only and ((run.loss_finite is False and not fp32_loss_bad)
                                                 or bool(run.scales) and safe is None)
    if beyond or fp32_loss_bad:  # a loss inf/NaN in float32: no scale to suggest
        best, safe = [], None
    notes = []
    if run.forward_only:
        notes.append("no parameter requires grad, or the output does not depend on one: forward only "
                     "(no gradient figures)")
    fp32_note = be.fp32_note()
    if fp32_note:
        notes.append(fp32_note)
    head = forward_ops[-1].module if forward_ops else None
    return ModelReport(
        backend=be.name, dtype=str(low).replace("torch.", ""), loss_scale=scale, rows=rows,
        total_flops=sum(o.flops for o in forward_ops),
        low_flops=sum(o.flops for o in forward_ops if o.dtype in _LOW and o.module not in fp8_modules),
        fp8_flops=sum(o.flops for o in forward_ops if o.module in fp8_modules),
        misaligned_flops=sum(o.flops for o in forward_ops if o.misaligned), safe_scales=safe, best_scales=best,
        grad_norm=_norm(present) if grads else math.nan, grad_norm_finite=_norm(unique_finite) if grads else math.nan,
        params_over=sum(_finite_over(p) for p in model.parameters()),
        grads_over=sum(_finite_over(g) for g in present),
        grads_underflow=sum(lost) if fp16 else 0, grads_lost_fp8=sum(lost_fp8),
        outputs_over=sum(r.outputs_over for r in rows),
        grads_nonfinite=sum(nonfinite), backward_flops=sum(o.flops for o in run.ops if o.backward),
        scales=dict(sorted(run.scales.items())), scales_lost_fp8=dict(sorted(run.fp8_scales.items())),
        backwards_run=run.backwards, beyond_scaling=beyond,
        loss_finite=run.loss_finite,
        first_nonfinite_forward=run.forward_bad, first_nonfinite_backward=run.backward_bad, head=head, notes=notes,
        fp32_loss_finite=None if ref is None else ref.loss_finite,
        fp32_nonfinite_output=None if ref is None else ref.outputs.first_nonfinite,
        fp32_grads_nonfinite=sum(shared), fp32_nonfinite_grads=fp32_bad_grads,
    )


def _norm(found: list[torch.Tensor]) -> float:
    """The 2-norm of all of ``found`` in float64: inf where a value is inf, NaN where one is NaN (what
    ``clip_grad_norm_`` returns)."""
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in found))


def _finite_over(t: torch.Tensor) -> int:
    """Finite elements of ``t`` beyond float16's 65504 (an inf it already holds is no float16 overflow)."""
    return over(t, ~torch.isfinite(t.detach())) if t.is_floating_point() else 0


def _first_dtype(outputs: list[torch.Tensor] | None) -> str | None:
    return str(outputs[0].dtype).replace("torch.", "") if outputs else None


def _dtypes(ops: list[Op]) -> str:
    return "/".join(sorted({str(o.dtype).replace("torch.", "") for o in ops}))


def _fp32_reason(name: str, row: ModuleRow, forward: list[Op], input_dtype: str | None, policed: set[str],
                 policy: str | None, listed: bool) -> str | None:
    """Why a module stayed in float32: a policy; its op in the device's float32 list (``policy``, from the
    backend's :attr:`~amp_backends.devices.contract.Device.autocast_lists`); or a float32 input (for a module
    with matmuls, or one whose op the lists of some device place: ``listed``)."""
    fp32_op = policy == "fp32"
    if name in policed:
        return "precision policy"
    if forward and row.low_flops == 0:
        return "float32 input" if input_dtype == "float32" and not fp32_op else "autocast: float32 op"
    if not forward and listed and row.output_dtype == "float32":
        if fp32_op and input_dtype in ("float16", "bfloat16"):
            return "autocast: float32 op"
        if input_dtype == "float32":
            return "float32 input"
    return None


