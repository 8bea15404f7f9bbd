"""A flat gradient arena: an optimizer's gradients as aligned views into one buffer per (device, dtype).

    arena = amp_backends.flat_grads(optimizer)   # once, after building the optimizer

Every gradient of the optimizer's parameters then lives in one flat buffer per (device, dtype),
each starting 16 bytes aligned, and stays there: ``optimizer.zero_grad()`` (``set_to_none``
either way) zeroes the buffers and keeps the views, and backward accumulates into them in
place. The scaler finds the arena on the optimizer and runs unscale, check, norm and clip on
the buffers: a constant amount of Python per (device, dtype), with the results of the
per-tensor path, bit for bit.

Gradients keep torch's meaning: a parameter whose gradient no backward produced since
``optimizer.zero_grad()`` (``set_to_none=True``, torch's default) has ``.grad`` None when
``optimizer.step()`` runs (a step pre-hook sets it; the next ``zero_grad`` puts the view back),
so momentum, weight decay and Adam leave it alone exactly as without the arena; with
``set_to_none=False`` it keeps a zero gradient, as torch's would. A backward hook per parameter
notes which gradients arrived; an optimizer with none at all raises in ``scaler.step`` as torch's
scaler does ("No inf checks were recorded").

Memory: the buffers hold every gradient from ``flat_grads()`` on, where torch frees gradients at
``zero_grad(set_to_none=True)`` and makes each one during backward. Peak memory therefore grows by
up to the gradients' size (measured in docs/arena.md), which is the price of the constant host cost.

What leaves a gradient outside its buffer (``model.zero_grad()`` setting it to None, a
gradient assigned by hand, ``model.half()``, DDP with ``gradient_as_bucket_view=True``) or
changes the parameters (``add_param_group``) is found before any op runs: that step takes the
per-tensor path, with one warning naming the cause, and the next ``optimizer.zero_grad()``
takes the gradients back where the parameters still fit their slots.

How that is found (``check=``):

- ``"identity"`` (default): per op, ``p.grad is <its view>`` for every parameter, plus the
  checks below. No tensor is read, but it is one attribute read per parameter (about 0.1 us).
- ``"refcount"``: only constant work per param group and per buffer: the parameter lists'
  identity and length, and how many tensors share each buffer's memory. The arena keeps no
  reference to the views, so a view dropped from ``p.grad`` (set to None, replaced, swapped by
  ``.data =``, by DDP) is freed and the count falls. Blind spot: a gradient replaced while the
  replaced view is still referenced somewhere else (``old = p.grad; p.grad = f(old)`` with
  ``old`` alive at ``unscale_``). Use it where nothing in the loop replaces gradients by hand.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Iterator, Sequence
from itertools import chain
from typing import Any

import torch

from .flat import ALIGN_BYTES, FlatGroup, layout, views_of

__all__ = ["ALIGN_BYTES", "CHECKS", "FlatGrads", "FlatGroup", "flat_grads", "flat_grads_of", "layout"]

_ATTR = "_amp_backends_flat_grads"
#: How the arena confirms the gradients are in place (see the module docstring).
CHECKS = ("identity", "refcount")
_grad_of = operator.attrgetter("grad")


class FlatGrads:
    """The arena of one optimizer (see the module docstring). Made by :func:`flat_grads`."""

    def __init__(self, optimizer: torch.optim.Optimizer, check: str = "identity") -> None:
        _require_known(check)
        self.optimizer = optimizer
        self.check = check
        self._structure = _structure(optimizer)
        self._params = tuple(p for g in optimizer.param_groups for p in g["params"])
        had_grad = {id(p) for p in self._params if p.grad is not None}
        self.groups: tuple[FlatGroup, ...] = tuple(_build_groups(self._params))
        self._warned: set[str] = set()
        self._torch_zero_grad = optimizer.zero_grad
        # Which slots received a gradient since the last zero_grad (a backward hook marks them):
        # with set_to_none (torch's default) the optimizer sees None for the others, as without
        # the arena; those are held back here until the next zero_grad puts them in place again.
        self._slots: tuple[torch.Tensor, ...] = tuple(p for g in self.groups for p in g.params)
        self._got = bytearray(1 if id(p) in had_grad else 0 for p in self._slots)
        self._missing = self._got.count(0)
        self._set_to_none = True
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._handles = [p.register_post_accumulate_grad_hook(self._marker(i)) for i, p in enumerate(self._slots)]
        self._handles.append(optimizer.register_step_pre_hook(self._before_step))
        self._index()

    def _marker(self, i: int) -> Any:
        got = self._got

        def mark(_: torch.Tensor) -> None:
            if not got[i]:
                got[i] = 1
                self._missing -= 1
        return mark

    def _before_step(self, *_: Any) -> None:
        """optimizer.step's pre-hook: parameters whose gradient no backward produced since
        ``zero_grad(set_to_none=True)`` have ``.grad`` None for the step, as torch's would
        (momentum, weight decay and Adam leave them alone)."""
        if not self._missing or not self._set_to_none or self._held or self.problem() is not None:
            return
        for p, got in zip(self._slots, self._got):
            if not got:
                self._held.append((p, p.grad))
                p.grad = None

    def has_gradients(self) -> bool:
        """Whether any slot received a gradient since the last zero_grad (torch's per-tensor
        path would find some gradient), or zero_grad kept zero gradients (``set_to_none=False``)."""
        return self._missing < len(self._slots) or not self._set_to_none

    def _restore_held(self) -> None:
        for p, view in self._held:
            if p.grad is None:
                p.grad = view
        self._held = []

    def _index(self) -> None:
        # "identity": what ``p.grad`` must be, parameter by parameter (None: takes no gradient).
        # "refcount" holds no view: dropping one from ``p.grad`` must free it.
        self._expected: tuple[torch.Tensor | None, ...] | None = None
        if self.check == "identity":
            slot = {id(p): p.grad for g in self.groups for p in g.params}
            self._expected = tuple(slot.get(id(p)) for p in self._params)
        # tensors sharing each buffer's memory: the buffer and the views (fewer: a view was
        # freed, or its ``.data`` swapped, as ``model.to(dtype)`` does to gradients)
        self._refs = tuple(_storage_refs(g.buffer) for g in self.groups)

    # -- state -------------------------------------------------------------------------
    def problem(self) -> str | None:
        """Why the buffers do not hold the optimizer's gradients right now, or None when they do.

        Constant work per param group and per buffer; with ``check="identity"`` also one
        identity test per parameter (no tensor is read)."""
        if _structure(self.optimizer) != self._structure:
            return ("the optimizer's parameters changed since flat_grads() (a param group added or a "
                    "parameter replaced): call amp_backends.flat_grads(optimizer) again")
        intact = all(_storage_refs(g.buffer) >= refs for g, refs in zip(self.groups, self._refs))
        if intact and self._expected is not None:
            params = chain.from_iterable(g["params"] for g in self.optimizer.param_groups)
            intact = all(map(operator.is_, map(_grad_of, params), self._expected))
        return None if intact else self._diagnose()

    def _diagnose(self) -> str:
        slots = {id(p): (g, i) for g in self.groups for i, p in enumerate(g.params)}
        for i, p in enumerate(self._params):
            grad, where = p.grad, slots.get(id(p))
            if where is None:
                if grad is not None:
                    return f"parameter {i} had no slot (requires_grad was False at flat_grads()) but has a gradient now"
                continue
            group, k = where
            if grad is None:
                return (f"parameter {i}'s gradient was set to None: zero gradients with optimizer.zero_grad(), "
                        "which keeps them in the arena")
            if grad.dtype != group.dtype or grad.shape != group.shapes[k] or grad.device != group.device:
                return (f"parameter {i}'s gradient is now {grad.dtype} {tuple(grad.shape)} on {grad.device}, its slot "
                        f"{group.dtype} {tuple(group.shapes[k])} on {group.device} (model.half() or .to()?): call "
                        "amp_backends.flat_grads(optimizer) again")
            expected = None if self._expected is None else self._expected[i]
            if grad.data_ptr() != _slot_ptr(group, k) or (expected is not None and grad is not expected):
                return (f"parameter {i}'s gradient is a tensor outside the arena (set to None, e.g. by "
                        "model.zero_grad(), and made anew by backward; assigned by hand; or DDP with "
                        "gradient_as_bucket_view=True): it is taken back at the next optimizer.zero_grad()")
        # every gradient sits in its slot, yet fewer tensors share a buffer than were made for it
        return ("a gradient view was released from the arena and another tensor now stands in its slot's "
                "place: it is taken back at the next optimizer.zero_grad()")

    def attached(self) -> bool:
        """Whether the scaler may work on the buffers now; warns once per distinct cause when not."""
        why = self.problem()
        if why is None:
            return True
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(f"flat_grads: {why}. This step runs on the per-tensor path.", RuntimeWarning, stacklevel=4)
        return False

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
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the buffers and keep every gradient in place (``set_to_none`` either way).

        Gradients that left their slots are put back (fresh views) while the parameters still
        fit them; when the parameters changed, this is torch's ``zero_grad`` and the arena
        stays out until :func:`flat_grads` is called again."""
        self._restore_held()
        healthy = self.problem() is None
        if not healthy and not self.fits():
            return self._torch_zero_grad(set_to_none=set_to_none)
        with torch.no_grad():
            for group in self.groups:
                group.buffer.zero_()
        self._set_to_none = bool(set_to_none)
        self._got[:] = bytes(len(self._got))
        self._missing = len(self._got)
        if not healthy:
            for group in self.groups:
                for p, view in zip(group.params, views_of(group.buffer, group.offsets, group.shapes)):
                    p.grad = view
            self._index()

    def release(self) -> None:
        """Give the optimizer back its own ``zero_grad`` and remove the arena's hooks; the
        gradients stay where they are."""
        self._restore_held()
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


def flat_grads(optimizer: torch.optim.Optimizer, *, check: str = "identity") -> FlatGrads:
    """Move ``optimizer``'s gradients into one aligned flat buffer per (device, dtype) and keep
    them there (see :mod:`amp_backends.arena`). Current gradients are copied in; a parameter
    without one has a zero view in its slot, which the optimizer does not see (``.grad`` is None
    at ``step()``) until a backward writes it. Calling it again rebuilds the arena for the current
    parameters (after ``add_param_group``, ``model.half()``).

    ``check``: how the scaler confirms, before each op, that the gradients are still in the
    buffers: ``"identity"`` (every parameter's ``.grad``, about 0.1 us each) or ``"refcount"``
    (constant work; one blind spot, see the module docstring)."""
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


def _build_groups(params: Sequence[torch.Tensor]) -> Iterator[FlatGroup]:
    keyed: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    seen: set[int] = set()
    for p in params:
        if not p.requires_grad or id(p) in seen:
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
        seen.add(id(p))
        keyed.setdefault((p.device, p.dtype), []).append(p)
    for (device, dtype), members in keyed.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        offsets, total = layout([p.numel() for p in members], itemsize)
        buffer = torch.zeros(max(total, 1), dtype=dtype, device=device)
        if buffer.data_ptr() % ALIGN_BYTES:  # every allocator here aligns far more; refuse rather than guess
            raise RuntimeError(f"flat_grads(): the {device} allocator returned a buffer not {ALIGN_BYTES}-byte aligned")
        views = list(views_of(buffer, offsets, [p.shape for p in members]))
        with torch.no_grad():
            for p, view in zip(members, views):
                if p.grad is not None:
                    view.copy_(p.grad)
        for p, view in zip(members, views):
            p.grad = view
        del views  # held by ``p.grad`` alone
        yield FlatGroup(device, dtype, buffer, tuple(members), tuple(offsets),
                        tuple(p.numel() for p in members), tuple(p.shape for p in members))


def _slot_ptr(group: FlatGroup, k: int) -> int:
    return group.buffer.data_ptr() + group.offsets[k] * group.buffer.element_size()


def _storage_refs(buffer: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata)
