"""Per-module precision: chosen modules run in float32 inside any backend's autocast.

    handle = amp_backends.precision_policy(model, fp32=[torch.nn.BatchNorm2d, "head", "*.norm*"])
    with be.autocast():
        loss = loss_fn(model(x), y)     # BatchNorm2d layers, "head" and the norms run in float32
    handle.remove()                     # the model is exactly as before

Inside autocast a selected module runs with autocast off for the device types that are active,
its floating inputs (and its own float16/bfloat16 weights) cast to float32; outside autocast nothing
changes. Only compute precision changes: weights stay in the model's dtype, and ``state_dict`` keys
are untouched (the module's ``forward`` is wrapped on the instance, not the module replaced). What
the recipes ask for is the preset :data:`RECIPE`: normalisation layers and the final classifier / LM
head in float32. Policies compose: several may select the same module, and any order of
:meth:`PrecisionPolicy.remove` leaves exactly the remaining ones' selection.

``fp8=`` selects Linear layers to train in fp8 (torchao's float8 training, :mod:`amp_backends.precision.fp8.engine`,
or MXFP8 with ``fp8_recipe="mxfp8"``: :mod:`amp_backends.precision.fp8.mx`); per module, float32 beats fp8,
which beats the autocast dtype. ``plan=`` applies a :class:`~amp_backends.precision.plan.PrecisionPlan`: each
layer it names in float32, the autocast dtype, or an fp8 or MX recipe.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import patches
from .fp32_forward import FP32_CAUSE, FP32_SCOPE, Fp32Forward
from .fp8.convert import Fp8Conversion, convert
from .plan import PrecisionPlan
from .selectors import NORM_TYPES, RECIPE, Selector, check_selectors, recipe_head, select

if TYPE_CHECKING:
    from ..backend import Backend

__all__ = ["NORM_TYPES", "OP_MODULES", "RECIPE", "PrecisionPolicy", "Selector", "fp32_modules", "precision_policy"]

#: The modules that run an op a backend may declare float32-only (``Backend.fp32_ops``).
OP_MODULES: dict[str, tuple[type, ...]] = {
    "binary_cross_entropy": (nn.BCELoss,),
    "batch_norm": (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm),
    "layer_norm": (nn.LayerNorm,),
    "group_norm": (nn.GroupNorm,),
    "instance_norm": (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d),
    "softmax": (nn.Softmax,),
    "log_softmax": (nn.LogSoftmax,),
    "cross_entropy": (nn.CrossEntropyLoss,),
    "nll_loss": (nn.NLLLoss,),
    "mse_loss": (nn.MSELoss,),
    "embedding": (nn.Embedding,),
}


@dataclass
class PrecisionPolicy:
    """The modules a :func:`precision_policy` runs in float32; :meth:`remove` undoes it.

    It holds the model and its modules weakly: a policed model nobody else holds is freed even while
    its policy lives, and with it what the policy set for it (:func:`.fp32_forward.hold_eager_backward`)."""

    _model: weakref.ref = field(repr=False)
    #: name -> (the module, its float32 wrapper), each held weakly
    _held: dict[str, tuple[weakref.ref, weakref.ref]] = field(default_factory=dict, repr=False)
    _reasons: dict[str, str] = field(default_factory=dict, repr=False)
    #: modules a selector picked that a policy cannot run in float32 this way, with why
    skipped: dict[str, str] = field(default_factory=dict)
    #: how the recipe found the head ("" without the recipe)
    head_found_by: str = ""
    #: the conversions to fp8 or MX, one per recipe (a plan may name several)
    _fp8: list[Fp8Conversion] = field(default_factory=list, repr=False)
    #: the plan applied (``plan=``), None without one
    plan: PrecisionPlan | None = field(default=None, repr=False)
    _removed: bool = field(default=False, repr=False)

    @property
    def model(self) -> nn.Module | None:
        """The model the policy was made for (None once nobody else holds it and it was freed)."""
        return self._model()

    @property
    def fp8(self) -> dict[str, str]:
        """Qualified name -> why it trains in fp8 (or MXFP8), for the Linear layers converted and still in place."""
        return {name: why for conversion in self._fp8 for name, why in conversion.converted.items()}

    @property
    def fp8_skipped(self) -> dict[str, str]:
        """Layers ``fp8=`` picked that stay in float32 or the autocast dtype, with why."""
        return {name: why for conversion in self._fp8 for name, why in conversion.skipped.items()}

    @property
    def fp8_recipe(self) -> str | None:
        """The fp8 recipe ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "mxfp8_with_gw_hp"), None
        without ``fp8=``; a plan naming several: them joined by "+" (per layer: :attr:`fp8_recipes`)."""
        return "+".join(c.recipe for c in self._fp8) if self._fp8 else None

    @property
    def fp8_recipes(self) -> dict[str, str]:
        """Qualified name -> the recipe it trains in, for the converted layers still in place."""
        return {name: conversion.recipe for conversion in self._fp8 for name in conversion.converted}

    @property
    def selected(self) -> dict[str, str]:
        """Qualified name -> why it runs in float32 ("BatchNorm2d", "pattern 'head'", "recipe: ..."),
        for the modules still at those names (a module replaced since is no longer run by the policy)."""
        return {name: why for name, why in self._reasons.items() if self._in_place(name)}

    @property
    def replaced(self) -> list[str]:
        """Names whose module was replaced after the policy: the new module is not in float32."""
        return [name for name in self._reasons if not self._in_place(name)]

    def _in_place(self, name: str) -> bool:
        module_ref, _ = self._held.get(name, (None, None))
        module, model = module_ref() if module_ref is not None else None, self._model()
        try:
            return module is not None and model is not None and model.get_submodule(name) is module
        except AttributeError:
            return False

    def remove(self) -> None:
        """Undo this policy: each module it selected runs as it would without it. A module another
        policy still selects stays in float32; one that nothing selects any more gets its ``forward``
        back exactly as it was (or, where something wrapped it since, a wrapper that passes through).
        Each fp8 layer is replaced by its original Linear, holding the trained parameters."""
        for conversion in reversed(self._fp8):
            conversion.restore()
        for module_ref, wrapper_ref in self._held.values():
            module, wrapper = module_ref(), wrapper_ref()
            if module is None or wrapper is None:
                continue  # freed: its hold ended with it
            wrapper.release(id(self))
            if not wrapper.holders:
                patches.unwrap(module, "forward", wrapper)
        self._held.clear()
        self._removed = True

    @property
    def active(self) -> bool:
        return any(module() is not None for module, _ in self._held.values()) or bool(self.fp8)

    def __enter__(self) -> PrecisionPolicy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        names = ", ".join(self.selected) or "none"
        low = f"; fp8 ({self.fp8_recipe}): {', '.join(self.fp8) or 'none'}" if self._fp8 else ""
        return f"<PrecisionPolicy fp32: {names}{low}{' (removed)' if self._removed else ''}>"


def _autocast_here(device_type: Any) -> bool:
    try:
        return isinstance(device_type, str) and torch.amp.is_autocast_available(device_type)
    except RuntimeError:  # not a device string torch can parse
        return False


def _device_types(device_types: Any) -> tuple[str, ...]:
    if isinstance(device_types, str):
        device_types = (device_types,)
    try:
        types = tuple(device_types)
    except TypeError:
        raise TypeError(f"precision_policy(device_types=...) takes a device type or a list of them, "
                        f"got {type(device_types).__name__}") from None
    for t in types:
        if not _autocast_here(t):
            known = [d for d in ("cpu", "cuda", "xpu", "mps", "hpu", "mlu", "npu", "musa")
                     if _autocast_here(d)]
            raise ValueError(f"precision_policy(device_types=...): {t!r} is not a device type with autocast here; "
                             f"use device types such as {', '.join(map(repr, known))}")
    return types


def _backend_ops(backend: Any) -> list[tuple[str, tuple[type, ...]]]:
    from ..registry.registry import resolve_backend

    be = resolve_backend(backend)
    note = be.fp32_note()
    if note:
        warnings.warn(f"precision_policy: the modules it selects run with autocast off, but {note}",
                      RuntimeWarning, stacklevel=3)
    ops = be.fp32_ops
    declared = (ops,) if isinstance(ops, str) else tuple(ops or ())
    extra = []
    for op in declared:
        if op not in OP_MODULES:
            raise ValueError(f"backend {be.name!r} declares fp32 op {op!r}, which no module is known to run; "
                             f"known: {', '.join(sorted(OP_MODULES))}")
        extra.append((f"backend {be.name!r}: {op} in float32", OP_MODULES[op]))
    for op in sorted(be.autocast_lists.banned & OP_MODULES.keys() - set(declared)):
        extra.append((f"backend {be.name!r}: its autocast refuses {op}; run in float32", OP_MODULES[op]))
    return extra


def _say_what_autocast_would_do(chosen: dict[str, tuple[nn.Module, str]], backend: Any) -> None:
    """The recipe's normalisation layers, with what the backend's autocast would run them in (its lists)."""
    from ..registry.registry import resolve_backend

    be = resolve_backend(backend)
    words = {"fp32": "float32 already", "lower": "the low dtype", "promote": "the widest input dtype"}
    for key, (module, reason) in chosen.items():
        if reason.startswith("recipe: ") and isinstance(module, NORM_TYPES):
            would = words.get(be.autocast_lists.module_policy(module) or "", "its input's dtype")
            chosen[key] = (module, f"{reason} (under {be.name}'s autocast it would run in {would})")


def precision_policy(
    model: nn.Module,
    fp32: Selector | Sequence[Selector] = (RECIPE,),
    *,
    fp8: Selector | Sequence[Selector] | None = None,
    fp8_recipe: str = "tensorwise",
    emulate: bool = False,
    fp8_all_gather: bool = False,
    fp8_convert: Mapping[type, Callable[..., Any]] | None = None,
    backend: Any = None,
    device_types: str | Sequence[str] = (),
    example_inputs: Any = None,
    plan: PrecisionPlan | str | os.PathLike[str] | None = None,
) -> PrecisionPolicy:
    """Run the modules ``fp32`` selects in float32 inside autocast, and train the Linear layers ``fp8``
    selects in fp8; returns a handle to remove both.

    ``fp32``: module classes, qualified-name patterns (fnmatch; wrapper prefixes such as DDP's
    ``module.`` and torch.compile's ``_orig_mod.`` are ignored), module instances, predicates
    ``(name, module) -> bool``, or :data:`RECIPE` (the default: normalisation layers and the head,
    found by running the model on ``example_inputs`` where given, else the last ``nn.Linear``
    registered). ``backend`` (a name or Backend): its declared ``fp32_ops`` select the modules running
    them too. Autocast is switched off for the device types of a module's inputs that have it enabled,
    and for ``device_types`` (for modules without tensor inputs).

    ``fp8``: the same kinds of selectors, for Linear layers (:data:`RECIPE`: every Linear but the
    first and last the model runs, the head, and those below torchao's break-even), trained with
    ``fp8_recipe`` (:data:`amp_backends.precision.fp8.engine.RECIPES`) on the backend's device, which must have fp8
    matmuls (``emulate=True``: fp8's numerics with high-precision matmuls, for tests). A layer that
    cannot run in fp8, or that ``fp32`` selects, is left with the reason (``fp8_skipped``).
    ``fp8_all_gather=True`` (tensorwise only; convert before ``fully_shard``): FSDP2 all-gathers those
    layers' weights in fp8, half the bytes of bf16. A Linear subclass with a forward, parameters, buffers
    or submodules of its own is left (``fp8_skipped`` says why) unless ``fp8_convert`` maps its class to
    ``fn(layer, fp8_linear)``, which returns the module replacing it, holding the same parameters and
    buffers under the same names (``fp8_linear(linear, cls=None)`` builds the policy's fp8 layer for a
    Linear's weight and bias; docs/fp8.md).

    ``plan``: a :class:`~amp_backends.precision.plan.PrecisionPlan` (or the path of one saved as JSON):
    its float32 layers join ``fp32``'s selection and its 8-bit layers train in their recipes (``emulate``
    as for ``fp8=``); not with ``fp8=``. Every layer the plan puts in 8 bits must convert, or nothing
    changes.

    Anything that cannot work is refused before anything changes: a selector matching nothing, a
    predicate that raises, fp8 on a device without it or without torchao."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"precision_policy takes a torch.nn.Module, got {type(model).__name__}")
    selectors = check_selectors(fp32)
    types = _device_types(device_types)
    plan, plan_fp32, plan_fp8 = _plan_args(model, plan, fp8, fp8_recipe, fp8_all_gather)
    selectors = selectors + plan_fp32
    fp8_selectors, fp8_backend = (_fp8_args(fp8, fp8_recipe, emulate, backend, fp8_all_gather) if plan is None
                                  else (None, None))
    if plan_fp8:
        fp8_backend = _plan_backend(plan_fp8, emulate, backend)
    converters = _fp8_converters(fp8, fp8_convert)
    extra = _backend_ops(backend) if backend is not None else []
    head, how = (None, "")
    if RECIPE in selectors or RECIPE in (fp8_selectors or ()):
        if example_inputs is None and plan is not None and plan.head is not None:
            head, how = plan.head, "the head the plan found by running the model"
        else:
            head, how = recipe_head(model, example_inputs)
        if head is None and example_inputs is not None:
            warnings.warn(f"precision_policy: the recipe's head is not selected: {how}", RuntimeWarning, stacklevel=2)
    chosen, skipped = select(model, selectors, head=head if RECIPE in selectors else None, extra=extra)
    if backend is not None:
        _say_what_autocast_would_do(chosen, backend)
    _refuse_fp8_layers(chosen)
    policy = PrecisionPolicy(weakref.ref(model), skipped=skipped, head_found_by=how, plan=plan)
    if fp8_selectors is not None and fp8_backend is not None:
        policy._fp8 = [convert(model, fp8_selectors, recipe=fp8_recipe, emulate=bool(emulate),
                              backend=fp8_backend, float32=_float32_ids(chosen),
                              head=head, example_inputs=example_inputs, all_gather=bool(fp8_all_gather),
                              converters=converters)]
    if plan_fp8:
        policy._fp8 = _convert_planned(model, plan_fp8, emulate=bool(emulate), backend=fp8_backend,
                                       float32=_float32_ids(chosen), converters=converters)
    for name, (module, reason) in chosen.items():
        wrapper = module.__dict__.get("forward")
        if not isinstance(wrapper, Fp32Forward):  # else another policy's (or a copied model's): held by this one too
            wrapper = Fp32Forward(module, module.__dict__.get("forward"))
            patches.wrap(module, "forward", wrapper, cause=FP32_CAUSE, scope=FP32_SCOPE)
        elif patches.find(module, "forward", wrapper) is None:
            patches.track(module, "forward", wrapper, cause=FP32_CAUSE, scope=FP32_SCOPE)
        wrapper.hold(id(policy), types)
        policy._held[name] = (weakref.ref(module), weakref.ref(wrapper))
        policy._reasons[name] = reason
    return policy


def _fp8_args(fp8: Any, recipe: Any, emulate: Any, backend: Any,
              all_gather: Any) -> tuple[list[Selector], Backend] | tuple[None, None]:
    """``fp8``'s selectors and the backend they train on, checked with the recipe, the device and the
    engine (torchao); (None, None) without fp8."""
    from .fp8 import engine
    from ..scaler.validation import flag

    emulate = flag("emulate", emulate)
    all_gather = flag("fp8_all_gather", all_gather)
    if fp8 is None:
        if emulate or all_gather or recipe != "tensorwise":
            raise ValueError("precision_policy: fp8_recipe, emulate and fp8_all_gather apply to the layers fp8= "
                             "selects; pass fp8=[...] (e.g. fp8=[torch.nn.Linear] or fp8=amp_backends.RECIPE)")
        return None, None
    selectors = check_selectors(fp8, "fp8")
    engine.check_recipe(recipe)
    engine.check_all_gather(recipe, all_gather)
    from ..registry.registry import resolve_backend

    be = resolve_backend(backend)
    engine.check_device(be, recipe, emulate)
    engine.engine()
    if recipe in engine.MX_RECIPES:
        engine.mx_layer_class()
    return selectors, be


def _plan_args(model: nn.Module, plan: Any, fp8: Any, recipe: Any,
               all_gather: Any) -> tuple[PrecisionPlan | None, list[Selector], dict[str, list[nn.Module]]]:
    """The plan (loaded where a path), checked against ``model``; its float32 layers as selectors and
    its 8-bit layers by recipe."""
    if plan is None:
        return None, [], {}
    if isinstance(plan, (str, os.PathLike)):
        plan = PrecisionPlan.load(plan)
    if not isinstance(plan, PrecisionPlan):
        raise TypeError(f"precision_policy(plan=...) takes a PrecisionPlan or the path of one saved as JSON, got "
                        f"{type(plan).__name__}")
    if fp8 is not None or recipe != "tensorwise" or all_gather:
        raise ValueError("precision_policy: plan= names each layer's format itself; pass either plan= or fp8= (with "
                         "fp8_recipe, fp8_all_gather), not both (nothing changed)")
    layers = plan.check(model)
    fp32_layers: list[Selector] = [layers[n] for n, lp in plan.layers.items() if lp.format == "fp32"]
    return plan, fp32_layers, {recipe: [layers[n] for n in names] for recipe, names in plan.recipes().items()}


def _plan_backend(by_recipe: dict[str, list[nn.Module]], emulate: Any, backend: Any) -> Backend:
    """The backend a plan's 8-bit layers train on, checked for each recipe (device, torchao)."""
    from ..registry.registry import resolve_backend
    from ..scaler.validation import flag
    from .fp8 import engine

    emulate = flag("emulate", emulate)
    be = resolve_backend(backend)
    for recipe in by_recipe:
        engine.check_device(be, recipe, emulate)
    engine.engine()
    if any(r in engine.MX_RECIPES for r in by_recipe):
        engine.mx_layer_class()
    return be


def _convert_planned(model: nn.Module, by_recipe: dict[str, list[nn.Module]], *, emulate: bool, backend: Backend,
                     float32: set[int], converters: Mapping[type, Callable[..., Any]]) -> list[Fp8Conversion]:
    """Convert each recipe's planned layers; all of them, or nothing changes."""
    done: list[Fp8Conversion] = []
    try:
        for recipe, modules in by_recipe.items():
            conversion = convert(model, modules, recipe=recipe, emulate=emulate, backend=backend, float32=float32,
                                 head=None, example_inputs=None, converters=converters)
            done.append(conversion)
            if conversion.skipped:
                raise ValueError("precision_policy(plan=...): " + "; ".join(
                    f"{name!r} cannot train in {recipe}: {why}" for name, why in conversion.skipped.items())
                    + ": edit the plan (that layer's format) or the fp32 selection, or pass example_inputs= so that the "
                    "recipe finds the head by running the model (nothing changed)")
    except BaseException:
        for conversion in reversed(done):
            conversion.restore()
        raise
    return done


def _fp8_converters(fp8: Any, fp8_convert: Any) -> dict[type, Callable[..., Any]]:
    from .fp8.eligible import check_converters

    if fp8 is None and fp8_convert is not None:
        raise ValueError("precision_policy: fp8_convert applies to the layers fp8= selects; pass fp8=[...] (e.g. "
                         "fp8=[torch.nn.Linear])")
    return check_converters(fp8_convert)


def _float32_ids(chosen: dict[str, tuple[nn.Module, str]]) -> set[int]:
    """The modules the float32 selection runs in float32: the selected ones and everything inside them."""
    return {id(inner) for module, _ in chosen.values() for inner in module.modules()}


def _refuse_fp8_layers(chosen: dict[str, tuple[nn.Module, str]]) -> None:
    from .fp8.engine import is_fp8

    layers = [f"{name}.{inner}".rstrip(".") for name, (module, _) in chosen.items()
              for inner, m in module.named_modules() if is_fp8(m)]
    if layers:
        raise ValueError(f"precision_policy(fp32=...): {', '.join(map(repr, layers))} trains in fp8 by another "
                         "policy; float32 beats fp8, so remove() that policy first, or leave the layer (or the module "
                         "holding it) out (nothing changed)")


def fp32_modules(model: nn.Module) -> list[str]:
    """The qualified names of the modules a policy runs in float32 (as installed now)."""
    return [name for name, m in model.named_modules()
            if isinstance(m.__dict__.get("forward"), Fp32Forward) and m.__dict__["forward"].holders]

