"""The ledger per module: what each layer holds for backward after the forward, in which dtype, and
what memory-lean mixed precision would hold there instead (measured on a copy of the model, not
estimated).

One forward under the device's autocast, counted by the :class:`~.ledger.Ledger` with each storage
attributed to the module that saved it (:meth:`~.ledger.Ledger.modules`): activations by dtype, and
autocast's copies of the parameters apart. The lean figure runs the same forward on a deep copy of the
model after :func:`~.lean.memory_lean` with weights in the autocast dtype (float32 masters) and
low-precision saves; the LM-head lever is not applied (it needs to be told the head).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..backend import Backend
from .ledger import Ledger

__all__ = ["ModuleMemory", "saved_by_module"]


@dataclass(frozen=True)
class ModuleMemory:
    """What one module holds for backward once the forward is done (its own saves, not its children's)."""

    #: activations autograd saved, by dtype name ("bfloat16": bytes)
    saved: dict[str, int] = field(default_factory=dict)
    #: autocast's low-precision copies of parameters this module saved
    weight_copies: int = 0
    #: the same figure (activations and copies) under memory_lean, None where it was not measured
    lean: int | None = None

    @property
    def total(self) -> int:
        return sum(self.saved.values()) + self.weight_copies

    @property
    def lean_saving(self) -> int | None:
        """Bytes memory_lean would free here (negative: it would hold more), None where not measured."""
        return None if self.lean is None else self.total - self.lean


def _forward_saves(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], device_type: str,
                   dtype: torch.dtype) -> dict[str, dict[str, int]]:
    ledger = Ledger()
    ledger.register([*model.buffers(), args, list(kwargs.values())], params=model.parameters())
    with torch.enable_grad(), ledger, ledger.modules(model), ledger.phase("forward"):
        with torch.autocast(device_type, dtype=dtype):
            output = model(*args, **kwargs)
        saved = ledger.saved_by_module()
    del output
    return saved


def saved_by_module(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], backend: Backend,
                    dtype: torch.dtype, *, lean: bool = True) -> tuple[dict[str, ModuleMemory], str | None]:
    """Per module name, what it holds for backward after one forward under ``backend``'s autocast in
    ``dtype`` (and under memory_lean where ``lean``); and why the lean figure is missing, or None. The
    caller restores the model's buffers and the RNG (the forward runs twice where ``lean``)."""
    from .lean import memory_lean

    plain = _forward_saves(model, args, kwargs, backend.device_type, dtype)
    leaner: dict[str, dict[str, int]] | None = None
    why = None
    if lean:
        try:
            twin = copy.deepcopy(model)
        except Exception as exc:  # noqa: BLE001 - a model deepcopy refuses: report the plain figures alone
            why = f"the model could not be copied to measure memory_lean ({type(exc).__name__}: {exc})"
        else:
            try:
                memory_lean(twin, torch.optim.SGD(twin.parameters(), lr=0.0), backend=backend, weights=dtype)
            except Exception as exc:  # noqa: BLE001 - the reason goes into the report
                why = f"memory_lean does not apply here: {exc}"
            else:
                try:
                    leaner = _forward_saves(twin, args, kwargs, backend.device_type, dtype)
                except Exception as exc:  # noqa: BLE001 - e.g. a low-precision weight an op outside autocast meets
                    why = (f"memory_lean's low-precision weights break this model's forward ({type(exc).__name__}: "
                           f"{exc}): use memory_lean without weights= here")
            del twin
    names = set(plain) | set(leaner or {})
    out = {}
    for name in names:
        mine = dict(plain.get(name, {}))
        copies = mine.pop("weight_copies", 0)
        lean_bytes = None if leaner is None else sum(leaner.get(name, {}).values())
        out[name] = ModuleMemory(mine, copies, lean_bytes)
    return out, why
