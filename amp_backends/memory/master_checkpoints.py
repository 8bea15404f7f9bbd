"""The float32 masters and the model's own ``state_dict``: what a checkpoint of the model holds.

A checkpoint is the model's ``state_dict`` (``torch.save(model.state_dict())``, Transformers'
``save_pretrained``, a trainer's, a snapshot to roll back to), so with masters on, the model's
``state_dict`` gives each weight that has one as its master, float32 (:func:`give_masters`): the
rounding the parameter holds would be all a resumed run had. ``load_state_dict`` of float32 (or wider)
values gives the masters those exact values instead of their rounding (:func:`exact_values`); a
low-precision value loaded is no more exact than the parameter, and is taken as any write is. The
hooks hold the masters' owner weakly: a model kept for inference keeps no optimizer alive, and a
pickled or deep-copied model carries hooks that report to no one (its parameters are new).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["Copies", "exact_values", "give_masters", "watch_state_dicts"]

_LOW = (torch.float16, torch.bfloat16)


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


class _SaveWatch(_LoadWatch):
    """The ``state_dict`` post-hook of such a module; reports to its owner's ``_on_save``."""

    def __call__(self, module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *args: Any) -> None:
        owner = None if self.owner is None else self.owner()
        if owner is not None:
            owner._on_save(module, state_dict, prefix)


def watch_state_dicts(model: nn.Module, owner: Any, masters: Mapping[nn.Parameter, torch.Tensor]) -> list[Any]:
    """Hook the ``state_dict`` and ``load_state_dict`` of each module of ``model`` holding a parameter
    in ``masters``, reporting to ``owner``; the hooks' handles."""
    owned = {id(p) for p in masters}
    handles: list[Any] = []
    for module in model.modules():
        if any(id(p) in owned for p in module._parameters.values() if p is not None):
            handles.append(module._register_load_state_dict_pre_hook(_LoadWatch(owner), with_module=True))
            # (torch 2.4 has only the private registration, of the same hook)
            register = getattr(module, "register_state_dict_post_hook", None) or module._register_state_dict_hook
            handles.append(register(_SaveWatch(owner)))
    return handles


def exact_values(module: nn.Module, state_dict: Mapping[str, Any], prefix: str,
                 masters: Mapping[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
    """The values ``state_dict`` gives ``module``'s parameters with a master that are exact: floating
    point and wider than low precision, of the parameter's shape."""
    found = {}
    for name, p in module._parameters.items():
        value = state_dict.get(prefix + name)
        if (p is not None and p in masters and isinstance(value, torch.Tensor) and value.shape == p.shape
                and value.is_floating_point() and value.dtype not in _LOW):
            found[p] = value
    return found


class Copies:
    """Copies of masters handed out, one a master while neither it nor the copy is written: tied weights
    (one parameter under two names) are then one tensor in a ``state_dict``, as safetensors needs."""

    def __init__(self) -> None:
        self._made: dict[int, tuple[Any, Any, int, int]] = {}

    def of(self, master: torch.Tensor) -> torch.Tensor:
        """A copy of ``master`` (not a view of the buffer the masters share: a save would write it all)."""
        known = self._made.get(id(master))
        if known is not None:
            of, copy, master_version, copy_version = known
            made = copy()
            if of() is master and made is not None and master._version == master_version and made._version == copy_version:
                return made
        made = master.detach().clone()
        self._made[id(master)] = (weakref.ref(master), weakref.ref(made), master._version, made._version)
        return made


def give_masters(module: nn.Module, state_dict: Mapping[str, Any], prefix: str,
                 masters: Mapping[nn.Parameter, torch.Tensor], copies: Copies) -> None:
    """Each of ``module``'s parameters with a master, in ``state_dict``, replaced by a copy of the master
    (not where ``keep_vars`` gave the parameter itself)."""
    for name, p in module._parameters.items():
        key = prefix + name
        master = None if p is None else masters.get(p)
        if master is not None and key in state_dict and state_dict[key] is not p:
            state_dict[key] = copies.of(master)  # type: ignore[index]  # (a dict: torch's own)
