"""What AMP will do to a model, before it trains: :func:`check_model` and ``amp-backends check``.

One forward and backward under the backend's autocast (and its scaler), observed, not changed:

- per module, the dtype each matmul and convolution of the forward actually ran in (seen below
  autocast, by a ``TorchDispatchMode``), and its FLOPs (attention kernels are not counted);
- modules left in float32: by autocast's own op lists, or by a precision policy;
- low-precision matmul/conv shapes off the fast path (dimensions not multiples of 8: the
  fp16/bf16 Tensor Core / matrix-core granularity), and the share of FLOPs affected;
- values outside float16's range: parameters, module outputs and gradients above 65504 (inf
  in fp16), and gradients that would underflow (below 2**-24, fp16's smallest subnormal) at the
  scaler's loss scale, with the range of scales at which they would not;
- the gradient norm per module, from the unscaled gradients.

The model's parameters, gradients and mode are left as they were.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .backend import Backend

__all__ = ["FP16_MAX", "FP16_TINY", "ModelReport", "ModuleRow", "check_model"]

FP16_MAX = 65504.0
#: float16's smallest subnormal: a smaller magnitude becomes 0 in fp16.
FP16_TINY = 2.0**-24
#: fp16/bf16 Tensor Cores (and AMD matrix cores) take dimensions in multiples of this.
ALIGN = 8
_LOW = (torch.float16, torch.bfloat16)

_aten = torch.ops.aten
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
_CONVS = {_aten.convolution.default}


@dataclass
class ModuleRow:
    """What one module did (its own ops, not its children's)."""

    name: str
    type: str
    #: "float16", "bfloat16", "float32", or "-" where the module ran no matmul/convolution itself
    compute: str = "-"
    flops: int = 0
    low_flops: int = 0
    #: why it stayed in float32 ("policy: ...", "autocast: float32 op") or None
    fp32_reason: str | None = None
    #: shapes of low-precision matmuls/convolutions off the 8-multiple fast path, e.g. "mm 30x100x7"
    misaligned: list[str] = field(default_factory=list)
    misaligned_flops: int = 0
    output_dtype: str | None = None
    #: elements above fp16's range: in the parameters, the outputs, the gradients
    params_over: int = 0
    outputs_over: int = 0
    grads_over: int = 0
    #: gradient elements that would be 0 in fp16 at the loss scale checked
    grads_underflow: int = 0
    #: gradient elements that came out inf/NaN (the scaled backward overflowed: the step would be skipped)
    grads_nonfinite: int = 0
    grad_norm: float | None = None

    @property
    def precision(self) -> str:
        return self.compute if self.compute != "-" else (self.output_dtype or "-")


@dataclass
class ModelReport:
    """The result of :func:`check_model`: per-module rows and model-wide figures."""

    backend: str
    dtype: str
    loss_scale: float
    rows: list[ModuleRow]
    total_flops: int
    low_flops: int
    misaligned_flops: int
    #: the loss scales (powers of two) at which no gradient overflows or underflows fp16, or None
    safe_scales: tuple[float, float] | None
    grad_norm: float
    params_over: int
    grads_over: int
    grads_underflow: int
    outputs_over: int
    grads_nonfinite: int = 0

    @property
    def fp32_layers(self) -> list[ModuleRow]:
        return [r for r in self.rows if r.fp32_reason]

    @property
    def misaligned_layers(self) -> list[ModuleRow]:
        return [r for r in self.rows if r.misaligned]

    @property
    def summary(self) -> str:
        share = 100.0 * self.low_flops / self.total_flops if self.total_flops else 0.0
        parts = [f"{share:.0f}% of matmul FLOPs in {self.dtype}"]
        fp32 = self.fp32_layers
        if fp32:
            parts.append(f"{len(fp32)} layer{'s' if len(fp32) != 1 else ''} in float32 "
                         f"({', '.join(r.name for r in fp32[:4])}{', ...' if len(fp32) > 4 else ''})")
        off = self.misaligned_layers
        if off:
            pct = 100.0 * self.misaligned_flops / self.total_flops if self.total_flops else 0.0
            parts.append(f"{len(off)} layer{'s' if len(off) != 1 else ''} off Tensor-Core shapes "
                         f"({pct:.1f}% of FLOPs): {', '.join(f'{r.name} {r.misaligned[0]}' for r in off[:3])}"
                         f"{', ...' if len(off) > 3 else ''}")
        if self.grads_nonfinite:
            parts.append(f"the backward overflowed at scale {self.loss_scale:g} ({self.grads_nonfinite} inf/NaN "
                         "gradient values): the scaler would skip this step and back off")
        if self.dtype == "float16":
            if self.grads_underflow:
                parts.append(f"{self.grads_underflow} gradient values underflow fp16 at scale {self.loss_scale:g}")
            if self.grads_over or self.params_over or self.outputs_over:
                parts.append(f"values over fp16's 65504: {self.params_over} in parameters, {self.outputs_over} in "
                             f"outputs, {self.grads_over} in gradients")
            if self.safe_scales:
                parts.append(f"safe loss scales {self.safe_scales[0]:g}..{self.safe_scales[1]:g}")
        parts.append(f"gradient norm {self.grad_norm:.4g}")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["summary"] = self.summary
        return out

    def table(self) -> str:
        """The per-module table the CLI prints (modules that ran something or were flagged)."""
        from .console import render_table

        shown = [r for r in self.rows if r.compute != "-" or r.fp32_reason or r.misaligned or r.grads_underflow
                 or r.params_over or r.grads_over or r.outputs_over or r.grads_nonfinite]
        rows = [[r.name or "(model)", r.type, r.precision, f"{r.flops / 1e6:.2f}", r.fp32_reason or "",
                 "; ".join(r.misaligned[:2]) + (" ..." if len(r.misaligned) > 2 else ""),
                 _count(r.grads_underflow), _count(r.params_over + r.outputs_over + r.grads_over + r.grads_nonfinite),
                 "" if r.grad_norm is None else f"{r.grad_norm:.3g}"] for r in shown]
        head = ["module", "type", "precision", "MFLOPs", "float32 because", "off fast path", "grad underflow",
                "over 65504 / inf", "grad norm"]
        return render_table(head, rows)


def _count(n: int) -> str:
    return str(n) if n else ""


def _matmul(func: Any, args: tuple[Any, ...]) -> tuple[str, torch.dtype, int, tuple[int, ...]]:
    """(label, dtype, FLOPs, dimensions that need alignment) of a matmul op: mm/bmm take (a, b),
    addmm/baddbmm (bias, a, b)."""
    a, b = (args[1], args[2]) if func in (_aten.addmm.default, _aten.baddbmm.default) else (args[0], args[1])
    batch, m, k, n = (a.shape[0], a.shape[1], a.shape[2], b.shape[2]) if a.dim() == 3 else (1, *a.shape, b.shape[1])
    return f"{func.__name__.split('.')[0]} {m}x{n}x{k}", a.dtype, 2 * batch * m * n * k, (m, n, k)


def _convolution(args: tuple[Any, ...], result: torch.Tensor) -> tuple[str, torch.dtype, int, tuple[int, ...]]:
    """The same for ``aten.convolution`` (input, weight, bias, stride, padding, dilation,
    transposed, output_padding, groups): the channels need alignment."""
    x, w = args[0], args[1]
    groups = args[8] if len(args) > 8 else 1
    flops = 2 * result.numel() * w.shape[1] * math.prod(w.shape[2:])
    return f"conv {x.shape[1]}->{w.shape[0]} k{'x'.join(map(str, w.shape[2:]))}", x.dtype, flops, (w.shape[0], w.shape[1] * groups)


class _Recorder(TorchDispatchMode):
    """Attributes each matmul/convolution to the innermost module running."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack
        self.ops: dict[str, list[tuple[str, torch.dtype, int, str | None]]] = defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = func(*args, **(kwargs or {}))
        if func in _MATMULS or func in _CONVS:
            label, dtype, flops, dims = _matmul(func, args) if func in _MATMULS else _convolution(args, result)
            misaligned = dtype in _LOW and any(d % ALIGN for d in dims)
            self.ops[self.stack[-1] if self.stack else ""].append((label, dtype, flops, label if misaligned else None))
        return result


def _over(t: torch.Tensor | None) -> int:
    if t is None or not t.is_floating_point() or t.numel() == 0:
        return 0
    return int((t.detach().abs().float() > FP16_MAX).sum())


def _first_tensor(x: Any) -> torch.Tensor | None:
    for leaf in torch.utils._pytree.tree_leaves(x):
        if isinstance(leaf, torch.Tensor):
            return leaf
    return None


def _default_loss(output: Any) -> torch.Tensor:
    floats = [t for t in torch.utils._pytree.tree_leaves(output)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not floats:
        raise ValueError("check_model: the model's output has no floating tensor that requires grad; pass loss_fn")
    return sum(t.float().mean() for t in floats)  # type: ignore[return-value]


def _as_args(example_inputs: Any) -> tuple[Any, ...]:
    return example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)


def check_model(
    model: nn.Module,
    example_inputs: Any,
    backend: str | Backend | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    loss_scale: float | None = None,
) -> ModelReport:
    """Run one forward and backward of ``model`` on ``example_inputs`` (a tensor or a tuple of
    positional arguments, already on the backend's device) under the backend's autocast and report
    what ran in which precision. ``loss_fn(output)`` makes the loss (default: the mean of the
    floating outputs); ``loss_scale`` the scale to judge fp16 underflow at (default: the scaler's
    initial scale, 2**16)."""
    from .registry import resolve_backend
    from .scaler import GradScaler

    if not isinstance(model, nn.Module):
        raise TypeError(f"check_model takes a torch.nn.Module, got {type(model).__name__}")
    be = resolve_backend(backend)
    low = be.resolve_dtype(dtype)
    scale = float(loss_scale) if loss_scale is not None else 2.0**16
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"check_model: loss_scale must be a positive finite number, got {loss_scale!r}")
    from .precision import fp32_modules

    policed = set(fp32_modules(model))
    names = {id(m): n for n, m in model.named_modules()}
    stack: list[str] = []
    outputs_over: dict[str, int] = defaultdict(int)
    output_dtypes: dict[str, str] = {}

    def pre(module: nn.Module, _: Any) -> None:
        stack.append(names.get(id(module), "?"))

    def post(module: nn.Module, _: Any, output: Any) -> None:
        name = stack.pop() if stack else names.get(id(module), "?")
        first = _first_tensor(output)
        if first is not None and first.is_floating_point():
            output_dtypes[name] = str(first.dtype).replace("torch.", "")
        outputs_over[name] += sum(_over(t) for t in torch.utils._pytree.tree_leaves(output)
                                  if isinstance(t, torch.Tensor))

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, always_call=True))
    params = [p for p in model.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    recorder = _Recorder(stack)
    try:
        scaler = GradScaler(be, init_scale=scale, enabled=low == torch.float16)
        with recorder, be.autocast(low):
            output = model(*_as_args(example_inputs))
            loss = (loss_fn or _default_loss)(output)
        scaler.scale(loss).backward()
        grads = {id(p): (p.grad.detach().float() if p.grad is not None else None) for p in params}
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(params, saved_grads):
            p.grad = g
        stack.clear()
    inv = 1.0 / scale if low == torch.float16 else 1.0
    rows: list[ModuleRow] = []
    totals = defaultdict(int)
    smallest, largest = math.inf, 0.0
    norm_sq_total = 0.0
    for name, module in model.named_modules():
        row = ModuleRow(name, type(module).__name__, output_dtype=output_dtypes.get(name))
        ops = recorder.ops.get(name, [])
        if ops:
            dtypes = {d for _, d, _, _ in ops}
            row.compute = "/".join(sorted(str(d).replace("torch.", "") for d in dtypes))
            row.flops = sum(f for _, _, f, _ in ops)
            row.low_flops = sum(f for _, d, f, _ in ops if d in _LOW)
            row.misaligned = list(dict.fromkeys(label for _, _, _, label in ops if label))
            row.misaligned_flops = sum(f for _, _, f, label in ops if label)
        if name in policed:
            row.fp32_reason = "precision policy"
        elif ops and row.low_flops == 0:
            row.fp32_reason = "autocast: float32 op (or float32 inputs)"
        elif not ops and isinstance(module, _FP32_BY_AUTOCAST) and row.output_dtype == "float32":
            row.fp32_reason = "autocast: float32 op"
        own = list(module.parameters(recurse=False))
        row.params_over = sum(_over(p) for p in own)
        row.outputs_over = outputs_over.get(name, 0)
        sq = 0.0
        seen_grad = False
        for p in own:
            g = grads.get(id(p))
            if g is None:
                continue
            seen_grad = True
            true = g * inv  # the unscaled gradient
            finite = torch.isfinite(true)
            row.grads_nonfinite += int((~finite).sum())
            true = torch.where(finite, true, torch.zeros_like(true))
            row.grads_over += _over(true)
            scaled = true.abs() * scale if low == torch.float16 else true.abs()
            nonzero = true.abs()[true != 0]
            if nonzero.numel():
                smallest = min(smallest, float(nonzero.min()))
                largest = max(largest, float(nonzero.max()))
            if low == torch.float16:
                row.grads_underflow += int(((scaled < FP16_TINY) & (true != 0)).sum())
            sq += float(true.double().pow(2).sum())
        if seen_grad:
            row.grad_norm = math.sqrt(sq)
            norm_sq_total += sq
        for key in ("flops", "low_flops", "misaligned_flops", "params_over", "grads_over", "grads_underflow",
                    "outputs_over", "grads_nonfinite"):
            totals[key] += getattr(row, key)
        rows.append(row)
    safe = None
    if low == torch.float16 and largest > 0:
        lo = 2.0 ** math.ceil(math.log2(FP16_TINY / smallest))
        hi = 2.0 ** math.floor(math.log2(FP16_MAX / largest))
        safe = (max(lo, 2.0**-24), hi) if lo <= hi else None
    return ModelReport(
        backend=be.name, dtype=str(low).replace("torch.", ""), loss_scale=scale, rows=rows,
        total_flops=totals["flops"], low_flops=totals["low_flops"], misaligned_flops=totals["misaligned_flops"],
        safe_scales=safe, grad_norm=math.sqrt(norm_sq_total), params_over=totals["params_over"],
        grads_over=totals["grads_over"], grads_underflow=totals["grads_underflow"],
        outputs_over=totals["outputs_over"], grads_nonfinite=totals["grads_nonfinite"],
    )


#: Modules whose op autocast runs in float32 whatever the dtype (torch's fp32 lists).
_FP32_BY_AUTOCAST: tuple[type, ...] = (
    nn.LayerNorm, nn.GroupNorm, nn.Softmax, nn.LogSoftmax, nn.CrossEntropyLoss, nn.NLLLoss, nn.MSELoss,
    nn.L1Loss, nn.SmoothL1Loss, nn.KLDivLoss, nn.BCEWithLogitsLoss,
)


def load_target(target: str, size: str = "small") -> tuple[nn.Module, Any, Callable[[Any], torch.Tensor] | None]:
    """``MODULE:FACTORY`` (the factory returns ``(model, example_inputs[, loss_fn])``) or
    ``bench:NAME``; a clear error for anything else."""
    import importlib

    from .errors import AmpBackendsError

    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise AmpBackendsError(f"{target!r} is not MODULE:FACTORY (e.g. mypkg.models:make, or bench:gpt2-small)")
    if module_name == "bench":
        from .bench_models import MODELS

        if attr not in MODELS:
            raise AmpBackendsError(f"bench:{attr}: no such bench model; choose from {', '.join(MODELS)}")
        spec = MODELS[attr]
        torch.manual_seed(0)  # the bench's initialisation: the same report every run
        inputs, targets = spec.batch(size, torch.device("cpu"), None)
        return spec.build(size), inputs, lambda out: spec.loss(out, targets)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AmpBackendsError(f"cannot import {module_name!r}: {exc} (is it on PYTHONPATH?)") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise AmpBackendsError(f"{module_name!r} has no callable {attr!r}")
    made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3) or not isinstance(made[0], nn.Module):
        raise AmpBackendsError(f"{target} must return (model, example_inputs) or (model, example_inputs, loss_fn), "
                               f"got {type(made).__name__}")
    return made[0], made[1], made[2] if len(made) == 3 else None


def main(target: str, backend: str | None, dtype: str | None, size: str, policy: str,
         loss_scale: float | None, as_json: bool) -> int:
    """``amp-backends check``: print the table and the summary (or JSON)."""
    import json

    from .errors import AmpBackendsError
    from .registry import resolve_backend

    if loss_scale is not None and not (math.isfinite(loss_scale) and loss_scale > 0):
        raise AmpBackendsError(f"--loss-scale must be a positive number, got {loss_scale:g}")
    be = resolve_backend(backend)
    model, inputs, loss_fn = load_target(target, size)
    dev = be.device()
    model = model.to(dev)
    inputs = torch.utils._pytree.tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, inputs)
    handle = None
    if policy == "recipe":
        from .precision import precision_policy

        handle = precision_policy(model, backend=be)
    try:
        report = check_model(model, inputs, be, dtype, loss_fn=loss_fn, loss_scale=loss_scale)
    finally:
        if handle is not None:
            handle.remove()
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.table())
        print()
        print(f"{be.name}, {report.dtype}: {report.summary}")
    return 0
