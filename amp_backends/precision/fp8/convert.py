"""A precision policy's fp8 part: which selected Linear layers run in fp8 and why the others do not,
their conversion (all of them, or none on failure) and its undoing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from . import engine as fp8
from ..selectors import RECIPE, Selector, select, strip

if TYPE_CHECKING:
    from ...backend import Backend

__all__ = ["Fp8Conversion", "convert"]

_FIRST = "the first Linear layer the model runs (the recipe keeps it in the autocast dtype)"
_LAST = "the last Linear layer the model runs (the recipe keeps it in the autocast dtype)"
_FLOAT32 = "float32 by this policy (float32 beats fp8)"
_HEAD = "the head (the recipe keeps it out of fp8)"


@dataclass
class Fp8Conversion:
    """The Linear layers a policy converted to fp8, and the ones it left, with why."""

    model: nn.Module
    recipe: str
    emulated: bool
    all_gather: bool = False
    _layers: dict[str, tuple[nn.Module, nn.Module]] = field(default_factory=dict, repr=False)
    _reasons: dict[str, str] = field(default_factory=dict, repr=False)
    #: layers a selector picked that stay in the autocast dtype (or float32), with why
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def converted(self) -> dict[str, str]:
        """Qualified name -> why it runs in fp8, for the fp8 layers still in the model."""
        return {name: self._reasons[name] for name, (_, layer) in self._layers.items()
                if fp8.places(self.model, layer)}

    def restore(self) -> None:
        """Put each original Linear back where its fp8 layer is, holding the parameters the fp8 layer
        holds now (the trained ones, or those a wrapper such as FSDP2 put in place)."""
        for original, layer in self._layers.values():
            if not fp8.places(self.model, layer):
                continue  # replaced since: not the policy's to undo
            for attr in ("weight", "bias"):
                value = getattr(layer, attr)
                inner = fp8.plain_weight(value)
                if inner is not value:  # fp8 all-gather's wrapper: its inner tensor is the trained weight
                    if inner is getattr(original, attr):
                        continue
                    value = inner if isinstance(inner, nn.Parameter) else nn.Parameter(inner, value.requires_grad)
                setattr(original, attr, value)
            fp8.share_hooks(layer, original)
            fp8.swap(self.model, layer, original)
        self._layers.clear()


def convert(model: nn.Module, selectors: Sequence[Selector], *, recipe: str, emulate: bool, backend: Backend,
            float32: set[int], head: str | None, example_inputs: Any, all_gather: bool = False) -> Fp8Conversion:
    """Convert the Linear layers ``selectors`` pick (``RECIPE``: every Linear but the first and last
    run, the head and those below torchao's break-even), leaving those in ``float32`` (ids of modules a
    policy runs in float32) and those that cannot run in fp8, with why. All or nothing."""
    plan, skipped = _plan(model, selectors, recipe, float32, head, example_inputs)
    conversion = Fp8Conversion(model, recipe, emulate, all_gather, skipped=skipped)
    if not plan:
        return conversion
    config = fp8.config(recipe, emulate, all_gather)
    try:
        for name, (module, reason) in plan.items():
            layer = backend.fp8_linear(module, config)
            if layer is None:  # torchao's layer, on any device's autocast
                from .linear import Fp8Linear

                layer = Fp8Linear.from_float(module, config=config)
            else:
                _check_layer(backend, module, layer)
            layer.fp8_recipe = recipe
            fp8.share_hooks(module, layer)
            fp8.swap(model, module, layer)
            conversion._layers[name] = (module, layer)
            conversion._reasons[name] = reason
    except BaseException:
        conversion.restore()
        raise
    return conversion


def _check_layer(backend: Backend, module: nn.Module, layer: Any) -> None:
    same = isinstance(layer, nn.Module) and all(getattr(layer, a, None) is getattr(module, a) for a in ("weight", "bias"))
    if not same:
        raise TypeError(f"backend {backend.name!r}: fp8_linear must return an nn.Module holding the Linear's own "
                        f"weight and bias parameters, got {type(layer).__name__} (nothing changed)")


def _plan(model: nn.Module, selectors: Sequence[Selector], recipe: str, float32: set[int], head: str | None,
          example_inputs: Any) -> tuple[dict[str, tuple[nn.Module, str]], dict[str, str]]:
    explicit = [s for s in selectors if s != RECIPE]
    chosen, skipped = select(model, explicit, head=None, argument="fp8") if explicit else ({}, {})
    if RECIPE in selectors:
        # named_modules() gives a shared module once, under its first name
        linears = [name for name, module in model.named_modules() if strip(name) and isinstance(module, nn.Linear)]
        order = fp8.linear_order(model, example_inputs, linears)
        ends = {order[0]: _FIRST, order[-1]: _LAST} if order else {}
        for name in linears:
            if name in chosen or name in skipped:
                continue
            module = model.get_submodule(name)
            why_not = (_FLOAT32 if id(module) in float32 else ends.get(name)
                       or (_HEAD if head is not None and strip(name) == head else None)
                       or fp8.eligibility(module) or fp8.too_small(module, recipe))
            if why_not is not None:
                skipped[name] = why_not
            else:
                chosen[name] = (module, "recipe: a Linear layer")
    plan = {}
    for name, (module, reason) in chosen.items():
        why_not = _FLOAT32 if id(module) in float32 else fp8.eligibility(module)
        if why_not is None:
            plan[name] = (module, reason)
        else:
            skipped[name] = why_not
    return plan, skipped
