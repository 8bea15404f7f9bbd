"""Quantization statistics per layer during training: for chosen Linear layers, every ``every`` steps,
what each matmul operand (:data:`.formats.OPERANDS`) loses in the layer's own format and in each
candidate format.

    stats = amp_backends.quant_stats(model, layers=[torch.nn.Linear], every=50)
    ...train...
    stats.read()      # {step: {layer: {"format": ..., "operands": {operand: {format: {figure: value}}}}}}

The figures (:func:`.quantize.figures`, torchao's quantizers in plain torch ops): ``underflow_pct``
(values not zero that quantize to zero), ``overflow_pct`` (values beyond the format's range: past
the rounding boundary of fp8 and MX, saturated; inf for bf16 and fp16), ``mse``, ``rel_error``
(``sqrt(sse / sum of squares)``, the sums taken relative to ``amax`` and scaled back in float64),
``amax``, ``scale_min`` and ``scale_max`` (the dequantization scales: ``value = q * scale``). The
hooks run only on sampled steps and keep their results as tensors on the layer's device; nothing is
read to the host until :meth:`QuantStats.read`, which reads everything pending in one transfer.

A step is one call of the model's ``forward`` (with gradient accumulation, a micro-batch). A layer
called several times in a step (a shared layer) has figures covering every call: counts and sums
add, ``amax`` and ``scale_max`` are the largest, ``scale_min`` the smallest. Empty operands (a batch
of no tokens) are skipped. The gradients seen are the ones autograd passes to the layer's output:
scaled by a GradScaler's scale where one is used, as the matmul sees them. Forwards run by
:func:`~amp_backends.check_model` are no steps: the hooks pause while it runs (:func:`paused`).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .fp32_forward import Fp32Forward
from .formats import AXIS, FORMATS, RECIPE_OF, TENSOR, check_formats, dtype_format, spec
from .quantize import MX_BLOCK, figures
from .selectors import Selector, check_selectors, select

__all__ = ["FIGURES", "UNMATCHED_FP8", "QuantStats", "layer_format", "paused", "quant_stats"]

#: The figures each (operand, format) gets, in :meth:`QuantStats.read`.
FIGURES = ("underflow_pct", "overflow_pct", "mse", "rel_error", "amax", "scale_min", "scale_max", "numel")
#: The format said of a torchao fp8 or MX layer whose configuration is none of the recipes (it is
#: measured in ``formats`` only).
UNMATCHED_FP8 = "fp8 (a torchao configuration that is none of the recipes)"
#: The fields of torchao's ``Float8LinearConfig`` that decide the casts (not the kernels nor FSDP's).
_CAST_FIELDS = ("cast_config_input", "cast_config_input_for_grad_weight", "cast_config_weight",
                "cast_config_weight_for_grad_input", "cast_config_grad_output", "cast_config_grad_output_for_grad_weight",
                "round_scales_to_power_of_2")


def _torchao_format(module: nn.Module) -> str | None:
    """The format of a layer converted with torchao directly (``convert_to_float8_training``, or its MX
    layer): the recipe whose casts its config makes; None for any other layer."""
    config = getattr(module, "config", None)
    made = getattr(type(config), "from_recipe_name", None)  # torchao's recipe configs, from the config's own class
    if type(config).__name__ == "Float8LinearConfig" and callable(made):
        for fmt in ("fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_with_gw_hp"):
            recipe = made(RECIPE_OF[fmt])
            if all(getattr(config, f, None) == getattr(recipe, f, None) for f in _CAST_FIELDS):
                return fmt
        return UNMATCHED_FP8
    mode = getattr(module, "scale_calculation_mode", None)
    if type(module).__module__.startswith("torchao.") and hasattr(module, "wgrad_with_hp") and mode is not None:
        if getattr(mode, "name", None) != "RCEIL":  # the formats' MXFP8 is RCEIL's
            return UNMATCHED_FP8
        return "mxfp8_with_gw_hp" if module.wgrad_with_hp else "mxfp8"
    return None


def layer_format(module: nn.Module, device_type: str | None = None) -> str:
    """The format ``module``'s matmuls run in now: its fp8 or MX recipe (a policy's, or the one a torchao
    layer's config makes; :data:`UNMATCHED_FP8` for a config that is none), else the autocast dtype of
    ``device_type`` where autocast is on there, else its weight's dtype."""
    from .formats import FORMAT_OF_RECIPE

    recipe = getattr(module, "fp8_recipe", None)  # set on the layers a precision policy converts
    if isinstance(recipe, str) and recipe in FORMAT_OF_RECIPE:
        return FORMAT_OF_RECIPE[recipe]
    converted = _torchao_format(module)
    if converted is not None:
        return converted
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
        self._paused = 0  # > 0 while check_model runs the model: its forwards are not training steps
        self._handles = [model.register_forward_pre_hook(self._count)]
        for name, module in layers.items():
            self._handles.append(module.register_forward_hook(self._hook(name)))
        _LIVE.add(self)

    # -- hooks ------------------------------------------------------------------------------
    def _count(self, module: nn.Module, args: Any) -> None:
        if not self._paused:
            self.step += 1

    def _sampled(self) -> bool:
        return not self._paused and (self.step - 1) % self.every == 0

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
        if t.numel() == 0:
            return  # a batch of no tokens: nothing is quantized (an amax over no values is undefined)
        axis = AXIS[operand]
        for fmt in dict.fromkeys((own, *self.formats) if own in FORMATS else self.formats):
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
        # every call of a layer in a step adds up (a shared layer runs several): counts and sums add,
        # in float64 (the device's sums are relative to norm**2), the extremes are kept
        total: dict[tuple[int, str, str, str], list[float]] = {}
        for (step, name, operand, fmt, _, _, _), c, v in zip(pending, counts, values):
            sse, sum_sq, amax, smin, smax, norm = v
            got = [*c, sse * norm * norm, sum_sq * norm * norm, amax, smin, smax]
            slot = (step, name, operand, fmt)
            if slot in total:
                was = total[slot]
                got = [*(a + b for a, b in zip(was[:5], got[:5])), _extreme(max, was[5], got[5]),
                       _extreme(min, was[6], got[6]), _extreme(max, was[7], got[7])]
            total[slot] = got
        out: dict[int, dict[str, dict[str, Any]]] = {}
        for (step, name, operand, fmt), (numel, under, over, sse, sum_sq, amax, smin, smax) in total.items():
            layer = out.setdefault(step, {}).setdefault(
                name, {"format": self._formats_of.get((step, name)), "operands": {}})
            numel = int(numel)
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
        _LIVE.discard(self)

    def __enter__(self) -> QuantStats:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def _extreme(pick: Any, a: float, b: float) -> float:
    """``pick`` (max or min) of two figures, NaN where either is (Python's max keeps the first NaN only)."""
    return math.nan if math.isnan(a) or math.isnan(b) else pick(a, b)


#: The QuantStats with hooks on: :func:`paused` finds those watching a model.
_LIVE: weakref.WeakSet[QuantStats] = weakref.WeakSet()


@contextlib.contextmanager
def paused(model: nn.Module) -> Iterator[None]:
    """Within the block the statistics watching ``model`` or any of its layers count no step and measure
    nothing: forwards run to inspect the model are no training steps."""
    inside = {id(m) for m in model.modules()}
    held = [s for s in list(_LIVE) if id(s.model) in inside or any(id(m) in inside for m in s.layers.values())]
    for stats in held:
        stats._paused += 1
    try:
        yield
    finally:
        for stats in held:
            stats._paused -= 1


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
