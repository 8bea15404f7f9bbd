"""A flat gradient arena: an optimizer's gradients as aligned views into one buffer per (device, dtype).

    arena = amp_backends.flat_grads(optimizer)   # once, after building the optimizer

Each parameter gets a 16-byte aligned slot in one flat buffer per (device, dtype). ``.grad`` is None
exactly where torch's would be; when backward accumulates into a ``.grad`` that is None, a hook on
the parameter's ``AccumulateGrad`` node first puts the slot's zero view there (:mod:`.accumulation`),
so torch accumulates into the buffer in place. The scaler then unscales, checks, measures and clips
whole buffers: constant Python per (device, dtype), the per-tensor path's results (docs/arena.md).

Before each op the arena confirms the optimizer still has the parameters it was built for: each
group's list counts its own changes (:mod:`.watched`), so a parameter replaced in it is seen by one
integer comparison per group (a list someone else held at ``flat_grads()`` is compared tensor by
tensor, in C). Then it confirms that the buffers hold their gradients (``check=``):

- ``"refcount"`` (default): constant work per buffer and per parameter without a gradient. Each
  slot has one view alive, in ``.grad`` or kept by the arena, so the buffer's storage is shared by
  a known number of tensors: a view's ``.data`` swapped or a reference held elsewhere changes the
  count. A view in ``.grad`` is watched (a weak reference): its end (``.grad`` set to None or
  replaced, nobody holding the view) is noted even where another reference balances the count. A
  gradient appearing where there was none is seen by looking at those parameters. Blind spots, with
  no backward reaching the parameter before the op: the view object itself kept elsewhere
  (``old = p.grad``) while ``.grad`` is replaced or set to None by hand; a view's ``.data`` swapped
  while as many new tensors sharing the buffer are made.
- ``"identity"``: every parameter's ``.grad`` is looked at (about 0.1 us each); no blind spot. The
  default on a torch without ``torch._C._storage_Use_Count``, where ``"refcount"`` is refused: there a
  view dropped from ``.grad`` by hand is taken as possibly held elsewhere (its step runs on the
  per-tensor path until ``optimizer.zero_grad()``), and ``zero_grad`` gives each buffer new memory.

When a check finds a change, the parameters are walked once: views dropped with nobody else holding
them are taken back, and the op runs on the buffers if every gradient is in its slot; else that step
runs on the per-tensor path (correct results), warned once per cause, and ``optimizer.zero_grad()``
brings the gradients back. The arena holds its optimizer weakly: it goes when the optimizer goes.
"""

from __future__ import annotations

import functools
import operator
import sys
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .. import patches
from ..eager import eager
from ..torch_private import foreach_zero_, storage_use_count
from .accumulation import Hooks, holders, take_over
from .groups import ALIGN_BYTES, ARENA_ATTR, FP16_PARAMS, FlatGroup, layout, slot_strides, views_of
from .watched import ParamGroups

__all__ = ["ALIGN_BYTES", "ARENA_ATTR", "CHECKS", "FP16_PARAMS", "FlatGrads", "FlatGroup", "flat_grads", "flat_grads_of",
           "layout"]

_ATTR = ARENA_ATTR
_use_count = storage_use_count
#: How the arena confirms the gradients are in place (see the module docstring); the first is the default.
#: "refcount" counts with torch._C._storage_Use_Count: only where the running torch has it.
CHECKS = ("refcount", "identity") if _use_count is not None else ("identity",)


class _Slots:
    """One buffer's bookkeeping. Each slot's view is alive exactly once: in its parameter's
    ``.grad`` (the slot holds a gradient) or in ``spare`` (it holds none, and is zero). A view in
    ``.grad`` is watched (``watch``, a weak reference): when it ends (dropped from ``.grad`` with
    nobody holding it), its weak reference lands in ``drops``, and the next check walks."""

    __slots__ = ("_storage", "base", "drops", "free", "group", "on_drop", "ptrs", "spare", "watch")

    def __init__(self, group: FlatGroup, installed: Sequence[bool]) -> None:
        self.group = group
        self._storage = group.buffer.untyped_storage()
        self.base = self.refs()  # the buffer alone
        self.ptrs = self._ptrs()
        views = views_of(group.buffer, group.offsets, group.shapes, group.strides)
        self.spare: list[torch.Tensor | None] = [None if on else v for v, on in zip(views, installed)]
        self.free = {i for i, on in enumerate(installed) if not on}
        self.drops: list[Any] = []
        self.on_drop = self.drops.append  # a builtin: called while a view is freed, wherever that happens
        self.watch: list[Any] = [weakref.ref(v, self.on_drop) if on else None for v, on in zip(views, installed)]
        for p, v, on in zip(group.params, views, installed):
            if on:
                p.grad = v

    def refs(self) -> int | None:
        """How many tensors share the buffer's memory (the buffer and this object's handle on it included);
        None on a torch that cannot count them."""
        return None if _use_count is None else _use_count(self._storage._cdata)

    def unshared(self, views: int) -> bool:
        """Whether exactly ``views`` views of the buffer are alive besides the buffer: none held anywhere
        else. False where torch cannot count them (any may be held: nothing is reused)."""
        refs = self.refs()
        return refs is not None and self.base is not None and refs == self.base + views

    def _ptrs(self) -> list[int]:
        """Each slot's address."""
        g = self.group
        start, size = g.buffer.data_ptr(), g.buffer.element_size()
        return [start + off * size for off in g.offsets]

    @eager
    def reclaim(self, i: int) -> torch.Tensor | None:
        """A view for slot ``i``, whose earlier view was dropped from ``.grad``: when no view of the
        buffer is alive anywhere, every slot is free again (zeroed); else None (one may be held)."""
        if not self.unshared(len(self.free)):
            return None
        self.fresh(reuse=True)
        return self.spare[i]

    def fresh(self, reuse: bool) -> None:
        """Every slot free and zero: the buffer zeroed in place, or (``reuse`` False: an old view
        may still be held elsewhere, and must keep its values) a new buffer."""
        g = self.group
        g.dirty = False
        self.watch = [None] * len(self.watch)  # every view comes back to the arena: none is watched
        self.drops.clear()
        if reuse:
            g.buffer.zero_()
            if len(self.free) == len(self.spare):  # every view is a spare already
                return
        else:
            g.buffer = torch.zeros_like(g.buffer)
            g.cache.clear()
            self._storage = g.buffer.untyped_storage()
            self.base = self.refs()
            self.ptrs = self._ptrs()
        self.spare = list(views_of(g.buffer, g.offsets, g.shapes, g.strides))
        self.free = set(range(len(self.spare)))

    @eager
    def clean(self) -> None:
        """Zero the free slots and the gaps between slots, after an op multiplied the whole buffer by
        a factor that may have been inf or NaN (0 * inf is NaN): before the buffer is next handed to
        a kernel or a free slot's view to a backward."""
        g = self.group
        g.dirty = False
        if self.free:
            foreach_zero_([self.spare[i] for i in self.free])
        gaps = g.cache.get("gaps")
        if gaps is None:
            ends = [o + n for o, n in zip(g.offsets, g.numels)]
            starts = list(g.offsets[1:]) + [g.buffer.numel()]
            index = [i for e, s in zip(ends, starts) for i in range(e, s)]
            gaps = g.cache["gaps"] = torch.tensor(index, dtype=torch.int64, device=g.device)
        if gaps.numel():
            g.buffer.index_fill_(0, gaps, 0)


class FlatGrads:
    """The arena of one optimizer (see the module docstring). Made by :func:`flat_grads`."""

    def __init__(self, optimizer: torch.optim.Optimizer, check: str = CHECKS[0]) -> None:
        _require_known(check)
        self._optimizer = weakref.ref(optimizer)
        self.check = check
        #: the param groups' lists of parameters, watched where they can be (:mod:`.watched`)
        self._param_groups = ParamGroups(optimizer)
        self._params = tuple(dict.fromkeys(p for params in self._param_groups.copies for p in params))
        self._slots: tuple[_Slots, ...] = tuple(_build(self._params))
        self.groups: tuple[FlatGroup, ...] = tuple(s.group for s in self._slots)
        self._fp16 = any(g.dtype == torch.float16 for g in self.groups)
        #: parameters without a slot (requires_grad False when flat_grads() ran): looked at per op
        self._slotless = tuple(p for p in self._params if not p.requires_grad)
        #: set when a backward left a gradient to torch (outside the buffers), or a walk found one
        self._outside = False
        #: (buffer, slot) of gradients torch made where the slot was free: nodes to look at, at zero_grad
        self._suspects: set[tuple[int, int]] = set()
        self._warned: set[str] = set()
        #: a zero_grad the optimizer had as its own attribute (else its class's runs)
        self._own_zero_grad = optimizer.__dict__.get("zero_grad")
        self._zero_grad_patch: patches.Patch | None = None  # set by flat_grads(), undone by release()
        self._hooks = Hooks(self, optimizer, self._slots)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer (held weakly: None once nobody else holds it)."""
        return self._optimizer()

    # -- state -------------------------------------------------------------------------
    def problem(self) -> str | None:
        """Why the buffers do not hold exactly the optimizer's gradients now, or None when they do.

        ``"refcount"``: constant work per buffer and per parameter without a gradient; when that
        finds a change, and always with ``"identity"``, one walk over the parameters (which also
        takes back views dropped with nobody holding them). Before either, whether the optimizer
        still has the parameters the arena was built for (one pointer comparison each, in C)."""
        optimizer = self._optimizer()
        if optimizer is None:
            return "the optimizer this arena was made for is gone"
        if not self._param_groups.unchanged(optimizer):
            return self._param_groups.change(optimizer)
        if self._consistent() if self.check == "refcount" else self._each_in_place():
            return None
        return self._resync()

    def _consistent(self) -> bool:
        if self._outside:
            return False
        for s in self._slots:
            if s.drops or not s.unshared(len(s.spare)):  # a view ended, or the count moved
                return False
            params = s.group.params
            for i in s.free:
                if params[i].grad is not None:
                    return False
        return _all_none(self._slotless)

    def _each_in_place(self) -> bool:
        """``"identity"``: every parameter's ``.grad`` is its slot's view, or None with the slot free
        (about 0.1 us a parameter)."""
        if self._outside or any(p.grad is not None for p in self._slotless):
            return False
        for s in self._slots:
            for p, ptr, spare in zip(s.group.params, s.ptrs, s.spare):
                grad = p.grad
                if spare is None:  # the slot gave its view: it must be the gradient
                    if grad is None or (grad.data_ptr() != ptr and grad.numel()):  # (an empty one has no address)
                        return False
                elif grad is not None:  # a free slot: the parameter has no gradient
                    return False
        return True

    def _resync(self) -> str | None:
        """Walk the parameters: note which slots hold their parameter's gradient, take back dropped
        views nobody holds, and say what keeps the buffers from holding every gradient."""
        why = None
        if any(p.grad is not None for p in self._slotless):
            why = ("a parameter without a slot (requires_grad was False at flat_grads()) has a gradient now: "
                   "call amp_backends.flat_grads(optimizer) again")
        for k, s in enumerate(self._slots):
            g = s.group
            held, dead = 0, []
            for i, p in enumerate(g.params):
                grad = p.grad
                if grad is None:
                    if s.spare[i] is None:
                        dead.append(i)
                elif _in_slot(grad, g, i):
                    held += 1
                    if s.spare[i] is not None:  # a view of this slot kept from before, put back by hand
                        s.spare[i] = None
                        s.free.discard(i)
                        s.watch[i] = weakref.ref(grad, s.on_drop)
                else:
                    why = why or _foreign(grad, g, i)
                    if s.spare[i] is not None:  # made where the slot was free: its node may lack the hook
                        self._suspects.add((k, i))
            # no references beyond one per spare view and one per gradient in place: no view held elsewhere
            if dead and s.unshared(len(s.free) + held):  # dropped views nobody holds: their slots are free again, zeroed
                views = views_of(g.buffer, [g.offsets[i] for i in dead], [g.shapes[i] for i in dead],
                                 [g.stride(i) for i in dead])
                foreach_zero_(views)
                for i, v in zip(dead, views):
                    s.spare[i] = v
                    s.free.add(i)
                    s.watch[i] = None
            elif dead and s.refs() is None:
                why = why or ("a gradient view was taken out of .grad by hand (p.grad = None, model.zero_grad()), and "
                              "this torch cannot count who still holds it (it lacks torch._C._storage_Use_Count): "
                              "optimizer.zero_grad() brings the gradients back")
            elif dead:
                why = why or ("a gradient view taken out of .grad is still referenced elsewhere, so its slot "
                              "cannot be reused until optimizer.zero_grad()")
            s.drops.clear()  # every view that ended is accounted for above
        # until a walk finds every gradient in place again, each check walks
        self._outside = why is not None
        return why

    def attached(self) -> bool:
        """Whether the scaler may work on the buffers now; warns once per distinct cause when not."""
        why = self.problem()
        if why is None:
            return True
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(f"flat_grads: {why}. This step runs on the per-tensor path.", RuntimeWarning, stacklevel=4)
        return False

    def has_gradients(self) -> bool:
        """Whether any slot holds a gradient (the per-tensor path would find one)."""
        for s in self._slots:
            if len(s.free) < len(s.spare):
                return True
        return False

    def groups_for_op(self, allow_fp16: bool) -> list[FlatGroup] | None:
        """The buffers, for the scaler's op, when they hold exactly the optimizer's gradients (else
        None, warned once per cause: the per-tensor path runs); [] when no slot holds a gradient.
        Everything outside the gradients is zero in what it returns. float16 parameters are refused
        (unless ``allow_fp16``) before any buffer is touched, as torch's unscale refuses them."""
        if not self.attached():
            return None
        if not self.has_gradients():
            return []  # torch's path finds no gradient either: its step raises, as torch's does
        if not allow_fp16 and self._fp16:
            raise ValueError(FP16_PARAMS)
        for s in self._slots:
            if s.group.dirty:
                s.clean()
        return list(self.groups)

    def fits(self) -> bool:
        """Whether every parameter still matches its slot (same parameters, dtypes, shapes, devices)."""
        optimizer = self._optimizer()
        if optimizer is None or not self._param_groups.unchanged(optimizer):
            return False
        return all(
            p.dtype == g.dtype and p.shape == g.shapes[i] and p.device == g.device and slot_strides(p) == g.stride(i)
            for g in self.groups
            for i, p in enumerate(g.params)
        )

    # -- zero_grad -----------------------------------------------------------------------
    @eager
    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``, exactly as the parameters see it (``.grad`` None, or zeroed in
        place), at one op per buffer: the views go back to the arena, not to the allocator."""
        optimizer = self._optimizer()
        if optimizer is None:
            return None
        if not self.fits():
            return self._torch_zero_grad(optimizer, set_to_none)
        healthy = self.problem() is None
        if not healthy:  # gradients outside the buffers: torch's zero_grad treats each one as torch would
            self._torch_zero_grad(optimizer, set_to_none)
            if set_to_none:
                for s in self._slots:  # nothing is in .grad now; a view still held elsewhere keeps its values
                    s.fresh(reuse=s.unshared(len(s.free)))
                self._outside = False
            self._hooks.refresh(self._slots, self._suspects)  # a parameter with a new node is hooked again
            self._suspects.clear()
            return None
        for s in self._slots:
            if not set_to_none:
                s.group.buffer.zero_()  # torch zeroes each gradient in place: one op here
                s.group.dirty = False
                continue
            params, spare = s.group.params, s.spare
            held = False
            for i in range(len(params)):
                grad = params[i].grad
                if grad is not None:
                    held = held or sys.getrefcount(grad) > _grad_refs()  # the user keeps this gradient
                    spare[i] = grad
                    params[i].grad = None
            s.free = set(range(len(params)))
            # zeroed in place unless a gradient is still referenced elsewhere: torch would leave it be
            s.fresh(reuse=not held and s.unshared(len(s.spare)))

    def _torch_zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        if self._own_zero_grad is not None:
            self._own_zero_grad(set_to_none=set_to_none)
        else:
            type(optimizer).zero_grad(optimizer, set_to_none=set_to_none)

    def release(self) -> None:
        """Give the optimizer back its own ``zero_grad`` and remove the arena's hooks; the
        gradients stay where they are."""
        self._hooks.remove(self._slots)
        optimizer = self._optimizer()
        if optimizer is None:
            return
        if getattr(optimizer, _ATTR, None) is self:
            delattr(optimizer, _ATTR)
        if self._zero_grad_patch is not None:
            self._zero_grad_patch.remove()

    @property
    def nbytes(self) -> int:
        """Bytes the buffers take, alignment gaps included."""
        return sum(g.buffer.numel() * g.buffer.element_size() for g in self.groups)

    def __iter__(self) -> Iterator[FlatGroup]:
        return iter(self.groups)

    def __repr__(self) -> str:
        parts = ", ".join(f"{g.device}/{str(g.dtype).replace('torch.', '')}: {len(g.params)}" for g in self.groups)
        return f"<FlatGrads {parts}>"


def flat_grads(optimizer: torch.optim.Optimizer, *, check: str = CHECKS[0]) -> FlatGrads:
    """Give ``optimizer``'s gradients one aligned flat buffer per (device, dtype) (see
    :mod:`amp_backends.gradients.arena`). Gradients present are copied in; parameters without one keep
    ``.grad`` None until a backward reaches them. Calling it again rebuilds the arena for the
    current parameters (after ``add_param_group``, ``model.half()``, a parameter replaced). Parameters
    that the arena of another optimizer still alive holds are taken over: that arena is released
    (with a warning); an optimizer nobody holds any more has let go of its parameters already.

    ``check``: how the scaler confirms, before each op, that the gradients are in the buffers:
    ``"refcount"`` (constant work; two narrow blind spots, see the module docstring) or
    ``"identity"`` (every parameter's ``.grad``, about 0.1 us each)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"flat_grads() takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _require_known(check)  # before the current arena is released: bad input changes nothing
    previous = flat_grads_of(optimizer)
    if previous is not None:
        previous.release()
    others = holders((p for g in optimizer.param_groups for p in g["params"]), previous)
    arena = FlatGrads(optimizer, check)
    setattr(optimizer, _ATTR, arena)
    arena._zero_grad_patch = patches.replace(
        optimizer, "zero_grad", arena.zero_grad, scope="until FlatGrads.release() (or flat_grads() again)",
        cause="the arena's zero_grad keeps gradients in its buffers (zeroed in place, or set to None as torch's)")
    take_over(others)
    return arena


def flat_grads_of(optimizer: Any) -> FlatGrads | None:
    """The arena :func:`flat_grads` put on ``optimizer``, or None."""
    return getattr(optimizer, _ATTR, None)


def _require_known(check: str) -> None:
    if check == "refcount" and _use_count is None:
        raise ValueError("flat_grads(check='refcount') counts the tensors sharing each buffer with "
                         "torch._C._storage_Use_Count, which this torch lacks: use check='identity' (the default here)")
    if check not in CHECKS:
        raise ValueError(f"flat_grads(check={check!r}): choose one of {', '.join(map(repr, CHECKS))}")


def _build(params: Sequence[torch.Tensor]) -> Iterator[_Slots]:
    keyed: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        if not p.requires_grad:
            continue
        if p.layout is not torch.strided or type(p) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(
                f"flat_grads() needs plain dense parameters, got a {type(p).__name__} with layout {p.layout} "
                "(FSDP2 shards are DTensors): use the scaler without an arena for this optimizer"
            )
        if not p.dtype.is_floating_point:
            raise TypeError(f"flat_grads(): a parameter of dtype {p.dtype} cannot have a gradient")
        if p.grad is not None and p.grad.is_sparse:  # refused before any gradient has moved
            raise TypeError("flat_grads(): sparse gradients cannot live in a flat buffer")
        keyed.setdefault((p.device, p.dtype), []).append(p)
    for (device, dtype), members in keyed.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        offsets, total = layout([p.numel() for p in members], itemsize)
        buffer = torch.zeros(max(total, 1), dtype=dtype, device=device)
        if buffer.data_ptr() % ALIGN_BYTES:  # every allocator here aligns far more; refuse rather than guess
            raise RuntimeError(f"flat_grads(): the {device} allocator returned a buffer not {ALIGN_BYTES}-byte aligned")
        group = FlatGroup(device, dtype, buffer, tuple(members), tuple(offsets),
                          tuple(p.numel() for p in members), tuple(p.shape for p in members),
                          tuple(slot_strides(p) for p in members))
        present = [p.grad is not None for p in members]
        with torch.no_grad():
            for i, p in enumerate(members):
                if p.grad is not None:
                    group.view(i).copy_(p.grad)
        yield _Slots(group, present)


def _in_slot(grad: torch.Tensor, group: FlatGroup, i: int) -> bool:
    """Whether ``grad`` is a view of slot ``i`` (the buffer is alive, so no other tensor shares its address)."""
    if group.numels[i] == 0:  # an empty gradient has no address: any of its dtype and shape is the slot's
        return grad.dtype == group.dtype and grad.shape == group.shapes[i]
    return (grad.data_ptr() == group.buffer.data_ptr() + group.offsets[i] * group.buffer.element_size()
            and grad.dtype == group.dtype and grad.shape == group.shapes[i] and grad.stride() == group.stride(i))


def _foreign(grad: torch.Tensor, group: FlatGroup, i: int) -> str:
    if grad.dtype != group.dtype or grad.shape != group.shapes[i] or grad.device != group.device:
        return (f"a gradient is now {grad.dtype} {tuple(grad.shape)} on {grad.device}, its slot {group.dtype} "
                f"{tuple(group.shapes[i])} on {group.device} (model.half() or .to()?): call "
                "amp_backends.flat_grads(optimizer) again")
    return ("a gradient is a tensor outside the arena (assigned by hand; a DDP bucket view, with "
            "gradient_as_bucket_view=True, or a gradient DDP filled in; or made by torch in a backward with "
            "create_graph=True or sparse gradients): optimizer.zero_grad() brings it back")


_grad_of = operator.attrgetter("grad")


def _all_none(params: Sequence[torch.Tensor]) -> bool:
    """Whether no parameter of ``params`` has a gradient (read in C: no Python frame per parameter)."""
    return list(map(_grad_of, params)).count(None) == len(params)


@functools.cache
def _grad_refs() -> int:
    """``sys.getrefcount`` of a ``.grad`` read into a local, when nothing else refers to it."""
    p = torch.zeros(1, requires_grad=True)
    p.grad = torch.zeros(1)
    grad = p.grad
    return sys.getrefcount(grad)

