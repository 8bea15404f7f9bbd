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
- float16's range, measured: the scaled backward run at powers of two (from ``loss_scale`` down
  until no inf/NaN, and up until one appears), each gradient element judged against the float32
  reference (an element lost is zero in float16's gradient and not in float32's); every parameter
  counted once; a model whose own forward overflows, or whose backward overflows at scale 1, is said
  to be beyond loss scaling, with the op that overflowed;
- the first op that produced inf/NaN, forward and backward: module, op, dtype, shape, count;
- per module, the relative error of its outputs and of its gradients against float32.
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..precision.fp8 import engine as fp8
from ..backend import Backend
from ..errors import AmpBackendsError
from ..tracing.isolation import call_args, untouched
from ..tracing.opcount import NonFinite, Op, OpRecorder
from .report import FP16_MAX, ModelReport, ModuleRow

__all__ = ["CheckError", "CheckTypeError", "ModelReport", "ModuleRow", "check_model"]
_LOW = (torch.float16, torch.bfloat16)
#: The loss scales tried: powers of two from 2**0 to 2**30 (torch's scaler starts at 2**16).
_SCALE_RANGE = (0, 30)


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
        return sum(t.float().mean() for t in floats) if floats and params else None  # type: ignore[return-value]
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
class _Outputs:
    """Each module's floating outputs, per call, and the dtype of its first floating input."""

    def __init__(self, model: nn.Module, keep: bool) -> None:
        self.names = {id(m): n for n, m in model.named_modules()}
        self.outputs: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.inputs: dict[str, str] = {}
        self.over: dict[str, int] = defaultdict(int)
        self.keep = keep
        self._handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(self._pre),
                                                               m.register_forward_hook(self._post))]

    def _pre(self, module: nn.Module, args: Any) -> None:
        first = next((t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
        name = self.names.get(id(module), "?")
        if first is not None and name not in self.inputs:
            self.inputs[name] = str(first.dtype).replace("torch.", "")

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(id(module), "?")
        floats = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if floats:
            self.outputs[name].append(floats[0].detach() if self.keep else floats[0].new_empty(0))
            self.over[name] += sum(_over(t) for t in floats)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _over(t: torch.Tensor | None) -> int:
    if t is None or not t.is_floating_point() or t.numel() == 0:
        return 0
    return int((t.detach().abs().float() > FP16_MAX).sum())


def _dense(g: torch.Tensor | None) -> torch.Tensor | None:
    if g is None:
        return None
    if g.is_sparse:
        g = g.coalesce().to_dense()
    return g.detach().float()


def _grads(loss: torch.Tensor, params: list[torch.Tensor], scale: float, retain: bool) -> list[torch.Tensor | None]:
    """Gradients of ``loss * scale`` divided by ``scale`` (float32), without touching ``.grad``."""
    grads = torch.autograd.grad(loss * scale, params, retain_graph=retain, allow_unused=True)
    with torch._C._DisableTorchDispatch():  # the check's own arithmetic is not the model's
        return [None if g is None else _dense(g) / scale for g in grads]


def _lost(low: list[torch.Tensor | None], ref: list[torch.Tensor | None]) -> list[int]:
    """Per parameter: gradient elements zero in the low-precision run and not in float32's."""
    return [0 if a is None or b is None else int(((a == 0) & (b != 0)).sum()) for a, b in zip(low, ref)]


def _nonfinite(grads: list[torch.Tensor | None]) -> list[int]:
    return [0 if g is None else int((~torch.isfinite(g)).sum()) for g in grads]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float | None:
    if a.shape != b.shape:
        return None
    a, b = a.double(), b.double()
    denom = float(b.norm())
    diff = float((a - b).norm())
    return diff / denom if denom else (0.0 if diff == 0 else math.inf)


def check_model(
    model: nn.Module,
    example_inputs: Any,
    backend: str | Backend | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    loss_scale: float | None = None,
    compare: bool = True,
) -> ModelReport:
    """Run ``model`` on ``example_inputs`` (a tensor, a tuple of positional arguments, or a mapping of
    keyword arguments, on the backend's device) under the backend's autocast and in float32, and report
    what ran in which precision and what float16 would lose (see the module docstring). ``loss_fn(output)``
    makes the loss (default: the mean of the floating outputs that require grad); ``loss_scale`` is
    the scale the per-module gradient figures are judged at (default 2**16, the scaler's start);
    ``compare=False`` skips the per-module comparison with float32 (keeps less memory).

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
    with untouched(model, be.device_type) as rng:
        ref_outputs, ref_grads = None, None
        if compare or low == torch.float16:  # the float32 reference (fp8 layers as plain Linear layers)
            with fp8.as_linear(model):
                seen = _Outputs(model, keep=compare)
                try:
                    with torch.autocast(be.device_type, enabled=False):
                        output = model(*args, **kwargs)
                    loss = _loss_of(output, loss_fn, params)
                    if loss is not None:
                        ref_grads = _grads(loss, params, 1.0, retain=False)
                finally:
                    seen.remove()
            ref_outputs = seen.outputs
            del output, loss
            rng.restore()
        run = _low_run(model, args, kwargs, be, low, loss_fn, params, scale, ref_grads, compare)
    return _report(model, be, low, scale, run, ref_outputs, ref_grads, params, set(fp32_modules(model)))


@dataclass
class _Run:
    ops: list[Op]
    outputs: _Outputs
    grads: list[torch.Tensor | None] | None
    forward_bad: NonFinite | None
    backward_bad: NonFinite | None
    scales: dict[float, tuple[int, int]]
    backwards: int
    forward_only: bool


def _low_run(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], be: Backend, low: torch.dtype,
             loss_fn: Any, params: list[torch.Tensor], scale: float, ref_grads: list[torch.Tensor | None] | None,
             compare: bool) -> _Run:
    """The forward under autocast and the backward at ``scale``, every op recorded; then, for float16,
    more backwards on the same graph at other scales."""
    from ..tracing.attribution import Attribution

    attribution = Attribution(model)
    recorder = OpRecorder(attribution.where)
    seen = _Outputs(model, keep=compare)
    grads = None
    try:
        with recorder:
            with attribution, be.autocast(low):
                output = model(*args, **kwargs)
                loss = _loss_of(output, loss_fn, params)
            if loss is not None:
                grads = _grads(loss, params, scale if low == torch.float16 else 1.0, retain=low == torch.float16)
    finally:
        seen.remove()
        attribution.remove()
    forward_bad, backward_bad = recorder.first_nonfinite(False), recorder.first_nonfinite(True)
    scales: dict[float, tuple[int, int]] = {}
    backwards = 1 if grads is not None else 0
    if low == torch.float16 and grads is not None and ref_grads is not None:
        backwards += _measure_scales(loss, params, ref_grads, scale, grads, scales)
    del loss
    return _Run(recorder.ops, seen, grads, forward_bad, backward_bad, scales, backwards, grads is None)


def _measure_scales(loss: torch.Tensor, params: list[torch.Tensor], ref: list[torch.Tensor | None], scale: float,
                    first: list[torch.Tensor | None], scales: dict[float, tuple[int, int]]) -> int:
    """Scaled backwards on the same graph, at powers of two: the highest with no inf/NaN (searched by
    bisection, overflow growing with the scale), then the lowest that loses no more gradient values
    than it (bisection again, losses shrinking with the scale). Returns the backwards run besides the
    first (at ``scale``)."""
    lo_k, hi_k = _SCALE_RANGE
    run = 0

    def measure(k: int) -> tuple[int, int]:
        nonlocal run
        s = 2.0**k
        if s not in scales:
            grads = first if s == scale else _grads(loss, params, s, retain=True)
            run += s != scale
            scales[s] = (sum(_nonfinite(grads)), sum(_lost(grads, ref)))
        return scales[s]

    k0 = min(max(math.floor(math.log2(scale)), lo_k), hi_k)
    if measure(k0)[0]:  # overflow at the scale checked: the highest clean one lies below
        if measure(lo_k)[0]:
            return run  # overflows even at 2**0: beyond loss scaling
        clean, bad = lo_k, k0
    elif not measure(hi_k)[0]:
        clean, bad = hi_k, hi_k + 1
    else:
        clean, bad = k0, hi_k
    while bad - clean > 1:
        mid = (clean + bad) // 2
        clean, bad = (mid, bad) if not measure(mid)[0] else (clean, mid)
    fewest = measure(clean)[1]
    low, high = lo_k - 1, clean  # the lowest k in (low, high] losing no more than `fewest`
    if measure(lo_k)[1] <= fewest:
        return run
    low = lo_k
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if measure(mid)[1] <= fewest else (mid, high)
    return run


def _report(model: nn.Module, be: Backend, low: torch.dtype, scale: float, run: _Run,
            ref_outputs: dict[str, list[torch.Tensor]] | None, ref_grads: list[torch.Tensor | None] | None,
            params: list[torch.Tensor], policed: set[str]) -> ModelReport:
    by_module: dict[str, list[Op]] = defaultdict(list)
    for op in run.ops:
        by_module[op.module].append(op)
    index = {id(p): i for i, p in enumerate(params)}
    grads = run.grads
    fp16 = low == torch.float16
    lost = _lost(grads, ref_grads) if grads is not None and ref_grads is not None else [0] * len(params)
    nonfinite = _nonfinite(grads) if grads is not None else [0] * len(params)
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
            row.fp32_reason = _fp32_reason(name, module, row, forward, run.outputs.inputs.get(name), policed)
        own = [p for p in module.parameters(recurse=False) if id(p) in index]
        row.params_over = sum(_over(p) for p in module.parameters(recurse=False))
        row.outputs_over = run.outputs.over.get(name, 0)
        if grads is not None and own:
            mine = [grads[index[id(p)]] for p in own]
            finite = [torch.where(torch.isfinite(g), g, torch.zeros_like(g)) for g in mine if g is not None]
            row.grads_nonfinite = sum(nonfinite[index[id(p)]] for p in own)
            row.grads_underflow = sum(lost[index[id(p)]] for p in own) if fp16 else 0
            row.grads_over = sum(_over(g) for g in finite)
            if finite:
                row.grad_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in finite))
            if ref_grads is not None:
                pairs = [(grads[index[id(p)]], ref_grads[index[id(p)]]) for p in own]
                pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
                if pairs:
                    row.grad_error = _rel(torch.cat([a.flatten() for a, _ in pairs]),
                                          torch.cat([b.flatten() for _, b in pairs]))
        if ref_outputs is not None and run.outputs.outputs.get(name) and ref_outputs.get(name):
            mine_out, theirs = run.outputs.outputs[name], ref_outputs[name]
            if len(mine_out) == len(theirs) and all(a.shape == b.shape for a, b in zip(mine_out, theirs)):
                row.output_error = _rel(torch.cat([a.float().flatten() for a in mine_out]),
                                        torch.cat([b.float().flatten() for b in theirs]))
        rows.append(row)
    forward_ops = [o for o in run.ops if not o.backward]
    fp8_modules = {r.name for r in rows if r.fp8 and r.fp8.startswith("fp8 (")}
    unique_finite = [torch.where(torch.isfinite(g), g, torch.zeros_like(g)) for g in (grads or []) if g is not None]
    beyond = fp16 and not run.forward_only and (run.forward_bad is not None or run.scales.get(1.0, (0, 0))[0] > 0)
    safe = None
    if fp16 and run.scales and not beyond:
        clean = {s: v for s, v in run.scales.items() if not v[0]}
        if clean:
            fewest = min(v[1] for v in clean.values())
            best = [s for s, v in clean.items() if v[1] == fewest]
            safe = (min(best), max(best))
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
        misaligned_flops=sum(o.flops for o in forward_ops if o.misaligned), safe_scales=safe,
        grad_norm=math.sqrt(sum(float(g.double().pow(2).sum()) for g in unique_finite)) if grads else math.nan,
        params_over=sum(_over(p) for p in model.parameters()), grads_over=sum(_over(g) for g in unique_finite),
        grads_underflow=sum(lost) if fp16 else 0, outputs_over=sum(r.outputs_over for r in rows),
        grads_nonfinite=sum(nonfinite), backward_flops=sum(o.flops for o in run.ops if o.backward),
        scales=dict(sorted(run.scales.items())), backwards_run=run.backwards, beyond_scaling=beyond,
        first_nonfinite_forward=run.forward_bad, first_nonfinite_backward=run.backward_bad, head=head, notes=notes,
    )


def _first_dtype(outputs: list[torch.Tensor] | None) -> str | None:
    return str(outputs[0].dtype).replace("torch.", "") if outputs else None


def _dtypes(ops: list[Op]) -> str:
    return "/".join(sorted({str(o.dtype).replace("torch.", "") for o in ops}))


def _fp32_reason(name: str, module: nn.Module, row: ModuleRow, forward: list[Op], input_dtype: str | None,
                 policed: set[str]) -> str | None:
    if name in policed:
        return "precision policy"
    if forward and row.low_flops == 0:
        return "float32 input" if input_dtype == "float32" and not isinstance(module, _FP32_BY_AUTOCAST) \
            else "autocast: float32 op"
    if not forward and isinstance(module, _FP32_BY_AUTOCAST) and row.output_dtype == "float32":
        return "autocast: float32 op" if input_dtype in ("float16", "bfloat16") else "float32 input"
    return None


#: Modules whose op autocast runs in float32 whatever the dtype (torch's fp32 lists).
_FP32_BY_AUTOCAST: tuple[type, ...] = (
    nn.LayerNorm, nn.GroupNorm, nn.Softmax, nn.LogSoftmax, nn.CrossEntropyLoss, nn.NLLLoss, nn.MSELoss,
    nn.L1Loss, nn.SmoothL1Loss, nn.KLDivLoss, nn.BCEWithLogitsLoss,
)


