"""The memory ledger of a training step: every tensor storage, from when it is made to when it is
freed, and what it is (a parameter, a gradient, optimizer state, a master weight, autocast's copy of a
weight, an activation saved for backward, or something else live at the time).

How it counts: a ``TorchDispatchMode`` sees every op's outputs; each new storage gets a record (bytes,
dtype, the op that made it) and a ``weakref.finalize`` on the storage, which fires when its memory is
released (storages keep their Python object alive as long as their memory lives, so views, autograd's
saved tensors and ``.data`` all keep it). A ``saved_tensors_hooks`` pair marks what autograd saves for
backward (and :func:`kept_for_backward` what a selective checkpoint keeps instead, inside its blocks,
where its own hooks take autograd's over). Storages that exist before the step (parameters, buffers, inputs, optimizer state) are
registered first. The peak is the largest sum of live storages; what was live at that moment is rebuilt
from the records. Nothing here computes with the tensors: under ``FakeTensorMode`` a full-size model's
step is counted on any machine (:mod:`.fake`). Memory the dispatcher never sees (a library's scratch
space, an allocator's rounding) is not counted: on a device with an allocator, its peak is measured
beside the ledger.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..torch_private import TorchDispatchMode, tree_leaves

__all__ = ["PARTS", "Ledger", "MemoryReport", "counting", "kept_for_backward"]

#: The parts of training memory, as the bench and ``check_model`` report them.
PARTS = ("parameters", "gradients", "optimizer", "master", "weight_copies", "activations", "other")


class _Record:
    __slots__ = ("nbytes", "dtype", "op", "born", "died", "from_param", "saved", "made_in", "saved_in")

    def __init__(self, nbytes: int, dtype: torch.dtype, op: str, born: int, made_in: str) -> None:
        self.nbytes, self.dtype, self.op, self.born = nbytes, dtype, op, born
        self.died: int | None = None
        self.from_param = False
        self.saved = False
        #: the innermost module running when the storage was made, and when autograd first saved it
        #: ("" outside any module :meth:`Ledger.modules` watches)
        self.made_in, self.saved_in = made_in, ""


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of one training step: the peak, and what was live then by part (:data:`PARTS`)."""

    #: The largest sum of live storages during the step measured.
    peak: int
    #: Bytes live at the peak, by part (every part present; they add up to ``peak``).
    parts: dict[str, int]
    #: Activations saved for backward live at the peak, by dtype name ("bfloat16": bytes).
    activations_by_dtype: dict[str, int] = field(default_factory=dict)
    #: Where the step was at its peak ("forward", "backward", "optimizer").
    phase: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {**{k: self.parts[k] for k in PARTS}, "peak": self.peak,
                "activations_by_dtype": dict(self.activations_by_dtype), "phase": self.phase}


#: The ledgers counting now (entered, not yet left), outermost first.
_COUNTING: list[Ledger] = []


def counting() -> bool:
    """Whether a ledger is counting now (code that tells it things asks first: nothing to do otherwise)."""
    return bool(_COUNTING)


def kept_for_backward(op: Any) -> None:
    """Tell the counting ledgers that the outputs of a call of ``op`` are kept for backward by something
    other than autograd's saved-tensor hooks (a selective checkpoint's cache of outputs, which takes those
    hooks over inside its blocks): they are counted as activations, not as "other". Said just after the
    call (the outputs of the op that ran last, where it is ``op`` and not told of yet) or just before it
    (the next op's, where it is ``op``): torch's checkpoint asks its policy before running the op up to
    torch 2.12, after it from 2.13 (whose policy context carries the op's output)."""
    for ledger in _COUNTING:
        ledger._kept(op)


class Ledger(TorchDispatchMode):
    """Counts storages through whatever runs inside it (see the module docstring).

        ledger = Ledger()
        ledger.register(params=model.parameters(), state=[x, y])
        with ledger, ledger.phase("forward"):
            loss = loss_fn(model(x), y)
        with ledger, ledger.phase("backward"):
            loss.backward()
        ...
        report = ledger.report(params=..., grads=..., optimizer=..., master=...)
    """

    def __init__(self) -> None:
        super().__init__()
        self._records: list[_Record] = []
        self._by_storage: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._clock = 0
        self.live = 0
        self.peak = 0
        self._peak_at = 0
        self._phase = "setup"
        self._phase_at: list[tuple[int, str]] = []
        self._params: set[int] = set()
        self._stack: list[str] = []
        self._kept_next: Any = None
        #: the op that ran last, its outputs' records, and whether they were told of as kept
        self._last: tuple[Any, list[_Record], bool] = (None, [], False)

    def __enter__(self) -> Ledger:
        _COUNTING.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self in _COUNTING:
            _COUNTING.remove(self)
        self._kept_next, self._last = None, (None, [], False)
        super().__exit__(*exc)

    def _kept(self, op: Any) -> None:
        last, records, told = self._last
        if last is op and not told:
            for record in records:
                self._mark_saved(record)
            self._last = (last, records, True)
        else:
            self._kept_next = op

    # -- counting --------------------------------------------------------------------------
    def _record(self, tensor: torch.Tensor, op: str) -> _Record:
        storage = tensor.untyped_storage()
        record = self._by_storage.get(storage)
        if record is None:
            self._clock += 1
            record = _Record(storage.nbytes(), tensor.dtype, op, self._clock, self._stack[-1] if self._stack else "")
            self._records.append(record)
            self._by_storage[storage] = record
            weakref.finalize(storage, self._freed, record)
            self.live += record.nbytes
            if self.live > self.peak:
                self.peak, self._peak_at = self.live, self._clock
        return record

    def _freed(self, record: _Record) -> None:
        self._clock += 1
        record.died = self._clock
        self.live -= record.nbytes

    def register(self, tensors: Iterable[Any] = (), *, params: Iterable[torch.Tensor] = ()) -> None:
        """Count storages that exist before the step: ``params`` (the model's parameters: autocast's
        copies of them are told apart), and any other tensors (buffers, inputs, optimizer state)."""
        for p in params:
            self._params.add(id(self._record(p, "parameter")))
        for t in tree_leaves(list(tensors)):
            if isinstance(t, torch.Tensor):
                self._record(t, "existing")

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kept, self._kept_next = self._kept_next is func, None
        out = func(*args, **(kwargs or {}))
        clock = self._clock
        copy_of_param = (func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor)
                         and id(self._by_storage.get(args[0].untyped_storage())) in self._params)
        records = []
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                record = self._record(t, func.__name__)
                if copy_of_param and record.born > clock:
                    record.from_param = True
                if kept:
                    self._mark_saved(record)
                records.append(record)
        self._last = (func, records, kept)
        return out

    def _mark_saved(self, record: _Record) -> None:
        if not record.saved:
            record.saved_in = self._stack[-1] if self._stack else ""
        record.saved = True

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Name what runs inside (shown as where the peak fell), and mark what autograd saves for backward.
        Saved tensors are handed back as they are (the levers find them by identity), so a graph built inside
        and never run backward (nor freed by a backward without ``retain_graph``) stays alive: an op's saved
        output then holds its own grad_fn, a cycle through C++ no collection frees. Run the backward."""
        self._phase_at.append((self._clock, name))

        def pack(t: torch.Tensor) -> torch.Tensor:
            record = self._by_storage.get(t.untyped_storage())
            if record is not None:
                self._mark_saved(record)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    @contextlib.contextmanager
    def modules(self, model: nn.Module) -> Iterator[None]:
        """Attribute what runs inside to ``model``'s modules by qualified name ("" is the model itself):
        each storage to the innermost one running when it is made and when autograd saves it."""
        def enter(name: str) -> Any:
            return lambda *_: self._stack.append(name)

        def leave(*_: Any) -> None:
            self._stack.pop()

        handles = []
        try:
            for name, module in model.named_modules():
                handles.append(module.register_forward_pre_hook(enter(name)))
                handles.append(module.register_forward_hook(leave, always_call=True))
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._stack.clear()

    def saved_by_module(self) -> dict[str, dict[str, int]]:
        """What is alive now of what autograd saved, by the module that saved it: ``{name: {dtype name:
        bytes}}``; autocast's copies of parameters under ``"weight_copies"`` instead of their dtype. Each
        storage is counted once, for the first module that saved it; parameters (registered with
        :meth:`register`) are not counted: they live whether saved or not."""
        found: dict[str, Counter[str]] = {}
        for record in self._records:
            if record.died is not None or not (record.saved or record.from_param) or id(record) in self._params:
                continue
            if record.from_param:
                name, key = record.saved_in or record.made_in, "weight_copies"
            else:
                name, key = record.saved_in, str(record.dtype).replace("torch.", "")
            found.setdefault(name, Counter())[key] += record.nbytes
        return {name: dict(counts) for name, counts in found.items()}

    def restart_peak(self) -> None:
        """Measure the peak from now on (a later step's), counting what is live now."""
        self.peak, self._peak_at = self.live, self._clock

    # -- reading ---------------------------------------------------------------------------
    def _ids(self, tensors: Iterable[Any]) -> set[int]:
        found = set()
        for t in tree_leaves(list(tensors)):
            if isinstance(t, torch.Tensor):
                record = self._by_storage.get(t.untyped_storage())
                if record is not None:
                    found.add(id(record))
        return found

    def report(self, *, params: Iterable[Any] = (), grads: Iterable[Any] = (), optimizer: Iterable[Any] = (),
               master: Iterable[Any] = ()) -> MemoryReport:
        """What was live at the peak, by part: the storages of ``params``, ``grads``, ``optimizer``
        (its state) and ``master`` (fp32 master weights) as given (as they are after the step; a
        gradient freed before it is told apart by having been made in the backward), autocast's copies
        of parameters, what autograd saved for backward, and the rest."""
        named = [("parameters", self._ids(params)), ("master", self._ids(master)),
                 ("optimizer", self._ids(optimizer)), ("gradients", self._ids(grads))]
        at = self._peak_at
        parts: Counter[str] = Counter({k: 0 for k in PARTS})
        saved_dtypes: Counter[str] = Counter()
        for record in self._records:
            if record.born > at or (record.died is not None and record.died <= at):
                continue
            part = next((name for name, ids in named if id(record) in ids), None)
            if part is None:
                if record.from_param:
                    part = "weight_copies"
                elif record.saved:
                    part = "activations"
                    saved_dtypes[str(record.dtype).replace("torch.", "")] += record.nbytes
                else:
                    part = "other"
            parts[part] += record.nbytes
        phase = next((name for clock, name in reversed(self._phase_at) if clock < at), self._phase)
        return MemoryReport(sum(parts.values()), dict(parts), dict(saved_dtypes), phase)
