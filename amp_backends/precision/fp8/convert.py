"""A precision policy's fp8 part: which selected Linear layers run in fp8 and why the others do not,
their conversion (all of them, or none on failure) and its undoing."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from ..selectors import RECIPE, Selector, select, strip, unselectable, wrapper_prefix
from . import engine as fp8
from .carry import CARRIED, carry_attributes, carry_hooks, swap_in, swap_out, swap_reason
from .eligible import state_names
from .mx import MX_RECIPES, MxConfig, shape_reason

if TYPE_CHECKING:
    from ...backend import Backend

__all__ = ["Fp8Conversion", "convert", "layer_reason"]

_FIRST = "the first Linear layer the model runs (the recipe keeps it in the autocast dtype)"
_LAST = "the last Linear layer the model runs (the recipe keeps it in the autocast dtype)"
_FLOAT32 = "float32 by this policy, itself or a module holding it (float32 beats fp8)"
_HEAD = "the head (the recipe keeps it out of fp8)"


@dataclass
class Fp8Conversion:
    """The Linear layers a policy converted to fp8, and the ones it left, with why. The model is held
    weakly (:class:`~amp_backends.precision.policy.PrecisionPolicy` frees it with its user)."""

    _model: weakref.ref = field(repr=False)
    recipe: str
    emulated: bool
    all_gather: bool = False
    _layers: dict[str, tuple[nn.Module, nn.Module]] = field(default_factory=dict, repr=False)
    _reasons: dict[str, str] = field(default_factory=dict, repr=False)
    #: id -> the parameter objects :meth:`swap_weight` made torchao's fp8 all-gather wrapper
    _swapped: dict[int, Any] = field(default_factory=dict, repr=False)
    #: layers a selector picked that stay in the autocast dtype (or float32), with why
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def model(self) -> nn.Module | None:
        """The model converted (None once it was freed)."""
        return self._model()

    @property
    def converted(self) -> dict[str, str]:
        """Qualified name -> why it runs in fp8, for the fp8 layers still in the model."""
        model = self._model()
        return {} if model is None else {name: self._reasons[name] for name, (_, layer) in self._layers.items()
                                         if fp8.places(model, layer)}

    def restore(self) -> None:
        """Put each original Linear back where its fp8 layer is, holding the parameters the fp8 layer
        holds now (the trained ones, or those a wrapper such as FSDP2 put in place); with fp8 all-gather
        the very parameter objects the layer and any optimizer hold, plain again."""
        model = self._model()
        for original, layer in self._layers.values() if model is not None else ():
            if not fp8.places(model, layer):
                continue  # replaced since: not the policy's to undo
            for name, _ in list(original.named_parameters(remove_duplicate=False)):
                owner, leaf = _owner(layer, name)
                value = owner._parameters.get(leaf) if owner is not None else None
                if value is None:
                    continue
                value = self._give_back(name, value)
                target, leaf = _owner(original, name)
                if target._parameters.get(leaf) is not value:
                    setattr(target, leaf, value)
            carry_hooks(layer, original)
            carry_attributes(layer, original, layer.__dict__.pop(CARRIED, ()))
            fp8.swap(model, layer, original)
        self._layers.clear()

    def _give_back(self, name: str, value: Any) -> Any:
        """The plain parameter for ``value``, one of the fp8 layer's."""
        if id(value) in self._swapped:
            del self._swapped[id(value)]
            plain = swap_out(value)
            if plain is not value:
                warnings.warn(
                    f"policy.remove(): the fp8 all-gather weight {name!r} could not become a plain parameter again "
                    "as the same object (something holds a weak reference to it, or a view); the layer holds a new "
                    "Parameter with the trained values, which an optimizer built before remove() does not hold: "
                    "build the optimizer again", RuntimeWarning, stacklevel=4)
            return plain
        inner = fp8.plain_weight(value)
        if inner is not value:  # another fp8 all-gather wrapper: its inner tensor is the trained weight
            return inner if isinstance(inner, nn.Parameter) else nn.Parameter(inner, value.requires_grad)
        return value

    def unswap_all(self) -> None:
        """Every parameter :meth:`swap_weight` made a wrapper, plain again (a conversion that failed)."""
        for param in list(self._swapped.values()):
            swap_out(param)
        self._swapped.clear()

    def swap_weight(self, linear: nn.Module, layer: nn.Module) -> None:
        """``layer`` (torchao's, built with fp8 all-gather) wrapped ``linear``'s weight in a new parameter:
        make ``linear``'s parameter object itself the wrapper, and ``layer`` hold it."""
        wrapper, weight = layer.weight, linear.weight
        if weight is wrapper or getattr(wrapper, "_tensor", None) is not weight:
            return
        if id(weight) not in self._swapped:  # else a weight shared with a layer converted already
            why = swap_reason(weight)
            if why is not None:
                raise ValueError(f"precision_policy(fp8_all_gather=True): a {type(linear).__name__}: {why}: the fp8 "
                                 "all-gather weight cannot take its place; apply the policy before wrapping the model "
                                 "or keeping references to its weights, or use fp8_all_gather=False (nothing changed)")
            self._swapped[id(weight)] = swap_in(weight, wrapper)
        layer.weight = weight


class Fp8Layer:
    """``fp8_linear(linear, cls=None)``, what a policy's ``fp8_convert`` functions get: the fp8 layer the
    policy installs for ``linear``'s weight and bias (the backend's own, or torchao's ``Fp8Linear``), of
    class ``cls`` where given (a subclass of :class:`amp_backends.precision.fp8.linear.Fp8Linear`, with
    a forward of its own)."""

    def __init__(self, conversion: Fp8Conversion, backend: Backend, config: Any) -> None:
        self._conversion, self._backend, self._config = conversion, backend, config

    def __call__(self, linear: nn.Module, cls: type | None = None) -> nn.Module:
        from ...backend import Backend as _Backend
        from .linear import Fp8Linear

        if not isinstance(linear, nn.Linear):
            raise TypeError(f"fp8_linear(linear) takes an nn.Linear, got {type(linear).__name__}")
        if isinstance(self._config, MxConfig):  # MXFP8: torchao's MX layer (a vendor's fp8_linear is float8's)
            base = fp8.mx_layer_class()
            if cls is not None and not (isinstance(cls, type) and issubclass(cls, base)):
                raise TypeError("fp8_linear(linear, cls=...) with an MX recipe takes a subclass of "
                                f"amp_backends.precision.fp8.mx_linear.MxLinear, got {cls!r}")
            return (cls or base).from_linear(linear, self._config)
        if cls is None:
            layer = self._backend.fp8_linear(linear, self._config)
            if layer is not None:
                _check_layer(self._backend, linear, layer)
                return layer
            cls = Fp8Linear
        elif not (isinstance(cls, type) and issubclass(cls, fp8.engine().float8_linear.Float8Linear)):
            raise TypeError(f"fp8_linear(linear, cls=...) takes a subclass of amp_backends.precision.fp8.linear.Fp8Linear, "
                            f"got {cls!r}")
        elif type(self._backend).fp8_linear is not _Backend.fp8_linear:
            raise TypeError(f"fp8_linear(linear, cls=...): backend {self._backend.name!r} installs its own fp8 layer, not "
                            "torchao's: call fp8_linear(linear) without cls")
        layer = cls.from_float(linear, config=self._config)
        if self._conversion.all_gather:
            self._conversion.swap_weight(linear, layer)
        return layer


def convert(model: nn.Module, selectors: Sequence[Selector], *, recipe: str, emulate: bool, backend: Backend,
            float32: set[int], head: str | None, example_inputs: Any, all_gather: bool = False,
            converters: Mapping[type, Callable[..., Any]] | None = None) -> Fp8Conversion:
    """Convert the Linear layers ``selectors`` pick (``RECIPE``: every Linear but the first and last
    run, the head and those below torchao's break-even), leaving those in ``float32`` (ids of modules a
    policy runs in float32) and those that cannot run in fp8, with why. ``converters``
    (``fp8_convert``): Linear class -> ``fn(layer, fp8_linear)`` returning its fp8 replacement. All or
    nothing."""
    converters = dict(converters or {})
    plan, skipped = _plan(model, selectors, recipe, float32, head, example_inputs, converters)
    conversion = Fp8Conversion(weakref.ref(model), recipe, emulate, all_gather, skipped=skipped)
    if not plan:
        return conversion
    if all_gather:
        for name, (module, _) in plan.items():
            why = swap_reason(module.weight)
            if why is not None:
                raise ValueError(f"precision_policy(fp8_all_gather=True): {strip(name, wrapper_prefix(model))!r}: {why}: the fp8 all-gather "
                                 "weight cannot take its place; apply the policy before wrapping the model or keeping "
                                 "references to its weights, or use fp8_all_gather=False (nothing changed)")
    make = Fp8Layer(conversion, backend, fp8.config(recipe, emulate, all_gather))
    try:
        for name, (module, reason) in plan.items():
            convert_one = converters.get(type(module))
            layer = make(module) if convert_one is None else convert_one(module, make)
            if convert_one is not None:
                if layer is None or layer is module:
                    conversion.skipped[name] = (f"fp8_convert's function for {type(module).__name__} left it as it is "
                                                f"(returned {'None' if layer is None else 'the layer itself'})")
                    continue
                _check_converted(module, layer)
            layer.fp8_recipe = recipe
            carry_hooks(module, layer)
            layer.__dict__[CARRIED] = carry_attributes(module, layer)
            fp8.swap(model, module, layer)
            conversion._layers[name] = (module, layer)
            conversion._reasons[name] = reason if convert_one is None else f"{reason} (converted by fp8_convert)"
    except BaseException:
        conversion.restore()
        conversion.unswap_all()
        raise
    return conversion


def layer_reason(module: nn.Module, recipe: str) -> str | None:
    """Why ``module`` cannot train in ``recipe`` (fp8 or MX) through a policy, or None."""
    return _eligibility(module, {}, recipe)


def _eligibility(module: nn.Module, converters: Mapping[type, Any], recipe: str) -> str | None:
    """Why ``module`` cannot train in ``recipe`` (the fp8 layer's rules, and MX's shapes), or None."""
    why = fp8.eligibility(module, converters)
    if why is None and recipe in MX_RECIPES:
        why = shape_reason(module, recipe)
    return why


def _owner(module: nn.Module, name: str) -> tuple[nn.Module | None, str]:
    """The submodule of ``module`` holding the parameter ``name`` ("lora.0.weight"), and its own name there."""
    *path, leaf = name.split(".")
    for part in path:
        module = module._modules.get(part)
        if module is None:
            return None, leaf
    return module, leaf


def _check_converted(module: nn.Module, layer: Any) -> None:
    """What an ``fp8_convert`` function returned holds ``module``'s own parameters and buffers under the
    same names (so ``state_dict`` keys stay and an optimizer keeps training them)."""
    label = f"precision_policy(fp8_convert=...): the function for {type(module).__name__}"
    if not isinstance(layer, nn.Module):
        raise TypeError(f"{label} returned a {type(layer).__name__}, not an nn.Module (nothing changed)")
    before, after = state_names(module), state_names(layer)
    if sorted(before) != sorted(after):
        missing, new = sorted(set(before) - set(after)), sorted(set(after) - set(before))
        raise TypeError(f"{label} returned a {type(layer).__name__} whose state_dict keys differ (missing: "
                        f"{', '.join(missing) or 'none'}; new: {', '.join(new) or 'none'}): it must hold the layer's "
                        "parameters and buffers under the same names (nothing changed)")
    for name, value in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        owner, leaf = _owner(layer, name)
        held = None if owner is None else owner._parameters.get(leaf, owner._buffers.get(leaf))
        if held is not value:
            raise TypeError(f"{label} returned a {type(layer).__name__} holding another tensor as {name!r}: it must hold "
                            "the layer's own parameters and buffers, which an optimizer trains (nothing changed)")


def _check_layer(backend: Backend, module: nn.Module, layer: Any) -> None:
    same = isinstance(layer, nn.Module) and all(getattr(layer, a, None) is getattr(module, a) for a in ("weight", "bias"))
    if not same:
        raise TypeError(f"backend {backend.name!r}: fp8_linear must return an nn.Module holding the Linear's own "
                        f"weight and bias parameters, got {type(layer).__name__} (nothing changed)")


def _plan(model: nn.Module, selectors: Sequence[Selector], recipe: str, float32: set[int], head: str | None,
          example_inputs: Any, converters: Mapping[type, Any]) -> tuple[dict[str, tuple[nn.Module, str]], dict[str, str]]:
    explicit = [s for s in selectors if s != RECIPE]
    chosen, skipped = select(model, explicit, head=None, argument="fp8") if explicit else ({}, {})
    if RECIPE in selectors:
        # named_modules() gives a shared module once, under its first name
        prefix = wrapper_prefix(model)
        parents = {id(child): m for m in model.modules() for child in m.children()}
        linears = [name for name, module in model.named_modules() if strip(name, prefix) and isinstance(module, nn.Linear)]
        callable_ = [name for name in linears if unselectable(name, model.get_submodule(name), parents) is None]
        order = fp8.linear_order(model, example_inputs, callable_)
        ends = {order[0]: _FIRST, order[-1]: _LAST} if order else {}
        for name in linears:
            if name in chosen or name in skipped:
                continue
            module = model.get_submodule(name)
            why_not = (unselectable(name, module, parents) or (_FLOAT32 if id(module) in float32 else ends.get(name))
                       or (_HEAD if head is not None and strip(name, prefix) == head else None)
                       or _eligibility(module, converters, recipe) or fp8.too_small(module, recipe))
            if why_not is not None:
                skipped[name] = why_not
            else:
                chosen[name] = (module, "recipe: a Linear layer")
    plan = {}
    for name, (module, reason) in chosen.items():
        why_not = _FLOAT32 if id(module) in float32 else _eligibility(module, converters, recipe)
        if why_not is None:
            plan[name] = (module, reason)
        else:
            skipped[name] = why_not
    return plan, skipped
