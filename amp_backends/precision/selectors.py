"""Which modules a per-layer precision choice applies to: classes, name patterns, module instances,
predicates and the recipe, checked before anything changes, matched over every name a module has.
"""

from __future__ import annotations

import fnmatch
import inspect
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Union

import torch
from torch import nn

__all__ = ["NORM_TYPES", "RECIPE", "Selection", "Selector", "check_selectors", "recipe_head", "select", "strip", "unselectable",
           "wrapper_prefix"]

#: What selects a module: a module class, a qualified-name pattern ("head", "*.norm*", fnmatch
#: syntax, matched against ``model.named_modules()`` names), a module instance, or a predicate
#: ``(name, module) -> bool``.
Selector = Union[type, str, nn.Module, Callable[[str, nn.Module], bool]]

#: Normalisation layers, which the recipes keep in float32.
NORM_TYPES: tuple[type, ...] = tuple(
    t for t in (
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.GroupNorm, nn.LayerNorm,
        nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm, getattr(nn, "RMSNorm", None),
    ) if t is not None
)

#: The preset the recipes describe: normalisation layers and the final classifier / LM head.
RECIPE = "recipe"

#: The wrappers whose root adds a prefix to every name (DDP, DataParallel, DeepSpeed's engines keep the
#: model as ``module``; torch.compile as ``_orig_mod``), by class name: patterns match without it.
_WRAPPERS = {"DistributedDataParallel": "module", "DataParallel": "module", "DeepSpeedEngine": "module",
             "PipelineEngine": "module", "OptimizedModule": "_orig_mod"}

#: name -> (module, why it was selected)
Selection = dict[str, tuple[nn.Module, str]]


def wrapper_prefix(model: nn.Module) -> str:
    """The prefix the wrappers around ``model``'s own root add to every qualified name ("module.",
    "module._orig_mod.", or ""): a root is a wrapper when it is one of :data:`_WRAPPERS` (a subclass
    too), or holds nothing but one child named ``module`` or ``_orig_mod`` (no parameters of its own:
    ``AveragedModel``, an EMA copy, a user's wrapper), so a submodule a model names ``module`` beside
    others keeps its name."""
    prefix = ""
    while True:
        child = next((name for cls in type(model).__mro__ if (name := _WRAPPERS.get(cls.__name__))), None)
        if child is None and len(model._modules) == 1 and not model._parameters:
            child = next(iter(model._modules))
            child = child if child in _WRAPPERS.values() else None
        inner = model._modules.get(child) if child is not None else None
        if inner is None:
            return prefix
        prefix += f"{child}."
        model = inner


def strip(name: str, prefix: str) -> str:
    """``name`` without ``prefix`` (:func:`wrapper_prefix`): the name it has in the wrapped model ("" for
    the root and the wrappers around it)."""
    if name.startswith(prefix):
        return name[len(prefix):]
    return "" if prefix.startswith(name + ".") or not name else name


def check_selectors(value: Any, argument: str = "fp32") -> list[Selector]:
    """The selectors in ``value`` (one selector or a sequence), each checked: a clear error naming the
    argument and what it takes, before anything changes."""
    what = (f"precision_policy({argument}=...) takes module classes, name patterns (str), module instances, "
            "predicates (name, module) -> bool, or amp_backends.RECIPE")
    if value is None:
        raise TypeError(f"{what}; got None (pass () to select nothing)")
    if isinstance(value, (str, type, nn.Module)) or (callable(value) and not isinstance(value, (list, tuple))):
        value = [value]
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise TypeError(f"{what}; got {type(value).__name__} {value!r}")
    selectors = list(value)
    for s in selectors:
        if isinstance(s, type):
            if not issubclass(s, nn.Module):
                raise TypeError(f"precision_policy({argument}=...): {s.__name__} is not a torch.nn.Module class; {what}")
        elif isinstance(s, str):
            if s == "":
                raise ValueError(f"precision_policy({argument}=...): the pattern '' selects the whole model (the "
                                 "root): every layer would leave autocast. Select its children, or turn autocast off")
        elif isinstance(s, nn.Module):
            continue
        elif callable(s):
            _check_arity(s, argument)
        else:
            raise TypeError(f"{what}; got {type(s).__name__} {s!r}")
    return selectors


def _check_arity(predicate: Callable[..., Any], argument: str) -> None:
    try:
        sig = inspect.signature(predicate)
    except (TypeError, ValueError):
        return  # a builtin: it will say so itself
    try:
        sig.bind("name", nn.Module())
    except TypeError:
        raise TypeError(f"precision_policy({argument}=...): predicate {_label(predicate)} must take (name, module) "
                        f"and return True or False; its signature is {sig}") from None


def _label(selector: Any) -> str:
    if isinstance(selector, type):
        return selector.__name__
    if isinstance(selector, nn.Module):
        return f"the {type(selector).__name__} instance"
    if isinstance(selector, str):
        return repr(selector)
    return getattr(selector, "__name__", type(selector).__name__)


def unselectable(name: str, module: nn.Module, parents: dict[int, nn.Module]) -> str | None:
    """Why wrapping ``module``'s forward would change nothing, or None."""
    parent = parents.get(id(module))
    if isinstance(parent, nn.MultiheadAttention) and module is parent.out_proj:
        return ("nn.MultiheadAttention never calls out_proj's forward (it uses the weight directly): select the "
                "MultiheadAttention itself")
    return None


def select(model: nn.Module, selectors: Sequence[Selector], *, head: str | None, argument: str = "fp32",
           extra: Sequence[tuple[str, tuple[type, ...]]] = ()) -> tuple[Selection, dict[str, str]]:
    """The modules ``selectors`` (and ``extra``: (reason, classes)) pick, keyed by their first name,
    with the reason; and the modules picked but skipped, with why. Every name a shared module has is
    matched. Raises (nothing changed) for a selector matching nothing, an explicit selection of a
    module whose forward is never called, or a predicate that raises or returns something not a bool."""
    parents = {id(child): m for m in model.modules() for child in m.children()}
    prefix = wrapper_prefix(model)
    chosen: Selection = {}
    skipped: dict[str, str] = {}
    first_name: dict[int, str] = {}
    matched: set[int] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        key = first_name.setdefault(id(module), name)
        bare = strip(name, prefix)
        if not bare:  # the root (or the model DDP or torch.compile wraps) is never selected: its children are
            continue
        # every selector that picks the module counts as matched; the first one's reason is kept
        reasons = [(i, selector, reason) for i, selector in enumerate(selectors)
                   if (reason := _match(selector, bare, module, head, argument)) is not None]
        matched.update(i for i, _, _ in reasons)
        if reasons:
            why_not = unselectable(name, module, parents)
            if why_not is None:
                chosen.setdefault(key, (module, reasons[0][2]))
                continue
            explicit = [s for _, s, _ in reasons if isinstance(s, (str, nn.Module)) and s != RECIPE]
            if explicit:
                raise ValueError(f"precision_policy({argument}=...): {_label(explicit[0])} selects '{bare}', "
                                 f"which cannot run in another precision this way: {why_not} (nothing changed)")
            skipped[key] = why_not
        else:
            reason = next((why for why, types in extra if isinstance(module, types)), None)
            if reason is not None and key not in chosen and unselectable(name, module, parents) is None:
                chosen[key] = (module, reason)
    unmatched = [s for i, s in enumerate(selectors) if i not in matched and s != RECIPE]
    foreign = [s for s in unmatched if isinstance(s, nn.Module)]
    roots = {id(m) for n, m in model.named_modules() if not strip(n, prefix)}  # the model and its wrappers
    if any(id(s) in roots for s in foreign):
        raise ValueError(f"precision_policy({argument}=...): the model itself is never selected (every layer would "
                         "leave autocast): select its children, or turn autocast off (nothing changed)")
    if foreign:
        raise ValueError(f"precision_policy({argument}=...): {_label(foreign[0])} is not a submodule of this model "
                         "(a copy, or another model's?): pass the model's own module, e.g. model.head, or its name "
                         "(nothing changed)")
    if unmatched:
        shown = ", ".join(map(_label, unmatched))
        names = [n for n in (strip(n, prefix) for n, _ in model.named_modules()) if n][:12]
        raise ValueError(f"precision_policy({argument}=...): {shown} selects no module of this model (nothing changed). "
                         f"Module names look like: {', '.join(names) or '(no submodules)'}"
                         f"{' ...' if len(names) == 12 else ''}")
    return chosen, skipped


def _match(selector: Selector, bare: str, module: nn.Module, head: str | None, argument: str) -> str | None:
    if selector == RECIPE:
        if isinstance(module, NORM_TYPES):
            return f"recipe: {type(module).__name__}"
        if head is not None and bare == head:
            return "recipe: the final classifier / head"
        return None
    if isinstance(selector, str):
        return f"pattern {selector!r}" if fnmatch.fnmatchcase(bare, selector) else None
    if isinstance(selector, type):
        return selector.__name__ if isinstance(module, selector) else None
    if isinstance(selector, nn.Module):
        return f"the {type(selector).__name__} given" if module is selector else None
    try:
        answer = selector(bare, module)
    except Exception as exc:  # noqa: BLE001 - said with where it happened; nothing was changed
        raise ValueError(f"precision_policy({argument}=...): predicate {_label(selector)} raised on module "
                         f"'{bare}' ({type(module).__name__}): {type(exc).__name__}: {exc} (nothing changed)") from exc
    if isinstance(answer, torch.Tensor) or not isinstance(answer, (bool, numbers.Integral)) and not _is_np_bool(answer):
        raise TypeError(f"precision_policy({argument}=...): predicate {_label(selector)} must return True or False, "
                        f"got {type(answer).__name__} for module '{bare}' (nothing changed)")
    return f"predicate {_label(selector)}" if answer else None


def _is_np_bool(x: Any) -> bool:
    return type(x).__name__ == "bool_" and type(x).__module__ == "numpy"


def recipe_head(model: nn.Module, example_inputs: Any = None, device_type: str | None = None) -> tuple[str | None, str]:
    """The final classifier / LM head and how it was found. With ``example_inputs``: the module that ran
    the forward's last matmul-like op (the model run once, untouched); a module that runs it in its
    own forward among other work (a tied LM head as ``F.linear`` in the model's forward) cannot be
    selected alone: None, with the reason. Without: the last ``nn.Linear`` registered."""
    prefix = wrapper_prefix(model)
    if example_inputs is None:
        parents = {id(child): m for m in model.modules() for child in m.children()}
        last = None
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and unselectable(name, module, parents) is None:
                last = strip(name, prefix)
        return last, "the last nn.Linear registered (pass example_inputs to find the head by running the model)"
    from ..tracing.attribution import Attribution
    from ..tracing.isolation import call_args, untouched
    from ..tracing.opcount import OpRecorder

    attribution = Attribution(model)
    recorder = OpRecorder(attribution.where, watch_nonfinite=False)
    args, kwargs = call_args(example_inputs)
    device = device_type or next((t.device.type for t in model.parameters()), "cpu")
    try:
        with untouched(model, device), torch.no_grad(), attribution, recorder:
            model(*args, **kwargs)
    finally:
        attribution.remove()
    forward = [o for o in recorder.ops if not o.backward]
    if not forward:
        return None, "no matmul or convolution ran: no head"
    name = forward[-1].module
    module = model.get_submodule(name) if name else model
    if next(module.children(), None) is not None:
        return None, (f"the last matmul ran in '{name or '(model)'}''s own forward ({forward[-1].shape}), among its "
                      "other work (a tied LM head as F.linear?): a module policy cannot run it alone in float32")
    return strip(name, prefix), f"the module that ran the forward's last matmul ({forward[-1].shape})"
