"""Quantization statistics per layer during training: for chosen Linear layers, every ``every`` steps,
what each matmul operand (:data:`.formats.OPERANDS`) loses in the layer's own format and in each
candidate format.

    stats = amp_backends.quant_stats(model, layers=[torch.nn.Linear], every=50)
    ...train...
    stats.read()      # {step: {layer: {"format": ..., "operands": {operand: {format: {figure: value}}}}}}

The figures (:func:`.quantize.figures`, torchao's quantizers in plain torch ops): ``underflow_pct``
(values not zero that quantize to zero), ``overflow_pct`` (values beyond the format's range: saturated
for fp8 and MX, inf for bf16 and fp16), ``mse``, ``rel_error`` (``sqrt(sse / sum of squares)``),
``amax``, ``scale_min`` and ``scale_max`` (the dequantization scales: ``value = q * scale``). The
hooks run only on sampled steps and keep their results as tensors on the layer's device; nothing is
read to the host until :meth:`QuantStats.read`, which reads everything pending in one transfer.

A step is one call of the model's ``forward`` (with gradient accumulation, a micro-batch). The
gradients seen are the ones autograd passes to the layer's output: scaled by a GradScaler's scale
where one is used, as the matmul sees them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .fp32_forward import Fp32Forward
from .formats import AXIS, TENSOR, check_formats, dtype_format, spec
from .quantize import MX_BLOCK, figures
from .selectors import Selector, check_selectors, select

__all__ = ["FIGURES", "QuantStats", "layer_format", "quant_stats"]

#: The figures each (operand, format) gets, in :meth:`QuantStats.read`.
FIGURES = ("underflow_pct", "overflow_pct", "mse", "rel_error", "amax", "scale_min", "scale_max", "numel")


def layer_format(module: nn.Module, device_type: str | None = None) -> str:
    """The format ``module``'s matmuls run in now: its fp8 or MX recipe, else the autocast dtype of
    ``device_type`` where autocast is on there, else its weight's dtype."""
    from .formats import FORMAT_OF_RECIPE

    recipe = getattr(module, "fp8_recipe", None)  # set on the layers a precision policy converts
    if isinstance(recipe, str) and recipe in FORMAT_OF_RECIPE:
        return FORMAT_OF_RECIPE[recipe]
    held = module.__dict__.get("forward")
    if isinstance(held, Fp32Forward) and held.holders:  # a precision policy runs it with autocast off
        return "fp32"
    if device_type is not None and torch.is_autocast_enabled(device_type):
        return dtype_format(torch.get_autocast_dtype(device_type))
    return dtype_format(module.weight.dtype) if module.weight.dtype in (torch.float32, torch.bfloat16,
                                                                      torch.float16) else "fp32"


class QuantStats:
    """Hooks on chosen Linear layers that measure, every ``every`` steps, each matmul operand in the
    layer's format and in ``formats``; :meth:`read` returns and clears what they kept, :meth:`remove`
    takes the hooks off."""

    def __init__(self, model: nn.Module, layers: dict[str, nn.Module], formats: tuple[str, ...], every: int) -> None:
        self.model, self.layers, self.formats, self.every = model, layers, formats, every
        self.step = 0  # the model's forward calls so far (the step being run is step - 1)
        self._pending: list[tuple[int, str, str, str, str, torch.Tensor, torch.Tensor]] = []
        self._formats_of: dict[tuple[int, str], str] = {}
        self._handles = [model.register_forward_pre_hook(self._count)]
        for name, module in layers.items():
            self._handles.append(module.register_forward_hook(self._hook(name)))

    # -- hooks ------------------------------------------------------------------------------
    def _count(self, module: nn.Module, args: Any) -> None:
        self.step += 1

    def _sampled(self) -> bool:
        return (self.step - 1) % self.every == 0

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not self._sampled() or not args or not isinstance(args[0], torch.Tensor):
                return
            step, x = self.step - 1, args[0].detach()
            own = layer_format(module, x.device.type)
            self._formats_of[(step, name)] = own
            x2 = x.reshape(-1, x.shape[-1])
            weight = module.weight.detach()
            done: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
            for operand in ("fwd.input", "fwd.weight", "dgrad.weight", "wgrad.input"):
                self._measure(step, name, own, operand, x2 if TENSOR[operand] == "input" else weight, done)
            if isinstance(output, torch.Tensor) and output.requires_grad and torch.is_grad_enabled():
                output.register_hook(self._grad_hook(step, name, own))
        return hook

    def _grad_hook(self, step: int, name: str, own: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            g = grad.detach().reshape(-1, grad.shape[-1])
            done: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
            for operand in ("dgrad.grad_output", "wgrad.grad_output"):
                self._measure(step, name, own, operand, g, done)
        return hook

    def _measure(self, step: int, name: str, own: str, operand: str, t: torch.Tensor,
                 done: dict[Any, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The figures of ``t`` as ``operand`` in each format; ``done``: those of the same tensor already
        measured, reused where the quantization does not depend on the axis (casts, one scale per tensor)."""
        axis = AXIS[operand]
        for fmt in dict.fromkeys((own, *self.formats)):
            s = spec(fmt, operand)
            if s.kind == "mx" and t.shape[axis] % MX_BLOCK:
                continue  # the format cannot take this operand's shape
            key = (id(t), s, None if s.kind in ("cast", "hp", "tensorwise") else axis)
            if key not in done:
                with torch.no_grad():
                    done[key] = figures(t, s, axis)
            counts, values = done[key]
            self._pending.append((step, name, operand, fmt, "own" if fmt == own else "", counts, values))

    # -- results ----------------------------------------------------------------------------
    def read(self) -> dict[int, dict[str, dict[str, Any]]]:
        """Everything measured since the last read, one host transfer: ``{step: {layer: {"format": the
        layer's format, "operands": {operand: {format: {figure: value}}}}}}`` (:data:`FIGURES`)."""
        pending, self._pending = self._pending, []
        if not pending:
            return {}
        counts = torch.stack([p[5].to(pending[0][5].device) for p in pending]).tolist()
        values = torch.stack([p[6].to(pending[0][6].device) for p in pending]).tolist()
        out: dict[int, dict[str, dict[str, Any]]] = {}
        for (step, name, operand, fmt, _, _, _), c, v in zip(pending, counts, values):
            numel, under, over = c
            sse, sum_sq, amax, smin, smax = v
            layer = out.setdefault(step, {}).setdefault(
                name, {"format": self._formats_of.get((step, name)), "operands": {}})
            layer["operands"].setdefault(operand, {})[fmt] = {
                "underflow_pct": 100.0 * under / numel if numel else 0.0,
                "overflow_pct": 100.0 * over / numel if numel else 0.0,
                "mse": sse / numel if numel else 0.0,
                "rel_error": math.sqrt(sse / sum_sq) if sum_sq > 0 else (0.0 if sse == 0 else math.inf),
                "amax": amax, "scale_min": smin, "scale_max": smax, "numel": numel}
        for key in [k for k in self._formats_of if k[0] in out]:
            del self._formats_of[key]
        return out

    @staticmethod
    def scalars(read: dict[int, dict[str, dict[str, Any]]]) -> dict[int, dict[str, float]]:
        """A :meth:`read` result flattened per step: ``"quant/<layer>/<operand>/<format>/<figure>" -> value``."""
        flat: dict[int, dict[str, float]] = {}
        for step, layers in read.items():
            row = flat.setdefault(step, {})
            for name, layer in layers.items():
                for operand, by_format in layer["operands"].items():
                    for fmt, figs in by_format.items():
                        for figure, value in figs.items():
                            if figure != "numel":
                                row[f"quant/{name}/{operand}/{fmt}/{figure}"] = float(value)
        return flat

    def to_tensorboard(self, writer: Any) -> dict[int, dict[str, dict[str, Any]]]:
        """Read, and write every figure to ``writer`` (a ``torch.utils.tensorboard.SummaryWriter``, or a
        log directory for one) with ``add_scalar(tag, value, step)``; returns what was read."""
        if isinstance(writer, str):
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError(f"QuantStats.to_tensorboard({writer!r}) needs tensorboard, which is not installed "
                                  f"({exc}): pip install tensorboard, or use read() and log the dict yourself") from None
            writer = SummaryWriter(writer)
        got = self.read()
        for step, row in self.scalars(got).items():
            for tag, value in row.items():
                writer.add_scalar(tag, value, step)
        return got

    def remove(self) -> None:
        """Take the hooks off (what was measured stays readable)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> QuantStats:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def quant_stats(model: nn.Module, layers: Selector | Sequence[Selector] = (nn.Linear,), *,
                formats: str | Sequence[str] = (), every: int = 100) -> QuantStats:
    """Measure, every ``every`` steps (forward calls of ``model``, the first one included), each matmul
    operand of the Linear layers ``layers`` selects (classes, name patterns, instances, predicates) in
    the layer's own format and in ``formats`` (:data:`.formats.FORMATS`; e.g.
    :data:`.formats.PLAN_FORMATS`, the candidates a plan weighs). Returns the
    :class:`QuantStats` holding the hooks."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"quant_stats takes a torch.nn.Module, got {type(model).__name__}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"quant_stats(every=...) takes a whole number of steps >= 1, got {every!r}")
    fmts = check_formats(formats, "quant_stats(formats=...)") if formats not in ((), []) else ()
    chosen, _ = select(model, check_selectors(layers, "layers"), head=None, argument="layers")
    picked: dict[str, nn.Module] = {}
    for name, (module, _) in chosen.items():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not isinstance(module, nn.Linear):
            raise ValueError(f"quant_stats(layers=...) selects '{name}' ({type(module).__name__}), which is not a "
                             "Linear layer; select Linear layers (e.g. layers=[torch.nn.Linear] or name patterns)")
        picked[name] = module
    if not picked:
        raise ValueError("quant_stats(layers=...) selects no Linear layer of the model; pass classes, name patterns "
                         "or modules that match its Linear layers")
    return QuantStats(model, picked, fmts, every)
