"""Where backward meets a flat gradient arena (:mod:`.arena`): a pre-hook on each slotted parameter's
``AccumulateGrad`` node, and which arena holds which parameter.

- **Only a backward that accumulates gets a slot's view.** The hook is on the parameter's
  ``AccumulateGrad`` node, not on the tensor: torch runs a node's pre-hooks only when it runs the node,
  that is when it accumulates into ``.grad``. ``torch.autograd.grad(...)`` returns gradients and
  leaves ``.grad`` alone; it runs a leaf tensor's own hooks but not its node, so the arena hands out
  nothing there, and ``.grad`` stays None where torch's does (the same on torch 2.4 and 2.13; a
  ``backward(inputs=...)`` runs the nodes of the parameters it names). A parameter holds its node
  weakly and makes a new one, without the hook, once nobody holds it: the arena holds the nodes.
  ``p.data = t`` in another dtype or on another device gives a parameter a new node; the arena
  hooks the new one at its next ``zero_grad()``.
- **An arena whose optimizer is gone lets go.** The hooks hold their arena weakly, and the arena
  its optimizer weakly: an optimizer nobody holds any more is freed at once, with its state and its
  arena's buffers, and its hooks are removed from the parameters.
- **A parameter's gradient lives in one arena.** :func:`flat_grads` over parameters that the arena
  of another optimizer, still alive, holds takes them over: that arena is released (its optimizer
  steps on the per-tensor path), with a warning.

May import what :mod:`amp_backends.gradients` may; it imports nothing of the arena (the arena imports it).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..eager import untraced

__all__ = ["Hooks", "holders", "take_over"]

#: Each parameter a live arena holds -> a weak reference to that arena.
_HOLDER: Any = None


def _holders() -> Any:
    global _HOLDER
    if _HOLDER is None:
        from torch.utils.weak import WeakIdKeyDictionary

        _HOLDER = WeakIdKeyDictionary()  # keys by identity: a tensor's == is elementwise
    return _HOLDER


def holders(params: Iterable[torch.Tensor], arena: object) -> list[Any]:
    """The arenas other than ``arena`` that hold some of ``params`` and still have hooks on them."""
    found: dict[int, Any] = {}
    table = _holders()
    for p in params:
        ref = table.get(p)
        other = ref() if ref is not None else None
        if other is not None and other is not arena and other._hooks.handles:
            found[id(other)] = other
    return list(found.values())


def take_over(others: Iterable[Any]) -> None:
    """Release the arenas :func:`holders` found (their optimizers are alive), saying so."""
    for other in others:
        held_by = other.optimizer
        other.release()
        warnings.warn(
            f"flat_grads(): parameters of this optimizer were in the arena of another optimizer that is still "
            f"alive ({type(held_by).__name__} at {id(held_by):#x}); a gradient can live in one arena only, so that "
            "arena is released and that optimizer steps on the per-tensor path. If it is an optimizer you replaced, "
            "drop every reference to it (an LR scheduler holds one) before calling flat_grads(); if both stay in "
            "use, give them parameters of their own", RuntimeWarning, stacklevel=3)


def _node(param: torch.Tensor) -> Any:
    """The ``AccumulateGrad`` node backward accumulates ``param``'s gradient with."""
    return torch.autograd.graph.get_gradient_edge(param).node


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class Hooks:
    """The hooks of one arena on its parameters' ``AccumulateGrad`` nodes (and the nodes, held)."""

    __slots__ = ("_finalizer", "arena", "handles", "nodes")

    def __init__(self, arena: Any, optimizer: torch.optim.Optimizer, slots: Sequence[Any]) -> None:
        self.arena = weakref.ref(arena)
        self.nodes: dict[tuple[int, int], Any] = {}
        self.handles: list[Any] = []
        for k, s in enumerate(slots):
            for i, p in enumerate(s.group.params):
                self._hook(k, i, _node(p))
        # the optimizer going (nobody holds it) takes the hooks with it, even where the arena is still held
        self._finalizer = weakref.finalize(optimizer, _remove, self.handles)
        self._finalizer.atexit = False
        table = _holders()
        for s in slots:
            for p in s.group.params:
                table[p] = self.arena

    def _hook(self, k: int, i: int, node: Any) -> None:
        self.nodes[k, i] = node
        self.handles.append(node.register_prehook(_arrival(self.arena, k, i)))

    def refresh(self, slots: Sequence[Any], suspects: Iterable[tuple[int, int]]) -> None:
        """Hook again each of ``suspects`` (buffer, slot) whose parameter's node is not the one hooked:
        ``p.data`` swapped for a tensor of another dtype or device (and back) makes a new node."""
        for k, i in suspects if self.handles else ():
            p = slots[k].group.params[i]
            if p.requires_grad and _node(p) is not self.nodes[k, i]:
                self._hook(k, i, _node(p))

    def remove(self, slots: Sequence[Any]) -> None:
        """Remove every hook, let go of the nodes, and of the parameters this arena held."""
        self._finalizer.detach()
        _remove(self.handles)
        self.nodes = {}
        table = _holders()
        for s in slots:
            for p in s.group.params:
                if table.get(p) is self.arena:
                    del table[p]


def _arrival(arena_ref: Any, k: int, i: int) -> Any:
    """The pre-hook of slot ``i`` of buffer ``k``'s parameter's ``AccumulateGrad`` node."""

    def arrive(grads: tuple[torch.Tensor | None, ...]) -> None:
        """Before torch accumulates into ``.grad``: a parameter without a gradient gets its slot's zero
        view, so torch accumulates into the buffer in place. (Never traced by dynamo, and calls only
        builtins and untraced functions: it runs inside backward, itself never compiled.)"""
        arena = arena_ref()
        if arena is None:  # the arena is gone: torch accumulates as it would without one
            return
        slots = arena._slots[k]
        param = slots.group.params[i]
        grad = grads[0]
        if grad is None or not param.requires_grad:  # torch accumulates nothing
            return
        current = param.grad
        if current is not None:
            if current.data_ptr() != slots.ptrs[i] and current.numel():  # a tensor put there by hand, or by DDP: noted
                arena._outside = True
            return
        if grad.is_sparse or torch.is_grad_enabled():  # sparse, or create_graph: torch makes its own
            arena._outside = True
            return
        if slots.group.dirty:  # a free slot's view must be zero before torch accumulates into it
            slots.clean()
        view = slots.spare[i]
        if view is None:  # the view this slot gave was dropped (model.zero_grad(), p.grad = None)
            view = slots.reclaim(i)
            if view is None:  # some view is still alive: leave it be, torch makes a new tensor
                arena._outside = True
                return
        try:
            param.grad = view
        except RuntimeError:  # the parameter no longer fits its slot (model.half(), .to()): torch's own
            arena._outside = True
            return
        slots.spare[i] = None
        slots.free.discard(i)
        slots.watch[i] = weakref.ref(view, slots.on_drop)  # its end (dropped from .grad) is noted

    return untraced(arrive)
