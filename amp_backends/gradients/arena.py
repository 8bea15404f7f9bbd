"""A flat gradient arena: an optimizer's gradients as aligned views into one buffer per (device, dtype).

    arena = amp_backends.flat_grads(optimizer)   # once, after building the optimizer

Each parameter gets a slot in one flat buffer per (device, dtype), 16 bytes aligned. Gradients
keep torch's meaning at every point: ``.grad`` is None exactly where torch's would be (before the
first backward, after ``zero_grad()`` with ``set_to_none=True``, for a parameter no backward
reached), and when backward produces a gradient for a parameter whose ``.grad`` is None, a hook
run just before torch accumulates it puts the slot's (zero) view in ``.grad``, so torch
accumulates into the buffer in place. The scaler then unscales, checks, measures and clips whole
buffers: a constant amount of Python per (device, dtype), with the per-tensor path's results.

Confirming, before each of the scaler's ops, that the buffers hold the optimizer's gradients
(``check=``):

- ``"refcount"`` (default): constant work per buffer and per parameter without a gradient. Every
  slot has exactly one view alive, either in its parameter's ``.grad`` or kept by the arena, so
  the buffer's storage is shared by a known number of tensors: a view dropped from ``.grad`` (set to
  None, replaced, its ``.data`` swapped) or an extra reference held elsewhere changes the count. A
  gradient that appears on a parameter without one (assigned, made by DDP or by a backward the arena
  left to torch) is seen by looking at those parameters. Blind spot: a gradient view kept alive
  outside (``old = p.grad``) while its ``.grad`` is replaced or set to None by hand, with no
  backward in between.
- ``"identity"``: every parameter's ``.grad`` is looked at (about 0.1 us each); no blind spot.

When the count or a look says something changed, the parameters are walked once: views dropped
with nobody else holding them are taken back (their slots zeroed), and the op runs on the buffers
if every gradient is in its slot. Otherwise that step runs on the per-tensor path (correct results),
with one warning naming the cause; ``optimizer.zero_grad()`` brings the gradients back.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..eager import eager, untraced
from .groups import ALIGN_BYTES, ARENA_ATTR, FP16_PARAMS, FlatGroup, layout, views_of

__all__ = ["ALIGN_BYTES", "ARENA_ATTR", "CHECKS", "FP16_PARAMS", "FlatGrads", "FlatGroup", "flat_grads", "flat_grads_of",
           "layout"]

_ATTR = ARENA_ATTR
#: How the arena confirms the gradients are in place (see the module docstring); the first is the default.
CHECKS = ("refcount", "identity")


class _Slots:
    """One buffer's bookkeeping. Each slot's view is alive exactly once: in its parameter's
    ``.grad`` (the slot holds a gradient) or in ``spare`` (it holds none, and is zero)."""

    __slots__ = ("group", "spare", "free", "base", "ptrs", "_storage")

    def __init__(self, group: FlatGroup, installed: Sequence[bool]) -> None:
        self.group = group
        self._storage = group.buffer.untyped_storage()
        self.base = self.refs()  # the buffer alone
        self.ptrs = self._ptrs()
        views = views_of(group.buffer, group.offsets, group.shapes)
        self.spare: list[torch.Tensor | None] = [None if on else v for v, on in zip(views, installed)]
        self.free = {i for i, on in enumerate(installed) if not on}
        for p, v, on in zip(group.params, views, installed):
            if on:
                p.grad = v

    def refs(self) -> int:
        """How many tensors share the buffer's memory (the buffer and this object's handle on it included)."""
        return torch._C._storage_Use_Count(self._storage._cdata)

    def _ptrs(self) -> list[int]:
        """Each slot's address."""
        g = self.group
        start, size = g.buffer.data_ptr(), g.buffer.element_size()
        return [start + off * size for off in g.offsets]

    @eager
    def reclaim(self, i: int) -> torch.Tensor | None:
        """A view for slot ``i``, whose earlier view was dropped from ``.grad``: when no view of the
        buffer is alive anywhere, every slot is free again (zeroed); else None (one may be held)."""
        if self.refs() != self.base + len(self.free):
            return None
        self.fresh(reuse=True)
        return self.spare[i]

    def expected_refs(self) -> int:
        return self.base + len(self.spare)

    def fresh(self, reuse: bool) -> None:
        """Every slot free and zero: the buffer zeroed in place, or (``reuse`` False: an old view
        may still be held elsewhere, and must keep its values) a new buffer."""
        g = self.group
        g.dirty = False
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
        self.spare = list(views_of(g.buffer, g.offsets, g.shapes))
        self.free = set(range(len(self.spare)))

    @eager
    def clean(self) -> None:
        """Zero the free slots and the gaps between slots, after an op multiplied the whole buffer by
        a factor that may have been inf or NaN (0 * inf is NaN): before the buffer is next handed to
        a kernel or a free slot's view to a backward."""
        g = self.group
        g.dirty = False
        if self.free:
            torch._foreach_zero_([self.spare[i] for i in self.free])
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
        self.optimizer = optimizer
        self.check = check
        self._structure = _structure(optimizer)
        self._params = tuple(dict.fromkeys(p for g in optimizer.param_groups for p in g["params"]))
        self._slots: tuple[_Slots, ...] = tuple(_build(self._params))
        self.groups: tuple[FlatGroup, ...] = tuple(s.group for s in self._slots)
        slotted = {id(p) for g in self.groups for p in g.params}
        #: parameters without a slot (requires_grad False when flat_grads() ran): looked at per op
        self._slotless = tuple(p for p in self._params if id(p) not in slotted)
        #: set when a backward left a gradient to torch (outside the buffers)
        self._outside = False
        self._warned: set[str] = set()
        self._torch_zero_grad = optimizer.zero_grad
        self._handles = [p.register_hook(self._arrival(s, i)) for s in self._slots for i, p in enumerate(s.group.params)]

    # -- backward ----------------------------------------------------------------------
    def _arrival(self, slots: _Slots, i: int) -> Any:
        param = slots.group.params[i]

        def arrive(grad: torch.Tensor) -> None:
            """Before torch accumulates ``grad``: a parameter without a gradient gets its slot's
            zero view, so torch accumulates into the buffer in place. (Never traced by dynamo, and
            calls only untraced functions: it runs inside backward, itself never compiled.)"""
            current = param.grad
            if current is not None:
                if current.data_ptr() != slots.ptrs[i]:  # a tensor put there by hand, or by DDP: noted
                    self._outside = True
                return
            if grad.is_sparse or torch.is_grad_enabled():  # sparse, or create_graph: torch makes its own
                self._outside = True
                return
            if slots.group.dirty:  # a free slot's view must be zero before torch accumulates into it
                slots.clean()
            view = slots.spare[i]
            if view is None:  # the view this slot gave was dropped (model.zero_grad(), p.grad = None)
                view = slots.reclaim(i)
                if view is None:  # some view is still alive: leave it be, torch makes a new tensor
                    self._outside = True
                    return
            try:
                param.grad = view
            except RuntimeError:  # the parameter no longer fits its slot (model.half(), .to()): torch's own
                self._outside = True
                return
            slots.spare[i] = None
            slots.free.discard(i)
        return untraced(arrive)

    # -- state -------------------------------------------------------------------------
    def problem(self) -> str | None:
        """Why the buffers do not hold exactly the optimizer's gradients now, or None when they do.

        ``"refcount"``: constant work per buffer and per parameter without a gradient; when that
        finds a change, and always with ``"identity"``, one walk over the parameters (which also
        takes back views dropped with nobody holding them)."""
        if _structure(self.optimizer) != self._structure:
            return ("the optimizer's parameters changed since flat_grads() (a param group added or a "
                    "parameter replaced): call amp_backends.flat_grads(optimizer) again")
        if self._consistent() if self.check == "refcount" else self._each_in_place():
            return None
        return self._resync()

    def _consistent(self) -> bool:
        if self._outside:
            return False
        for s in self._slots:
            if s.refs() != s.expected_refs():
                return False
            params = s.group.params
            for i in s.free:
                if params[i].grad is not None:
                    return False
        return all(p.grad is None for p in self._slotless)

    def _each_in_place(self) -> bool:
        """``"identity"``: every parameter's ``.grad`` is its slot's view, or None with the slot free
        (about 0.1 us a parameter)."""
        if self._outside or any(p.grad is not None for p in self._slotless):
            return False
        for s in self._slots:
            for p, ptr, spare in zip(s.group.params, s.ptrs, s.spare):
                grad = p.grad
                if spare is None:  # the slot gave its view: it must be the gradient
                    if grad is None or grad.data_ptr() != ptr:
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
        for s in self._slots:
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
                else:
                    why = why or _foreign(grad, g, i)
            # references beyond one per spare view and one per gradient in place: views held elsewhere
            extra = s.refs() - s.base - len(s.free) - held
            if dead and extra == 0:  # dropped views nobody holds: their slots are free again, zeroed
                views = views_of(g.buffer, [g.offsets[i] for i in dead], [g.shapes[i] for i in dead])
                torch._foreach_zero_(views)
                for i, v in zip(dead, views):
                    s.spare[i] = v
                    s.free.add(i)
            elif dead:
                why = why or ("a gradient view taken out of .grad is still referenced elsewhere, so its slot "
                              "cannot be reused until optimizer.zero_grad()")
        if why is None:
            self._outside = False
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
        return any(len(s.free) < len(s.group.params) for s in self._slots)

    def groups_for_op(self, allow_fp16: bool) -> list[FlatGroup] | None:
        """The buffers, for the scaler's op, when they hold exactly the optimizer's gradients (else
        None, warned once per cause: the per-tensor path runs); [] when no slot holds a gradient.
        Everything outside the gradients is zero in what it returns. float16 parameters are refused
        (unless ``allow_fp16``) before any buffer is touched, as torch's unscale refuses them."""
        if not self.attached():
            return None
        if not self.has_gradients():
            return []  # torch's path finds no gradient either: its step raises, as torch's does
        if not allow_fp16 and any(g.dtype == torch.float16 for g in self.groups):
            raise ValueError(FP16_PARAMS)
        for s in self._slots:
            if s.group.dirty:
                s.clean()
        return list(self.groups)

    def fits(self) -> bool:
        """Whether every parameter still matches its slot (same parameters, dtypes, shapes, devices)."""
        if _structure(self.optimizer) != self._structure:
            return False
        return all(
            p.dtype == g.dtype and p.shape == shape and p.device == g.device
            for g in self.groups
            for p, shape in zip(g.params, g.shapes)
        )

    # -- zero_grad -----------------------------------------------------------------------
    @eager
    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``, exactly as the parameters see it (``.grad`` None, or zeroed in
        place), at one op per buffer: the views go back to the arena, not to the allocator."""
        if not self.fits():
            return self._torch_zero_grad(set_to_none=set_to_none)
        healthy = self.problem() is None
        if not healthy:  # gradients outside the buffers: torch's zero_grad treats each one as torch would
            self._torch_zero_grad(set_to_none=set_to_none)
            if set_to_none:
                for s in self._slots:  # nothing is in .grad now; a view still held elsewhere keeps its values
                    s.fresh(reuse=s.refs() == s.base + len(s.free))
                self._outside = False
            return
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
            s.fresh(reuse=not held and s.refs() == s.expected_refs())

    def release(self) -> None:
        """Give the optimizer back its own ``zero_grad`` and remove the arena's hooks; the
        gradients stay where they are."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if getattr(self.optimizer, _ATTR, None) is self:
            delattr(self.optimizer, _ATTR)
        if self.optimizer.__dict__.get("zero_grad") == self.zero_grad:
            del self.optimizer.zero_grad

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
    current parameters (after ``add_param_group``, ``model.half()``).

    ``check``: how the scaler confirms, before each op, that the gradients are in the buffers:
    ``"refcount"`` (constant work; one narrow blind spot, see the module docstring) or
    ``"identity"`` (every parameter's ``.grad``, about 0.1 us each)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"flat_grads() takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _require_known(check)  # before the current arena is released: bad input changes nothing
    previous = flat_grads_of(optimizer)
    if previous is not None:
        previous.release()
    arena = FlatGrads(optimizer, check)
    setattr(optimizer, _ATTR, arena)
    optimizer.zero_grad = arena.zero_grad  # type: ignore[method-assign]
    return arena


def flat_grads_of(optimizer: Any) -> FlatGrads | None:
    """The arena :func:`flat_grads` put on ``optimizer``, or None."""
    return getattr(optimizer, _ATTR, None)


def _require_known(check: str) -> None:
    if check not in CHECKS:
        raise ValueError(f"flat_grads(check={check!r}): choose one of {', '.join(map(repr, CHECKS))}")


def _structure(optimizer: torch.optim.Optimizer) -> tuple[tuple[int, int], ...]:
    """What changes when parameters are added or a group's list is replaced: constant per group."""
    return tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)


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
                          tuple(p.numel() for p in members), tuple(p.shape for p in members))
        present = [p.grad is not None for p in members]
        with torch.no_grad():
            for p, off in zip(members, offsets):
                if p.grad is not None:
                    buffer[off:off + p.numel()].copy_(p.grad.reshape(-1))
        yield _Slots(group, present)


def _in_slot(grad: torch.Tensor, group: FlatGroup, i: int) -> bool:
    """Whether ``grad`` is a view of slot ``i`` (the buffer is alive, so no other tensor shares its address)."""
    return (grad.data_ptr() == group.buffer.data_ptr() + group.offsets[i] * group.buffer.element_size()
            and grad.dtype == group.dtype and grad.shape == group.shapes[i] and grad.is_contiguous())


def _foreign(grad: torch.Tensor, group: FlatGroup, i: int) -> str:
    if grad.dtype != group.dtype or grad.shape != group.shapes[i] or grad.device != group.device:
        return (f"a gradient is now {grad.dtype} {tuple(grad.shape)} on {grad.device}, its slot {group.dtype} "
                f"{tuple(group.shapes[i])} on {group.device} (model.half() or .to()?): call "
                "amp_backends.flat_grads(optimizer) again")
    return ("a gradient is a tensor outside the arena (assigned by hand; a DDP bucket view, with "
            "gradient_as_bucket_view=True, or a gradient DDP filled in; or made by torch in a backward with "
            "create_graph=True or sparse gradients): optimizer.zero_grad() brings it back")


@functools.cache
def _grad_refs() -> int:
    """``sys.getrefcount`` of a ``.grad`` read into a local, when nothing else refers to it."""
    p = torch.zeros(1, requires_grad=True)
    p.grad = torch.zeros(1)
    grad = p.grad
    return sys.getrefcount(grad)

