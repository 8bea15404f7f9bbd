"""The float32 masters and ``load_state_dict``: a load of float32 (or wider) values gives the masters
those exact values instead of their rounding (:func:`exact_values`); a low-precision value loaded is no
more exact than the parameter, and is taken as any write is (element by element: one the load leaves as
the parameter holds keeps its master, so that ``model.load_state_dict(model.state_dict())`` changes no
master). The hooks hold the masters' owner weakly: a model kept for inference keeps no optimizer alive,
and a pickled or deep-copied model carries hooks that report to no one (its parameters are new).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .master_buffers import LOW_PRECISION

__all__ = ["exact_values", "hook_loads"]

class _LoadWatch:
    """The ``load_state_dict`` pre-hook of a module with parameters that have masters; reports to its
    owner's ``_on_load``, held weakly."""

    def __init__(self, owner: Any) -> None:
        self.owner = None if owner is None else weakref.ref(owner)

    def __call__(self, module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *args: Any) -> None:
        owner = None if self.owner is None else self.owner()
        if owner is not None:
            owner._on_load(module, state_dict, prefix)

    def __reduce__(self) -> tuple[Any, tuple[None]]:
        return type(self), (None,)


def hook_loads(model: nn.Module, owner: Any, masters: Mapping[nn.Parameter, torch.Tensor]) -> list[Any]:
    """Hook the ``load_state_dict`` of each module of ``model`` holding a parameter in ``masters``,
    reporting to ``owner``; the hooks' handles."""
    owned = {id(p) for p in masters}
    handles: list[Any] = []
    for module in model.modules():
        if any(id(p) in owned for p in module._parameters.values() if p is not None):
            handles.append(module._register_load_state_dict_pre_hook(_LoadWatch(owner), with_module=True))
    return handles


def exact_values(module: nn.Module, state_dict: Mapping[str, Any], prefix: str,
                 masters: Mapping[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
    """The values ``state_dict`` gives ``module``'s parameters with a master that are exact: floating
    point and wider than low precision, of the parameter's shape."""
    found = {}
    for name, p in module._parameters.items():
        value = state_dict.get(prefix + name)
        if (p is not None and p in masters and isinstance(value, torch.Tensor) and value.shape == p.shape
                and value.is_floating_point() and value.dtype not in LOW_PRECISION):
            found[p] = value
    return found
