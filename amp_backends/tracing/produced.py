"""Which inf/NaN an op produced: the rule the inf/NaN watch (:class:`~.opcount.OpRecorder`) counts by.

An output value is *produced* inf/NaN when the op made it:

- an inf (or -inf) where every input value it depends on is finite: a finite computation exceeding the
  dtype's range (a float16 matmul past 65504, a float32 value cast to float16, ``exp`` of a large
  number) or arithmetic such as ``log(0)``, ``1/0``;
- a NaN where no input value it depends on is NaN: arithmetic (``0/0``, ``inf - inf``, ``0 * inf``, a
  softmax over a row that is all -inf).

Infinities the program puts there on purpose are not produced: a scalar argument is an input like a
tensor, so ``masked_fill(mask, -inf)``, ``fill_(-inf)``, ``full(..., -inf)`` and ``where(mask, x, -inf)``
write an inf their inputs hold; an op that carries an inf on (``scores + mask``, a cast, ``triu``, a
copy) inherits it; and a -inf that a following softmax turns into 0 leaves nothing behind. A NaN made
from such an inf is produced all the same (it is arithmetic).

The input values an output value depends on: for pointwise ops (torch's ``pointwise`` tag, their
in-place forms, and casts and copies) the inputs' elements at the same position, after broadcasting;
for every other op (matmuls, reductions, softmax, convolutions) every element of every input, so
such an op whose inputs hold an inf is judged by the NaN it makes alone.

Memory that is only allocated (``empty``, ``empty_like``, ``empty_strided``, ``new_empty``,
``resize_``...) holds whatever was there before: allocating it is not counted, and what it holds
excuses nothing. It counts when an op computes with it (reads it before something wrote all of it):
that op is charged with the inf/NaN it yields. Ops that overwrite their first argument without reading
it (``copy_``, ``fill_``, ``zero_``, ``bernoulli_``, ``uniform_``, ``normal_``...) do not compute with
it: dropout's mask (``empty_like`` then ``bernoulli_``) counts nothing. In-place ops and ``out=``
arguments: the argument written is an output, and for an in-place op its value before the op is an
input. Views (``view``, ``transpose``, ``expand``, ``detach``...) compute nothing and are not counted.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..torch_private import DisableTorchDispatch, is_traceable_wrapper_subclass, tree_leaves

__all__ = ["ALLOCATING", "OVERWRITING", "ProducedWatch"]

#: Ops that allocate memory without computing its values.
ALLOCATING = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
                        "resize_", "resize_as_", "_empty_affine_quantized", "_empty_per_channel_affine_quantized"})
#: In-place ops that overwrite their first argument without reading its values.
OVERWRITING = frozenset({"copy_", "fill_", "zero_", "bernoulli_", "uniform_", "normal_", "random_", "exponential_",
                         "geometric_", "cauchy_", "log_normal_", "set_"})
#: Ops without torch's ``pointwise`` tag whose output values each come from the same position of the inputs.
_ELEMENTWISE = frozenset({"_to_copy", "copy_", "copy", "_copy_from", "_copy_from_and_resize", "lift_fresh_copy",
                          "nan_to_num", "nan_to_num_"})
_aten = torch.ops.aten


@dataclass(frozen=True)
class _Kind:
    """What the watch needs to know of an op, from its schema and tags (cached per overload)."""

    name: str
    skip: bool          # a view: computes nothing
    allocating: bool
    pointwise: bool
    overwrites_first: bool
    written: tuple[str, ...]   # arguments it writes (in place, or out=)
    outs: tuple[str, ...]      # out= arguments: written, never read
    names: tuple[str, ...]     # every argument, in order


def _kind(func: Any) -> _Kind:
    schema = func._schema
    name = func.overloadpacket.__name__
    args = schema.arguments
    pointwise = torch.Tag.pointwise in func.tags or name in _ELEMENTWISE
    if not pointwise and name.endswith("_") and not name.startswith("_"):
        # add_ is tagged inplace only; its functional form says pointwise
        try:
            overload = getattr(getattr(_aten, name[:-1]), func._overloadname)
        except (AttributeError, RuntimeError):
            overload = None
        pointwise = overload is not None and torch.Tag.pointwise in overload.tags
    written = tuple(a.name for a in args if a.alias_info is not None and a.alias_info.is_write)
    return _Kind(name=name, skip=bool(func.is_view), allocating=name in ALLOCATING, pointwise=pointwise,
                 overwrites_first=name in OVERWRITING, written=written,
                 outs=tuple(a.name for a in args if a.is_out), names=tuple(a.name for a in args))


def plain_float(t: Any) -> bool:
    """A floating tensor holding its own values: not a wrapper subclass (torchao's fp8 tensors, DTensor),
    whose values its own dispatch gives (the ops it runs on its inner tensors are seen instead)."""
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0
            and not is_traceable_wrapper_subclass(t))


def _values(t: torch.Tensor) -> torch.Tensor:
    t = t._values() if t.is_sparse else t
    t = t.detach()
    return t.float() if t.element_size() == 1 else t  # float8: isfinite has no kernel for it


@dataclass
class _Input:
    """One input's non-finite values: per element (pointwise ops) or as two flags (any inf/NaN, any NaN)."""

    bad: torch.Tensor
    nan: torch.Tensor
    per_element: bool

    @classmethod
    def of(cls, t: torch.Tensor, per_element: bool) -> _Input:
        v = _values(t)
        per_element = per_element and t.layout == torch.strided
        bad, nan = ~torch.isfinite(v), torch.isnan(v)
        return cls(bad, nan, True) if per_element else cls(bad.any(), nan.any(), False)


@dataclass
class Pending:
    """What the watch saw of an op before it ran."""

    kind: _Kind
    read: list[torch.Tensor] = field(default_factory=list)
    before: dict[int, _Input] = field(default_factory=dict)   # inputs the op writes: their values before
    written: list[torch.Tensor] = field(default_factory=list)
    storages: set[int] = field(default_factory=set)           # of every strided tensor argument
    inf_scalar: bool = False
    nan_scalar: bool = False


class ProducedWatch:
    """Counts, per op and on the device (no host read), the inf/NaN values it produced (module docstring).
    Keeps the storages that were allocated and not yet written in full (weakly)."""

    def __init__(self) -> None:
        self._kinds: dict[Any, _Kind] = {}
        self._unwritten: dict[int, weakref.ref] = {}

    def before(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Pending | None:
        kind = self._kinds.get(func)
        if kind is None:
            try:
                kind = _kind(func)
            except (AttributeError, RuntimeError):  # not an aten overload with a schema: nothing to judge by
                kind = _Kind("", True, False, False, False, (), (), ())
            self._kinds[func] = kind
        if kind.skip:
            return None
        pending = Pending(kind)
        if kind.allocating:
            return pending
        named = dict(zip(kind.names, args))
        named.update(kwargs)
        unread = {id(t) for n in kind.outs for t in tree_leaves(named.get(n))}
        if kind.overwrites_first and kind.names:
            unread |= {id(t) for t in tree_leaves(named.get(kind.names[0]))}
        pending.written = [t for n in kind.written for t in tree_leaves(named.get(n)) if isinstance(t, torch.Tensor)]
        written = {id(t) for t in pending.written}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, float) and not math.isfinite(leaf):
                pending.inf_scalar = True
                pending.nan_scalar |= math.isnan(leaf)
            elif plain_float(leaf):
                if leaf.layout == torch.strided:
                    pending.storages.add(id(leaf.untyped_storage()))
                if id(leaf) not in unread and not self._is_unwritten(leaf):
                    pending.read.append(leaf)
        with DisableTorchDispatch():  # the watch's own ops are not the model's
            for t in pending.read:
                if id(t) in written:  # an in-place op's input: its value before the op
                    pending.before[id(t)] = _Input.of(t, kind.pointwise)
        return pending

    def after(self, pending: Pending, out: Any) -> tuple[torch.Tensor, str, tuple[int, ...]] | None:
        """(count of produced inf/NaN, dtype and shape of the first output) or None (nothing to count)."""
        kind = pending.kind
        outputs = list({id(t): t for t in [*tree_leaves(out), *pending.written] if plain_float(t)}.values())
        if kind.allocating:
            for t in outputs:
                self._unwritten[id(t.untyped_storage())] = weakref.ref(t.untyped_storage())
            return None
        written = {id(t) for t in pending.written}
        # an output sharing an argument's storage that the op does not write is an alias: nothing computed
        outputs = [t for t in outputs if id(t) in written or t.layout != torch.strided
                   or id(t.untyped_storage()) not in pending.storages]
        for t in pending.written:
            if self._unwritten and _whole(t):
                self._unwritten.pop(id(t.untyped_storage()), None)
        if not outputs:
            return None
        with DisableTorchDispatch():
            inputs = [pending.before.get(id(t)) or _Input.of(t, kind.pointwise) for t in pending.read]
            count = sum(_produced(o, inputs, pending.inf_scalar, pending.nan_scalar).to(outputs[0].device)
                        for o in outputs)
        first = outputs[0]
        return count, str(first.dtype).replace("torch.", ""), tuple(first.shape)

    def _is_unwritten(self, t: torch.Tensor) -> bool:
        if not self._unwritten or t.layout != torch.strided:
            return False
        storage = t.untyped_storage()
        ref = self._unwritten.get(id(storage))
        if ref is None:
            return False
        if ref() is not storage:  # that storage is gone; the id is another's now
            del self._unwritten[id(storage)]
            return False
        return True


def _whole(t: torch.Tensor) -> bool:
    """Whether ``t`` covers all of its storage (a write to it leaves nothing of what was there)."""
    if t.layout != torch.strided:
        return False
    return t.storage_offset() == 0 and t.numel() * t.element_size() == t.untyped_storage().nbytes()


def _produced(o: torch.Tensor, inputs: list[_Input], inf_scalar: bool, nan_scalar: bool) -> torch.Tensor:
    """Output elements of ``o`` that are NaN where no input value it depends on is NaN, or inf where every
    input value it depends on is finite."""
    v = _values(o)
    nan, inf = torch.isnan(v), torch.isinf(v)
    in_bad = torch.full((), inf_scalar, dtype=torch.bool, device=v.device)  # a fill: no copy from the host
    in_nan = torch.full((), nan_scalar, dtype=torch.bool, device=v.device)
    per_element = o.layout == torch.strided
    for i in inputs:
        if i.per_element and per_element and _broadcasts(i.bad.shape, v.shape):
            in_bad = in_bad | i.bad.to(v.device).broadcast_to(v.shape)
            in_nan = in_nan | i.nan.to(v.device).broadcast_to(v.shape)
        else:
            in_bad = in_bad | i.bad.any().to(v.device)
            in_nan = in_nan | i.nan.any().to(v.device)
    return torch.count_nonzero(nan & ~in_nan) + torch.count_nonzero(inf & ~in_bad)


def _broadcasts(shape: torch.Size, target: torch.Size) -> bool:
    if shape == target:
        return True
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False
