"""Memory-lean mixed precision, turned on in one place:

    lean = amp_backends.memory_lean(model, optimizer, weights=torch.bfloat16, lm_head="head")
    optimizer = lean.optimizer           # the training loop is otherwise unchanged

Each lever is on its own switch and usable alone:

- ``saves`` (default on): norms and softmax that autocast runs in float32 keep a low-precision input
  for backward (exact; :mod:`.saves`);
- ``lm_head``: the LM head's logits are never made whole; cross-entropy over them runs a block of rows
  at a time (:mod:`.chunked_loss`);
- ``weights``: the model's parameters in bfloat16/float16 (normalisation layers, layers a precision
  policy keeps in float32, and fp8 layers stay float32), with float32 masters the optimizer updates
  (:mod:`.master`); or, with ``master=False``, no masters, for an optimizer that rounds its bfloat16
  updates stochastically (torchao's, ``bf16_stochastic_round=True``), whose moments follow the
  parameters' dtype.

:meth:`Lean.state_dict` gives the model's weights in float32 (a plain float32 model loads it), and
:meth:`Lean.remove` turns everything off, the model's parameters float32 again with the trained values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import AmpBackendsError
from ..precision.fp8.engine import is_fp8
from ..precision.policy import fp32_modules
from ..precision.selectors import NORM_TYPES
from ..registry.registry import resolve_backend
from .chunked_loss import lazy_head, undo_lazy_head
from .master import MasterWeights
from .saves import LowPrecisionSaves, low_precision_saves

__all__ = ["Lean", "LeanError", "memory_lean"]


class LeanError(AmpBackendsError, ValueError):
    """A lean-memory setting that cannot work here (nothing was changed)."""


class Lean:
    """What :func:`memory_lean` turned on; :meth:`remove` turns it off."""

    def __init__(self, model: nn.Module, optimizer: Any, masters: dict[nn.Parameter, torch.Tensor],
                 saves: LowPrecisionSaves | None, head: nn.Linear | None, weights: torch.dtype | None) -> None:
        self.model, self.optimizer, self._masters = model, optimizer, masters
        self._saves, self._head, self.weights = saves, head, weights

    def state_dict(self) -> dict[str, Any]:
        """The model's ``state_dict`` with each low-precision weight's float32 master (same keys): what a
        plain float32 model of the same architecture loads."""
        masters = {id(p): m for p, m in self._masters.items()}
        state = self.model.state_dict()
        for name, p in self.model.named_parameters(remove_duplicate=False):
            master = masters.get(id(p))
            if master is not None and name in state:
                state[name] = master.detach().clone()
        return state

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Load float32 (or any) weights: the masters take them exactly, the model's parameters rounded."""
        result = self.model.load_state_dict(state_dict, strict=strict)
        with torch.no_grad():
            for name, p in self.model.named_parameters(remove_duplicate=False):
                master = self._masters.get(p)
                if master is not None and name in state_dict:
                    master.copy_(state_dict[name])
                    p.copy_(master)
        return result

    def remove(self) -> Any:
        """Turn it all off: float32 parameters again holding the trained (master) values, the head and
        norms as they were. Returns the optimizer to train on afterwards (the one given)."""
        if self._saves is not None:
            self._saves.remove()
        if self._head is not None:
            undo_lazy_head(self._head)
        optimizer = self.optimizer
        if isinstance(optimizer, MasterWeights):
            inner = optimizer.optimizer
            for p, m in self._masters.items():
                if p in inner.state:
                    continue
                moved = inner.state.pop(m, None)
                p.data = m
                if moved is not None:
                    inner.state[p] = moved
            optimizer = inner
        self._masters, self._saves, self._head = {}, None, None
        self.optimizer = optimizer
        return optimizer

    def __repr__(self) -> str:
        parts = [f"weights {str(self.weights).replace('torch.', '')} with float32 masters" if self._masters else "",
                 "lm head chunked" if self._head is not None else "",
                 f"low-precision saves on {len(self._saves.modules)} modules" if self._saves else ""]
        return f"<Lean {'; '.join(p for p in parts if p) or 'off'}>"


def _kept_float32(model: nn.Module) -> set[int]:
    """Parameters that stay float32: normalisation layers', those of modules a precision policy runs in
    float32, and fp8 layers' (their weights are quantized from float32)."""
    keep: set[int] = set()
    policy = set(fp32_modules(model))
    for name, m in model.named_modules():
        if isinstance(m, NORM_TYPES) or name in policy or is_fp8(m):
            keep.update(id(p) for p in m.parameters())
    return keep


def _check(model: Any, optimizer: Any, weights: Any, master: bool, lm_head: Any, backend: Any) -> tuple[Any, Any]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"memory_lean takes a torch.nn.Module, got {type(model).__name__}")
    be = resolve_backend(backend)
    if weights is not None:
        weights = be.resolve_dtype(weights)
        if optimizer is None:
            raise LeanError("memory_lean(weights=...): pass the optimizer too (built over model.parameters()): its "
                            "updates go to the float32 masters")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"memory_lean(optimizer=...) takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, MasterWeights):
        raise LeanError("memory_lean: this optimizer already updates float32 masters (memory_lean ran on it)")
    params = {id(p) for p in model.parameters()}
    if optimizer is not None:
        foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in params]
        if foreign:
            raise LeanError(f"memory_lean: the optimizer holds {len(foreign)} parameter(s) that are not the model's; "
                            "build it over model.parameters()")
    if weights is not None and any(hasattr(p, "device_mesh") for p in model.parameters()):
        raise LeanError("memory_lean(weights=...) with FSDP2 (DTensor parameters): fully_shard casts the parameters "
                        "itself; use its MixedPrecisionPolicy(param_dtype=...) instead of lean weights")
    if weights is not None and not master:
        stochastic = getattr(optimizer, "bf16_stochastic_round", optimizer.defaults.get("bf16_stochastic_round"))
        if not stochastic or weights != torch.bfloat16:
            raise LeanError(
                "memory_lean(master=False): bfloat16 weights without float32 masters lose the small updates (a "
                "round-to-nearest AdamW stalls), so the optimizer must round stochastically: pass e.g. "
                "torchao.optim.AdamW8bit(model.parameters(), bf16_stochastic_round=True), or master=True")
    head = None
    if lm_head is not None:
        head = lm_head if isinstance(lm_head, nn.Module) else _submodule(model, lm_head)
        if not isinstance(head, nn.Linear):
            raise LeanError(f"memory_lean(lm_head=...): the head must be an nn.Linear, got {type(head).__name__}")
        if not any(m is head for m in model.modules()):
            raise LeanError("memory_lean(lm_head=...): that module is not in this model; pass its name, e.g. 'lm_head'")
    return weights, head


def _submodule(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][-6:]
        raise LeanError(f"memory_lean(lm_head={name!r}): no such module; Linear layers here end with "
                        f"{', '.join(names) or '(none)'}") from None


def memory_lean(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, backend: Any = None,
                weights: torch.dtype | str | None = None, master: bool = True, lm_head: str | nn.Module | None = None,
                saves: bool = True) -> Lean:
    """Turn on the memory levers of mixed precision for ``model`` (see the module docstring); returns
    the handle whose ``optimizer`` the training loop uses. Everything is checked before anything changes."""
    weights, head = _check(model, optimizer, weights, master, lm_head, backend)
    masters: dict[nn.Parameter, torch.Tensor] = {}
    if weights is not None:
        keep = _kept_float32(model)
        with torch.no_grad():
            for p in dict.fromkeys(model.parameters()):
                if id(p) in keep or not p.is_floating_point() or p.dtype == weights:
                    continue
                held = p.data
                p.data = held.to(weights)
                if master:
                    masters[p] = held
        if master:
            assert optimizer is not None
            for p, m in masters.items():
                if p in optimizer.state:
                    optimizer.state[m] = optimizer.state.pop(p)
            optimizer = MasterWeights(optimizer, masters)
    low = low_precision_saves(model) if saves else None
    if head is not None:
        lazy_head(head)
    return Lean(model, optimizer, masters, low, head, weights)
