"""Which Linear layers torchao's fp8 layer can replace without losing anything, and how a user says
how to convert the others (``precision_policy(..., fp8_convert={MyLinear: fn})``).

The fp8 layer holds a Linear's ``weight`` and ``bias`` and runs ``x @ weight.T + bias``: a layer whose
weight is computed before each use (weight norm, pruning, parametrizations), whose parameters do not
exist yet (a lazy layer), or that does more than a Linear (a subclass with its own forward, or extra
parameters, buffers or submodules: LoRA adapters, an output scale, a mask) would lose that work or that
state, so it is left in the autocast dtype with the reason, unless ``fp8_convert`` names its class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

__all__ = ["check_converters", "state_names", "structure"]

#: Methods a Linear subclass may override to do more than a Linear does (run, save or load state):
#: the fp8 layer would run torchao's instead.
_OWN_METHODS = ("forward", "__call__", "_call_impl", "_save_to_state_dict", "_load_from_state_dict",
                "get_extra_state", "set_extra_state", "state_dict", "load_state_dict")

_HOW = "fp8_convert={{{cls}: fn}} says how to convert it (docs/fp8.md), or leave it out of fp8="


def check_converters(value: Any) -> dict[type, Callable[..., Any]]:
    """``fp8_convert`` checked: a mapping from Linear classes to ``fn(layer, fp8_linear)``."""
    what = ("precision_policy(fp8_convert=...) takes a dict {LinearClass: fn}, fn(layer, fp8_linear) returning the "
            "fp8 module that replaces layer")
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{what}; got {type(value).__name__}")
    for cls, fn in value.items():
        if not (isinstance(cls, type) and issubclass(cls, nn.Linear)):
            raise TypeError(f"{what}; the key {cls!r} is not an nn.Linear class")
        if not callable(fn):
            raise TypeError(f"{what}; the value for {cls.__name__} is a {type(fn).__name__}, not callable")
    return dict(value)


def structure(module: nn.Linear, converters: Mapping[type, Any] | None = None) -> str | None:
    """Why ``module`` (an ``nn.Linear``) cannot become torchao's fp8 layer as it is, or None.
    ``converters``: ``fp8_convert``; a class it names may do more than a Linear (its function says how
    to convert it), but its weight must still be a parameter."""
    from torch.nn.modules.lazy import LazyModuleMixin

    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        return (f"an uninitialised {type(module).__name__} (its parameters get their shape at the first forward): "
                "run the model once before the policy")
    why = _computed_weight(module)
    if why is not None:
        return why
    if type(module) in (converters or {}):
        return None
    return _more_than_a_linear(module)


def _computed_weight(module: nn.Module) -> str | None:
    """Why ``module``'s weight or bias is not a parameter the fp8 layer can hold, or None."""
    from torch.nn.utils import parametrize, prune
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    if parametrize.is_parametrized(module):
        names = ", ".join(module.parametrizations.keys())
        return (f"its {names} is parametrized (torch.nn.utils.parametrize: parametrizations.weight_norm, spectral_norm, "
                "orthogonal...), computed at each use, which the fp8 layer would not do: leave it out of fp8=, or "
                f"torch.nn.utils.parametrize.remove_parametrizations(layer, {next(iter(module.parametrizations))!r}) "
                "first")
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, WeightNorm):
            return (f"torch.nn.utils.weight_norm recomputes its {hook.name} from {hook.name}_g and {hook.name}_v before "
                    "each forward, which the fp8 layer would not do: leave it out of fp8=, or "
                    "torch.nn.utils.remove_weight_norm(layer) first")
        if isinstance(hook, SpectralNorm):
            return (f"torch.nn.utils.spectral_norm recomputes its {hook.name} before each forward, which the fp8 layer "
                    "would not do: leave it out of fp8=, or torch.nn.utils.remove_spectral_norm(layer) first")
        if isinstance(hook, prune.BasePruningMethod):
            name = hook._tensor_name
            return (f"pruned (torch.nn.utils.prune): its {name} is {name}_orig * {name}_mask, recomputed before each "
                    "forward, which the fp8 layer would not do: leave it out of fp8=, or make the pruning permanent "
                    f"with torch.nn.utils.prune.remove(layer, {name!r}) first")
    for name in ("weight", "bias"):
        if name not in module._parameters and getattr(module, name, None) is not None:
            return (f"its {name} is not a parameter of the layer (a {type(getattr(module, name)).__name__} set by "
                    "something else), which the fp8 layer needs: leave it out of fp8=")
    return None


def _more_than_a_linear(module: nn.Module) -> str | None:
    """What a Linear (subclass or not) holds or does beyond ``weight``, ``bias`` and Linear's forward."""
    cls = type(module)
    found = []
    own = [m for m in _OWN_METHODS if getattr(cls, m, None) is not getattr(nn.Linear, m, None)]
    if own:
        found.append(f"its own {', '.join(own)}")
    params = [n for n, p in module._parameters.items() if p is not None and n not in ("weight", "bias")]
    buffers = [n for n, b in module._buffers.items() if b is not None]
    children = [n for n, c in module._modules.items() if c is not None]
    for kind, names in (("parameters", params), ("buffers", buffers), ("submodules", children)):
        if names:
            found.append(f"{kind} {', '.join(names)}")
    if not found:
        return None
    what = f"{cls.__name__}, a Linear subclass," if cls is not nn.Linear else "this Linear"
    return (f"{what} has {'; '.join(found)}, which torchao's fp8 layer (weight and bias only) would drop: "
            + _HOW.format(cls=cls.__name__))


def state_names(module: nn.Module, prefix: str = "") -> list[str]:
    """The keys ``module.state_dict()`` has, found without calling it (which would run state-dict hooks):
    parameters, persistent buffers and extra state, every submodule's under its name."""
    names = [prefix + n for n, p in module._parameters.items() if p is not None]
    names += [prefix + n for n, b in module._buffers.items()
              if b is not None and n not in module._non_persistent_buffers_set]
    if type(module).get_extra_state is not nn.Module.get_extra_state:
        names.append(prefix + "_extra_state")
    for n, child in module._modules.items():
        if child is not None:
            names += state_names(child, f"{prefix}{n}.")
    return names
