"""The memory ledger of a training step: every tensor storage, from when it is made to when it is
freed, and what it is (a parameter, a gradient, optimizer state, a master weight, autocast's copy of a
weight, an activation saved for backward, or something else live at the time).

How it counts: a ``TorchDispatchMode`` sees every op's outputs; each new storage gets a record (bytes,
dtype, the op that made it) and a ``weakref.finalize`` on the storage, which fires when its memory is
released (storages keep their Python object alive as long as their memory lives, so views, autograd's
saved tensors and ``.data`` all keep it). A ``saved_tensors_hooks`` pair marks what autograd saves for
backward (and :func:`kept_for_backward` what a selective checkpoint keeps instead, inside its blocks,
where its own hooks take autograd's over; and :func:`gradient_copies` the float32 copies of the gradients
a master-weight step makes, counted as gradients). Storages that exist before the step (parameters,
buffers, inputs, optimizer state) are registered first. A storage an op returns again at another size
(an ``out=`` or ``resize_`` of a tensor: ``torch.mm(a, b, out=torch.empty(0))``) is counted at its new
size from then on. The peak is the largest sum of live storages; what was live at that moment is rebuilt
from the records. Nothing here computes with the tensors: under ``FakeTensorMode`` a full-size model's
step is counted on any machine (:mod:`.fake`; where torch's fake kernel is known to keep other bytes
than the CPU kernel, :data:`FAKE_DIFFERS`, the ledger warns, once an op). Memory the dispatcher never
sees is not counted: a library's scratch space, an allocator's rounding, and a storage resized directly
(``UntypedStorage.resize_``, as FSDP frees and refills its flat parameters: no op runs, so the size
last seen stays counted); on a device with an allocator, its peak is measured beside the ledger.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..torch_private import FakeTensor, TorchDispatchMode, tree_leaves

__all__ = ["FAKE_DIFFERS", "PARTS", "Ledger", "MemoryReport", "counting", "gradient_copies", "kept_for_backward"]

#: The parts of training memory, as the bench and ``check_model`` report them.
PARTS = ("parameters", "gradients", "optimizer", "master", "weight_copies", "activations", "other")


#: (args, the op's tensor outputs) -> what the fake kernel counts otherwise than the CPU kernel, or None
Differs = Callable[[tuple[Any, ...], list[torch.Tensor]], "str | None"]


def _workspace(args: tuple[Any, ...], outs: list[torch.Tensor]) -> str | None:
    if outs[-1].untyped_storage().nbytes() == 0:
        return ("returns a workspace of 0 bytes (what its backward reads), where oneDNN's CPU kernel keeps several "
                "times the layer's output")
    return None


def _loss_buffer(args: tuple[Any, ...], outs: list[torch.Tensor]) -> str | None:
    if outs[0].dim() == 0 and isinstance(args[0], torch.Tensor) and args[0].numel() > 1:
        held = args[0].numel() * outs[0].element_size()
        return (f"returns a reduced loss of {outs[0].element_size()} bytes, where the CPU kernel's is a view of the "
                f"elementwise losses ({held:,} bytes here), held as long as the loss is")
    return None


def _plain_layout(t: Any) -> bool:
    """Whether ``t`` is laid out as the CPU kernels lay out their outputs (contiguous, or channels-last)."""
    if not isinstance(t, torch.Tensor) or t.is_contiguous():
        return True
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    return t.dim() in formats and t.is_contiguous(memory_format=formats[t.dim()])


def _layout(args: tuple[Any, ...], outs: list[torch.Tensor]) -> str | None:
    if all(_plain_layout(t) for t in args[:2]):
        return None
    return ("keeps a non-contiguous input's strides, where the CPU kernel returns a contiguous output: a copy "
            "made later (a .contiguous(), a reshape of a transposed view) is made on one of them only")


def _grad_dtype(args: tuple[Any, ...], outs: list[torch.Tensor]) -> str | None:
    if outs[0].shape == args[1].shape and outs[0].dtype != args[1].dtype:  # (the input's gradient, where asked for)
        return (f"returns the input's gradient in {outs[0].dtype}, where the CPU kernel returns it in the input's "
                f"{args[1].dtype}")
    return None


def _known() -> dict[Any, Differs]:
    table: dict[str, Differs] = {"mkldnn_rnn_layer": _workspace, "native_group_norm_backward": _grad_dtype,
             **dict.fromkeys(("mse_loss", "smooth_l1_loss", "binary_cross_entropy", "soft_margin_loss"), _loss_buffer),
             **dict.fromkeys(("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
                              "native_batch_norm_backward", "batch_norm_backward"), _layout)}
    found: dict[Any, Differs] = {}
    for name, check in table.items():
        packet = getattr(torch.ops.aten, name, None)  # (an op this torch lacks has nothing to warn of)
        if packet is not None:
            found[packet] = check
    return found


#: The ops (overload packets) whose fake kernel keeps other bytes than the CPU kernel where its check
#: says so (torch 2.13): LSTM's oneDNN workspace; the reduced losses whose CPU result is a view of the
#: elementwise ones; batch norm on a non-contiguous input; group norm's backward on a low-precision input.
FAKE_DIFFERS: dict[Any, Differs] = _known()


class _Record:
    __slots__ = ("nbytes", "dtype", "op", "born", "died", "from_param", "saved", "made_in", "saved_in",
                 "grad_copy", "previous")

    def __init__(self, nbytes: int, dtype: torch.dtype, op: str, born: int, made_in: str) -> None:
        self.nbytes, self.dtype, self.op, self.born = nbytes, dtype, op, born
        self.died: int | None = None
        self.from_param = False
        self.saved = False
        #: a copy of gradients (:func:`gradient_copies`): counted as gradients
        self.grad_copy = False
        #: the innermost module running when the storage was made, and when autograd first saved it
        #: ("" outside any module :meth:`Ledger.modules` watches)
        self.made_in, self.saved_in = made_in, ""
        #: the record of the same storage at its size before an op resized it
        self.previous: _Record | None = None


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


def gradient_copies(tensors: Iterable[Any]) -> None:
    """Tell the counting ledgers that the storages of ``tensors`` hold copies of gradients (the float32
    gradients a master-weight step makes of the low-precision ones, 4 bytes a parameter during the
    optimizer phase): they are counted as gradients, not as "other"."""
    for ledger in _COUNTING:
        for record in ledger._found(tensors):
            record.grad_copy = True


class Ledger(TorchDispatchMode):
    """Counts storages through whatever runs inside it (see the module docstring).

        ledger = Ledger()
        state = [v for s in opt.state.values() for v in s.values()]
        ledger.register([*model.buffers(), x, y, *state], params=model.parameters())
        with ledger, ledger.phase("forward"):
            loss = loss_fn(model(x), y)
        with ledger, ledger.phase("backward"):
            loss.backward()
        with ledger, ledger.phase("optimizer"):
            opt.step()
        state = [v for s in opt.state.values() for v in s.values()]
        report = ledger.report(params=model.parameters(), grads=[p.grad for p in model.parameters()],
                               optimizer=state)
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
        #: the ops whose fake kernel keeps other bytes than the CPU kernel, and those warned of already
        self._differs = FAKE_DIFFERS
        self._warned: set[Any] = set()

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
            record = _Record(storage.nbytes(), tensor.dtype, op, 0, self._stack[-1] if self._stack else "")
            self._born(storage, record)
        elif record.nbytes != storage.nbytes():  # an out= or resize_ gave it another size: counted anew
            old, record = record, _Record(storage.nbytes(), record.dtype, record.op, 0, record.made_in)
            self._freed(old)
            for name in ("from_param", "saved", "saved_in", "grad_copy"):
                setattr(record, name, getattr(old, name))
            record.previous = old
            if id(old) in self._params:
                self._params.add(id(record))
            self._born(storage, record)
        return record

    def _born(self, storage: torch.UntypedStorage, record: _Record) -> None:
        self._clock += 1
        record.born = self._clock
        self._records.append(record)
        self._by_storage[storage] = record
        weakref.finalize(storage, self._freed, record)
        self.live += record.nbytes
        if self.live > self.peak:
            self.peak, self._peak_at = self.live, self._clock

    def _freed(self, record: _Record) -> None:
        if record.died is not None:  # resized before: its end was counted then
            return
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
        differs = self._differs.get(func.overloadpacket)
        if differs is not None and func.overloadpacket not in self._warned:
            self._fake_differs(func, differs, args, out)
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

    def _fake_differs(self, func: Any, differs: Any, args: tuple[Any, ...], out: Any) -> None:
        """Warn, once an op, where a fake kernel keeps other bytes than the CPU kernel would here."""
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs or not isinstance(outs[0], FakeTensor):
            return
        why = differs(args, outs)
        if why is not None:
            self._warned.add(func.overloadpacket)
            name = str(func.overloadpacket).replace("aten::", "aten.")
            warnings.warn(f"memory ledger on fake tensors: {name} {why}, so this count may differ from a real CPU step's; "
                          "measure this model with real tensors (amp_backends.memory.fake.measure(make, fake=False), "
                          "or bench --memory on the device) for its exact figures", RuntimeWarning, stacklevel=2)

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
    def _found(self, tensors: Iterable[Any]) -> list[_Record]:
        """The records of ``tensors``' storages, each with those of its sizes before a resize."""
        found = []
        for t in tree_leaves(list(tensors)):
            if isinstance(t, torch.Tensor):
                record = self._by_storage.get(t.untyped_storage())
                while record is not None:
                    found.append(record)
                    record = record.previous
        return found

    def _ids(self, tensors: Iterable[Any]) -> set[int]:
        return {id(record) for record in self._found(tensors)}

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
                if record.grad_copy:
                    part = "gradients"
                elif record.from_param:
                    part = "weight_copies"
                elif record.saved:
                    part = "activations"
                    saved_dtypes[str(record.dtype).replace("torch.", "")] += record.nbytes
                else:
                    part = "other"
            parts[part] += record.nbytes
        phase = next((name for clock, name in reversed(self._phase_at) if clock < at), self._phase)
        return MemoryReport(sum(parts.values()), dict(parts), dict(saved_dtypes), phase)
