"""What each module's forward put out during one of :func:`~amp_backends.check_model`'s runs: its
floating outputs per call, the values over float16's range it produced, and where its outputs hold
inf/NaN.

A value is counted where it was produced: a module that returns a child's output as it is (a
``Sequential`` returning its last layer's output, or a view of it) adds only what it changed in place
(a residual ``out += x`` on its child's output). In the low-precision run, an output element that is
inf/NaN in the float32 reference too is not float16's overflow (an inf held in a buffer, a NaN in a
weight) and is not counted either.
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from ..torch_private import tree_leaves
from .report import FP16_MAX

__all__ = ["Outputs", "over", "rel"]


class Outputs:
    """Hooks on every module of ``model`` recording each one's floating outputs per call (the tensors
    where ``keep``, else empty stand-ins), the dtype of its first floating input, the values over
    65504 it produced (:data:`over`), and where ``marks`` (the float32 reference), per (module, call,
    output), where an output holds inf/NaN; ``reference``: the float32 run's record, whose inf/NaN
    elements are not counted here."""

    def __init__(self, model: nn.Module, keep: bool, reference: Outputs | None = None, marks: bool = False) -> None:
        self.names = {id(m): n for n, m in model.named_modules()}
        self.outputs: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.inputs: dict[str, str] = {}
        self.over: dict[str, int] = defaultdict(int)
        #: (module, call, output index) -> where that output holds inf/NaN (only those that hold some)
        self.nonfinite: dict[tuple[str, int, int], torch.Tensor] = {}
        #: the first module (in the order outputs were made) whose output held inf/NaN
        self.first_nonfinite: str | None = None
        self.keep, self.marks = keep, marks
        self._reference = reference
        self._calls: dict[str, int] = defaultdict(int)
        # storage address -> (an output counted there, the count, the call that made it): a tensor passed
        # on is not counted again; held weakly, so a freed output's address, reused, is not mistaken for it
        self._counted: dict[int, tuple[weakref.ref[torch.Tensor], int, tuple[str, int]]] = {}
        self._handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(self._pre),
                                                               m.register_forward_hook(self._post))]

    def _pre(self, module: nn.Module, args: Any) -> None:
        first = next((t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
        name = self.names.get(id(module), "?")
        if first is not None and name not in self.inputs:
            self.inputs[name] = str(first.dtype).replace("torch.", "")

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(id(module), "?")
        floats = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not floats:
            return
        call = self._calls[name]
        self._calls[name] += 1
        self.outputs[name].append(floats[0].detach() if self.keep else floats[0].new_empty(0))
        for i, t in enumerate(floats):
            if t.numel() == 0:
                continue
            if self.marks:
                bad = ~torch.isfinite(t.detach())
                if bool(bad.any()):
                    self.nonfinite[(name, call, i)] = bad
                    if self.first_nonfinite is None:  # the root's name is "": test for None
                        self.first_nonfinite = name
            excused = None if self._reference is None else self._reference.nonfinite.get((name, call, i))
            self.over[name] += self._produced(t, over(t, excused if excused is not None and
                                                      excused.shape == t.shape else None), (name, call))

    def _produced(self, t: torch.Tensor, count: int, owner: tuple[str, int]) -> int:
        """Of ``count`` values over 65504 in ``t``, output of the call ``owner``, those that call made: all
        of them for a new tensor (or another view of one the same call made: its chunks), for a tensor
        an earlier call made (a child's output passed on) only those added since."""
        try:
            address = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):  # a tensor subclass without plain storage
            return count
        held = self._counted.get(address)
        alive = held is not None and held[0]() is not None
        if held is None or not alive or held[2] == owner:
            before = held[1] if held is not None and alive else 0
            self._counted[address] = (held[0] if held is not None and alive else weakref.ref(t), before + count, owner)
            return count
        self._counted[address] = (held[0], max(held[1], count), owner)
        return max(0, count - held[1])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def over(t: torch.Tensor | None, excused: torch.Tensor | None = None) -> int:
    """Elements of ``t`` beyond float16's 65504 (inf included, NaN not), leaving out those ``excused``."""
    if t is None or not t.is_floating_point() or t.numel() == 0:
        return 0
    beyond = t.detach().abs().float() > FP16_MAX
    return int((beyond & ~excused).sum() if excused is not None else beyond.sum())


def rel(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """``||a - b|| / ||b||`` in float64; None where the shapes differ."""
    if a.shape != b.shape:
        return None
    a, b = a.double(), b.double()
    denom = float(b.norm())
    diff = float((a - b).norm())
    return diff / denom if denom else (0.0 if diff == 0 else math.inf)
