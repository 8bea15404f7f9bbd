"""What :func:`~amp_backends.check_model` found: per-module rows and model-wide figures, as a summary,
a table and JSON."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..tracing.opcount import NonFinite

__all__ = ["FP16_MAX", "FP16_TINY", "ModelReport", "ModuleRow"]

FP16_MAX = 65504.0
#: float16's smallest subnormal: a smaller magnitude becomes 0 in fp16.
FP16_TINY = 2.0**-24


def pow2(x: float) -> str:
    """``2**k`` for a power of two, else the number."""
    k = math.log2(x) if x > 0 else math.nan
    return f"2**{int(k)}" if k == int(k) else f"{x:g}"


@dataclass
class ModuleRow:
    """What one module did (its own ops, not its children's)."""

    name: str
    type: str
    #: "float16", "bfloat16", "float32", or "-" where the module ran no matmul-like op itself
    compute: str = "-"
    flops: int = 0
    low_flops: int = 0
    #: the dtypes its backward matmuls ran in (input and weight gradients), "-" where none ran
    backward_compute: str = "-"
    backward_flops: int = 0
    #: why it stayed in float32 ("precision policy", "autocast: float32 op", "float32 input") or None
    fp32_reason: str | None = None
    #: shapes of low-precision matmuls/convolutions off the 8-multiple fast path, e.g. "mm 30x100x7"
    misaligned: list[str] = field(default_factory=list)
    misaligned_flops: int = 0
    output_dtype: str | None = None
    #: elements above fp16's range: in the parameters, the outputs, the gradients
    params_over: int = 0
    outputs_over: int = 0
    grads_over: int = 0
    #: gradient elements of its own parameters lost to float16 at the loss scale checked (zero there,
    #: not in float32)
    grads_underflow: int = 0
    #: gradient elements that came out inf/NaN at the loss scale checked (float32's too)
    grads_nonfinite: int = 0
    #: gradient elements of its own parameters lost to the model's fp8 layers at the scale checked (the
    #: same model without fp8 keeps them there): not in grads_underflow
    grads_lost_fp8: int = 0
    #: the norm of its parameters' gradients: inf/NaN where one holds inf/NaN (as clip_grad_norm_ returns it)
    grad_norm: float | None = None
    #: relative error against the float32 run: ||low - fp32|| / ||fp32|| of its outputs and gradients
    output_error: float | None = None
    grad_error: float | None = None
    #: for Linear layers: "fp8 (tensorwise)" where a policy trains it in fp8, else "eligible" or why it
    #: cannot run in fp8; None for other modules
    fp8: str | None = None
    fp8_flops: int = 0
    #: what it holds for backward once the forward is done (its own saves): activations by dtype name,
    #: autocast's copies of parameters, and the same under memory_lean (None: not measured)
    saved: dict[str, int] = field(default_factory=dict)
    weight_copies: int = 0
    lean_held: int | None = None

    @property
    def held(self) -> int:
        """Bytes it holds for backward after the forward (activations and weight copies)."""
        return sum(self.saved.values()) + self.weight_copies

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
    #: the longest run of consecutive powers of two among ``best_scales`` (the higher of two as long),
    #: every scale in it measured; None where no scale works (or float16 is not the dtype). The summary
    #: names every run of ``best_scales`` and what the scales between them measured
    safe_scales: tuple[float, float] | None
    #: the norm of the gradients at the scale checked, unscaled, every value in: inf or NaN where one is
    #: (what clip_grad_norm_ returns); NaN where no backward ran
    grad_norm: float
    params_over: int
    grads_over: int
    grads_underflow: int
    outputs_over: int
    grads_nonfinite: int = 0
    backward_flops: int = 0
    #: per scale tried (every power of two from 2**-24 to 2**30): (gradient elements inf/NaN, gradient
    #: elements lost to float16: what fp8's quantisation loses, ``grads_lost_fp8``, left out)
    scales: dict[float, tuple[int, int]] = field(default_factory=dict)
    #: per scale tried, for a model with fp8 layers: gradient elements lost to the fp8 layers (the same
    #: model without fp8 keeps them at that scale); {} without fp8 layers
    scales_lost_fp8: dict[float, int] = field(default_factory=dict)
    #: every scale tried with no inf/NaN gradient that loses the fewest values, ascending (measured: they
    #: need not be consecutive)
    best_scales: list[float] = field(default_factory=list)
    #: scaled backward passes the measurement ran (its cost)
    backwards_run: int = 0
    #: no loss scale can save this model in float16: its loss is inf/NaN (the forward overflowed), or its
    #: gradients hold inf/NaN at every scale tried
    beyond_scaling: bool = False
    #: whether the loss of the low-precision forward is finite (None: forward only)
    loss_finite: bool | None = None
    #: gradient values lost to the fp8 layers at the scale checked: zero there, where the same model without
    #: fp8 (its fp8 layers as plain Linear layers, the same autocast) keeps them at that scale; not in
    #: ``grads_underflow`` nor in ``scales``' figures (per scale: ``scales_lost_fp8``)
    grads_lost_fp8: int = 0
    #: forward matmul FLOPs of the layers trained in fp8 (not counted in ``low_flops``)
    fp8_flops: int = 0
    first_nonfinite_forward: NonFinite | None = None
    first_nonfinite_backward: NonFinite | None = None
    #: the module that ran the forward's last matmul-like op (the head, where one exists)
    head: str | None = None
    notes: list[str] = field(default_factory=list)
    #: held for backward after the forward, over all modules: activations by dtype, autocast's weight
    #: copies, and the same under memory_lean (None: not measured)
    saved_by_dtype: dict[str, int] = field(default_factory=dict)
    weight_copies: int = 0
    lean_held: int | None = None
    #: the norm of the finite gradient values alone (``grad_norm`` where every value is finite)
    grad_norm_finite: float = math.nan
    #: what is inf/NaN in the float32 reference too, no precision problem (None and 0 where it is finite,
    #: or no reference ran): whether its loss is finite, the first module whose float32 output holds
    #: inf/NaN, the gradient values inf/NaN at the scale checked and in float32 alike (in
    #: ``grads_nonfinite``, not in ``scales``' counts), and the modules whose float32 gradients hold inf/NaN
    fp32_loss_finite: bool | None = None
    fp32_nonfinite_output: str | None = None
    fp32_grads_nonfinite: int = 0
    fp32_nonfinite_grads: list[str] = field(default_factory=list)

    @property
    def held(self) -> int:
        """Bytes held for backward after the forward (activations and autocast's weight copies)."""
        return sum(self.saved_by_dtype.values()) + self.weight_copies

    @property
    def memory_summary(self) -> str:
        """Where the saved-for-backward memory is: the total by dtype, the module holding most, and what
        memory_lean would hold ("" where the ledger was not run)."""
        if not self.saved_by_dtype and not self.weight_copies:
            return ""
        dtypes = ", ".join(f"{k} {_mib(v)}" for k, v in sorted(self.saved_by_dtype.items(), key=lambda kv: -kv[1]))
        text = f"held for backward after the forward: {_mib(self.held)} ({dtypes or 'no activations'}"
        text += f"; autocast's weight copies {_mib(self.weight_copies)})" if self.weight_copies else ")"
        top = max(self.rows, key=lambda r: r.held)
        if top.held:
            dtype = max(top.saved.items(), key=lambda kv: kv[1])[0] if top.saved else "weight copies"
            text += f", most by {_label(top)} ({_mib(top.held)}, mostly {dtype})"
        if self.lean_held is not None and self.held:
            text += (f"; memory_lean would hold {_mib(self.lean_held)} "
                     f"({100.0 * (self.lean_held - self.held) / self.held:+.0f}%)")
        return text

    @property
    def fp32_layers(self) -> list[ModuleRow]:
        return [r for r in self.rows if r.fp32_reason]

    @property
    def misaligned_layers(self) -> list[ModuleRow]:
        return [r for r in self.rows if r.misaligned]

    @property
    def summary(self) -> str:
        if not self.total_flops:
            parts = ["no matmul or convolution ran: nothing for autocast to lower"]
        else:
            parts = [f"{100.0 * self.low_flops / self.total_flops:.0f}% of matmul FLOPs in {self.dtype}"]
            if self.fp8_flops:
                emulated = " (emulated)" if any(r.fp8 and "emulated" in r.fp8 for r in self.rows) else ""
                parts = [f"{100.0 * self.fp8_flops / self.total_flops:.0f}% of matmul FLOPs in fp8{emulated}, "
                         f"{100.0 * self.low_flops / self.total_flops:.0f}% in {self.dtype}"]
        fp32 = self.fp32_layers
        if fp32:
            parts.append(f"{len(fp32)} layer{'s' if len(fp32) != 1 else ''} in float32 "
                         f"({', '.join(map(_label, fp32[:4]))}{', ...' if len(fp32) > 4 else ''})")
        off = self.misaligned_layers
        if off:
            pct = 100.0 * self.misaligned_flops / self.total_flops if self.total_flops else 0.0
            shown = ", ".join(f"{_label(r)} {r.misaligned[0]}" for r in off[:3])
            parts.append(f"{len(off)} layer{'s' if len(off) != 1 else ''} off Tensor-Core shapes "
                         f"({pct:.1f}% of FLOPs): {shown}{', ...' if len(off) > 3 else ''}")
        if self.first_nonfinite_forward is not None:
            parts.append(f"inf/NaN first in the {self.first_nonfinite_forward}")
        if self.first_nonfinite_backward is not None and self.first_nonfinite_forward is None:
            parts.append(f"at scale {self.loss_scale:g}, inf/NaN first in the {self.first_nonfinite_backward}")
        parts += self._fp32_nonfinite()
        low_only = self.grads_nonfinite - self.fp32_grads_nonfinite  # inf/NaN the float32 gradients do not hold
        if self.dtype == "float16":
            if self.beyond_scaling:
                why = ("its forward overflows: the loss is inf/NaN before any scaling" if self.loss_finite is False
                       else f"its gradients hold inf/NaN at every scale from {pow2(min(self.scales))} to "
                            f"{pow2(max(self.scales))}")
                parts.append(f"no loss scale can save this model in float16: {why} (keep the layer that overflows "
                             "in float32 with a precision policy, or use bfloat16)")
            else:
                if low_only:
                    parts.append(f"the backward overflows at scale {self.loss_scale:g} ({low_only} "
                                 "inf/NaN gradient values): the scaler would skip and back off")
                if self.grads_underflow:
                    parts.append(f"{self.grads_underflow} gradient values lost to float16 at scale {self.loss_scale:g}")
                if self.safe_scales:
                    parts.append(self._best_text())
            if self.scales_lost_fp8 and any(self.scales_lost_fp8.values()):
                clean = [n for s, n in self.scales_lost_fp8.items() if not self.scales.get(s, (1, 0))[0]]
                spread = f"{min(clean)}..{max(clean)}" if clean and min(clean) != max(clean) else \
                    (str(clean[0]) if clean else "-")
                parts.append(f"{self.grads_lost_fp8} gradient values lost to the fp8 layers at scale "
                             f"{self.loss_scale:g}, not to float16 (the same model without fp8 keeps them there; "
                             f"{spread} at each scale without inf/NaN: loss scaling does not recover them)")
            if self.grads_over or self.params_over or self.outputs_over:
                parts.append(f"values over fp16's 65504: {self.params_over} in parameters, {self.outputs_over} in "
                             f"outputs, {self.grads_over} in gradients")
        elif low_only > 0:
            finite32 = " (finite in float32)" if self.fp32_loss_finite is not None else ""
            parts.append(f"{low_only} gradient values inf/NaN in {self.dtype}{finite32}: the step would carry them")
        if self.grads_nonfinite and self.loss_finite is not None:
            parts.append(f"gradient norm {self.grad_norm:.4g} ({self.grads_nonfinite} inf/NaN gradient values; the "
                         f"norm of the finite ones {self.grad_norm_finite:.4g})")
        elif self.loss_finite is not None and self.grad_norm == self.grad_norm:  # a backward ran
            parts.append(f"gradient norm {self.grad_norm:.4g}")
        if self.memory_summary:
            parts.append(self.memory_summary)
        parts += self.notes
        return "; ".join(parts)

    def _fp32_nonfinite(self) -> list[str]:
        """What is inf/NaN in the float32 reference too: the model's, whatever the precision."""
        said = []
        if self.fp32_loss_finite is False:
            where = "" if self.fp32_nonfinite_output is None else \
                f": inf/NaN first in the float32 output of {self.fp32_nonfinite_output or '(model)'}"
            said.append(f"the loss is non-finite in float32 too (not a precision problem){where}")
        if self.fp32_grads_nonfinite:
            mods = ", ".join(n or "(model)" for n in self.fp32_nonfinite_grads[:4])
            more = ", ..." if len(self.fp32_nonfinite_grads) > 4 else ""
            said.append(f"{self.fp32_grads_nonfinite} gradient values non-finite in float32 too (not a precision "
                        f"problem): in the gradients of {mods}{more}, where a scaler would skip every step in any dtype")
        return said

    def _best_text(self) -> str:
        """Every best scale, as runs of consecutive powers of two, each measured; and what the scales
        between two runs measured (they are not best)."""
        from .scales import gaps, runs

        spans = ", ".join(_span(a, b) for a, b in runs(self.best_scales))
        fewest = self.scales[self.best_scales[0]][1] if self.best_scales[0] in self.scales else 0
        between = [f"{_span(a, b)} " + (f"overflow ({bad} inf/NaN values)" if bad else f"lose {lost}")
                   for a, b, bad, lost in gaps(self.scales, self.best_scales)]
        shown = ", ".join(between[:4]) + (f", and {len(between) - 4} more" if len(between) > 4 else "")
        gap = f"; between them, measured: {shown}" if between else ""
        return (f"best loss scales {spans} ({fewest} values lost to float16 at each{gap}; measured: "
                f"{self.backwards_run} scaled backward passes)")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["scales"] = {str(k): list(v) for k, v in self.scales.items()}
        out["scales_lost_fp8"] = {str(k): v for k, v in self.scales_lost_fp8.items()}
        for key in ("first_nonfinite_forward", "first_nonfinite_backward"):
            value = getattr(self, key)
            out[key] = None if value is None else {**asdict(value), "text": str(value)}
        out["summary"] = self.summary
        out["held"] = self.held
        for row, data in zip(self.rows, out["rows"]):
            data["held"] = row.held
        return out

    def table(self) -> str:
        """The per-module table the CLI prints (modules that ran something or were flagged)."""
        from ..console import render_table

        shown = [r for r in self.rows if r.compute != "-" or r.backward_compute != "-" or r.fp32_reason
                 or r.misaligned or r.grads_underflow or r.params_over or r.grads_over or r.outputs_over
                 or r.grads_nonfinite or r.held]
        rows = [[_label(r), r.type, r.precision, r.backward_compute,
                 f"{(r.flops + r.backward_flops) / 1e6:.2f}", r.fp32_reason or "",
                 "; ".join(r.misaligned[:2]) + (" ..." if len(r.misaligned) > 2 else ""),
                 _count(r.grads_underflow), _count(r.params_over + r.outputs_over + r.grads_over + r.grads_nonfinite),
                 _err(r.output_error), _err(r.grad_error), "" if r.grad_norm is None else f"{r.grad_norm:.3g}",
                 r.fp8 or "", _held(r)]
                for r in shown]
        head = ["module", "type", "forward", "backward", "MFLOPs", "float32 because", "off fast path",
                "grad lost", "over 65504 / inf", "out err", "grad err", "grad norm", "fp8", "held (lean)"]
        return render_table(head, rows)


def _span(lo: float, hi: float) -> str:
    return pow2(lo) if lo == hi else f"{pow2(lo)}..{pow2(hi)}"


def _label(row: ModuleRow) -> str:
    return row.name or "(model)"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**16 else f"{n / 1024:.1f} KiB"


def _held(row: ModuleRow) -> str:
    if not row.held:
        return ""
    return _mib(row.held) + ("" if row.lean_held is None else f" ({_mib(row.lean_held)})")


def _count(n: int) -> str:
    return str(n) if n else ""


def _err(x: float | None) -> str:
    return "" if x is None else f"{x:.2e}"


