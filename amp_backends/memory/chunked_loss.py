"""The loss over a large vocabulary without the logits: an LM head and cross-entropy computed a block
of rows at a time, recomputed in backward.

Under autocast the head's logits are low precision, and cross-entropy (an op every device's autocast
runs in float32) makes a float32 copy and saves its float32 log-softmax: for GPT-2 at 8,192 tokens
those are 1.5 GiB each, the largest tensors of the step. :func:`linear_cross_entropy` never holds more
than one block of rows' logits: the forward sums each block's loss and keeps only the head's input,
weight and targets; the backward computes each block again, with the same ops as the plain path
(low-precision matmul, the float32 upcast, cross-entropy), and accumulates the weight's gradient in
float32. The loss equals the plain one to the last bits of a float32 sum, the input's gradient is
each row's own (equal where the matmul's result does not depend on how many rows it is given), the
weight's gradient is a float32 sum where the plain path rounds to the low dtype.

:class:`LazyLogits` lets a model keep its code: a head wrapped by :func:`lazy_head` returns, instead
of logits, a tensor that knows how to make them; reshaping it and ``.float()`` stay lazy,
``F.cross_entropy`` of it runs :func:`linear_cross_entropy`, and anything else computes the logits
whole (correct, without the saving).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LazyLogits", "chunk_rows", "lazy_head", "linear_cross_entropy"]

#: Bytes of float32 logits one block may hold (a block's working set is a few times this).
BLOCK_BYTES = 64 * 2**20


def chunk_rows(vocab: int) -> int:
    """Rows per block: float32 logits of at most :data:`BLOCK_BYTES`."""
    return max(1, BLOCK_BYTES // (4 * vocab))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
                compute: torch.dtype, upcast: bool, ignore_index: int, reduction: str, rows: int) -> torch.Tensor:
        hc, wc = h.to(compute), w.to(compute)
        bc = None if b is None else b.to(compute)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        with torch.no_grad():
            for s in range(0, h.shape[0], rows):
                logits = F.linear(hc[s:s + rows], wc, bc)
                total += F.cross_entropy(logits.float() if upcast else logits, target[s:s + rows],
                                         ignore_index=ignore_index, reduction="sum").float()
        count = (target != ignore_index).sum() if reduction == "mean" else None
        ctx.save_for_backward(hc, wc, bc, target, count)
        ctx.meta = (h.dtype, w.dtype, None if b is None else b.dtype, upcast, ignore_index, rows)
        return total / count if count is not None else total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        hc, wc, bc, target, count = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype, upcast, ignore_index, rows = ctx.meta
        scale = grad / count if count is not None else grad
        gh = torch.empty(hc.shape, dtype=h_dtype, device=hc.device) if ctx.needs_input_grad[0] else None
        gw = torch.zeros(wc.shape, dtype=torch.float32, device=wc.device) if ctx.needs_input_grad[1] else None
        gb = torch.zeros(wc.shape[0], dtype=torch.float32, device=wc.device) if bc is not None and ctx.needs_input_grad[2] else None
        for s in range(0, hc.shape[0], rows):
            block = hc[s:s + rows]
            with torch.enable_grad():
                logits = F.linear(block, wc, bc).detach().requires_grad_(True)
                loss = F.cross_entropy(logits.float() if upcast else logits, target[s:s + rows],
                                       ignore_index=ignore_index, reduction="sum")
                (g_logits,) = torch.autograd.grad(loss, logits, scale.to(loss.dtype))
            if gh is not None:
                gh[s:s + rows] = (g_logits @ wc).to(h_dtype)
            if gw is not None:
                gw.addmm_(g_logits.t().float(), block.float())
            if gb is not None:
                gb += g_logits.float().sum(0)
        return (gh, None if gw is None else gw.to(w_dtype), None if gb is None else gb.to(b_dtype),
                None, None, None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, *, ignore_index: int = -100, reduction: str = "mean",
                         upcast: bool = True, rows: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), target)`` over ``hidden``'s rows (all
    dimensions but the last flattened), a block of ``rows`` at a time, never holding the whole logits
    (see the module docstring). The head runs in the autocast dtype where autocast is on for
    ``hidden``'s device, as ``F.linear`` would; ``upcast``: the logits are made float32 before the
    loss, as autocast and most training code do."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy(reduction={reduction!r}): 'mean' or 'sum' (for per-row losses, "
                         "compute the logits whole)")
    device_type = hidden.device.type
    compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    if t.shape[0] != h.shape[0]:
        raise ValueError(f"linear_cross_entropy: {h.shape[0]} rows of hidden states and {t.shape[0]} targets")
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropy.apply(h, weight, bias, t, compute, upcast, ignore_index, reduction,
                                         rows or chunk_rows(weight.shape[0]))


_LAZY_SHAPE = {torch.Tensor.reshape, torch.Tensor.view, torch.reshape, torch.Tensor.flatten, torch.flatten}
_WARNED: set[str] = set()


class LazyLogits(torch.Tensor):
    """The logits ``F.linear(hidden, weight, bias)`` of a head, not computed yet (see the module
    docstring). Its shape, dtype and device are the logits'."""

    _hidden: torch.Tensor
    _head: tuple[torch.Tensor, torch.Tensor | None]
    _autocast: tuple[bool, torch.dtype]
    _upcast: bool

    @staticmethod
    def __new__(cls, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                autocast: tuple[bool, torch.dtype], upcast: bool = False) -> LazyLogits:
        enabled, low = autocast
        dtype = torch.float32 if upcast else (low if enabled else hidden.dtype)
        self = torch.Tensor._make_wrapper_subclass(
            cls, (*hidden.shape[:-1], weight.shape[0]), dtype=dtype, device=hidden.device,
            requires_grad=hidden.requires_grad or weight.requires_grad)
        self._hidden, self._head, self._autocast, self._upcast = hidden, (weight, bias), autocast, upcast
        return self

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        raise RuntimeError(f"lazy logits reached {func} below autograd (inside torch.compile or a dispatch mode?): "
                           "turn the chunked loss off for this model (lean(..., loss=None)) or compute the logits "
                           "before that point")

    def materialize(self) -> torch.Tensor:
        """The logits, computed whole (differentiable)."""
        weight, bias = self._head
        enabled, low = self._autocast
        with torch.autocast(self._hidden.device.type, dtype=low, enabled=enabled):
            out = F.linear(self._hidden, weight, bias)
        return out.float() if self._upcast else out

    def _like(self, hidden: torch.Tensor | None = None, upcast: bool | None = None) -> LazyLogits:
        return LazyLogits(self._hidden if hidden is None else hidden, *self._head, self._autocast,
                          self._upcast if upcast is None else upcast)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.Tensor.size, torch.Tensor.dim, torch.Tensor.__len__) or getattr(func, "__name__", "") in (
                "__get__",):  # shape, dtype, device, requires_grad...: the wrapper's own metadata
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        self = args[0] if args else None
        if isinstance(self, LazyLogits):
            lazy = self._lazy(func, args[1:], kwargs)
            if lazy is not None:
                return lazy
        if func is F.cross_entropy and isinstance(args[0], LazyLogits) and args[0].dim() == 2:
            out = args[0]._cross_entropy(*args[1:], **kwargs)
            if out is not None:
                return out
        name = getattr(func, "__name__", str(func))
        if name not in _WARNED:
            _WARNED.add(name)
            warnings.warn(f"lean memory: the logits of a lazy LM head were used by {name}, so they were computed whole "
                          "(no saving there): reshape, .float() and F.cross_entropy keep them lazy", RuntimeWarning,
                          stacklevel=3)
        plain = [a.materialize() if isinstance(a, LazyLogits) else a for a in args]
        return func(*plain, **{k: (v.materialize() if isinstance(v, LazyLogits) else v) for k, v in kwargs.items()})

    def _lazy(self, func: Any, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> LazyLogits | None:
        vocab = self.shape[-1]
        if func in _LAZY_SHAPE:
            if func in (torch.Tensor.flatten, torch.flatten):
                start = kwargs.get("start_dim", rest[0] if rest else 0)
                end = kwargs.get("end_dim", rest[1] if len(rest) > 1 else -1)
                if end not in (-1, self.dim() - 1) or start >= self.dim() - 1:
                    return None
                return self._like(hidden=self._hidden.flatten(start, -2) if start < self.dim() - 1 else self._hidden)
            shape = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else rest
            shape = tuple(int(s) for s in shape)
            if not shape or shape[-1] not in (vocab, -1) or (shape[-1] == -1 and len(shape) > 1 and -1 in shape[:-1]):
                return None
            lead = shape[:-1]
            return self._like(hidden=self._hidden.reshape(*lead, self._hidden.shape[-1]))
        if func is torch.Tensor.float or (func is torch.Tensor.to and kwargs.get("dtype", rest[0] if rest else None)
                                          is torch.float32 and len(rest) <= 1):
            return self._like(upcast=True)
        if func is torch.Tensor.contiguous:
            return self
        return None

    def _cross_entropy(self, target: torch.Tensor, weight: Any = None, size_average: Any = None, ignore_index: int = -100,
                       reduce: Any = None, reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor | None:
        if weight is not None or size_average is not None or reduce is not None or label_smoothing or \
                reduction not in ("mean", "sum") or target.dim() != 1 or target.is_floating_point():
            return None
        weight_, bias = self._head
        enabled, low = self._autocast
        with torch.autocast(self._hidden.device.type, dtype=low, enabled=enabled):
            return linear_cross_entropy(self._hidden, weight_, target, bias, ignore_index=ignore_index,
                                        reduction=reduction, upcast=self._upcast)


class _LazyHead:
    """The forward of a head whose logits are made lazily (picklable; ``previous``: the instance
    forward it replaced, or None)."""

    def __init__(self, module: nn.Linear, previous: Any) -> None:
        self.module, self.previous = module, previous

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        device_type = hidden.device.type
        enabled = torch.is_autocast_enabled(device_type)
        low = torch.get_autocast_dtype(device_type) if enabled else hidden.dtype
        return LazyLogits(hidden, self.module.weight, self.module.bias, (enabled, low))


def lazy_head(module: nn.Linear) -> _LazyHead:
    """Make ``module`` (an ``nn.Linear`` head) return :class:`LazyLogits`; ``undo_lazy_head`` reverses it."""
    if not isinstance(module, nn.Linear):
        raise TypeError(f"a lazy LM head is an nn.Linear, got {type(module).__name__}")
    wrapper = _LazyHead(module, module.__dict__.get("forward"))
    module.forward = wrapper  # type: ignore[method-assign]  # the forward is wrapped per instance
    return wrapper


def undo_lazy_head(module: nn.Linear) -> None:
    wrapper = module.__dict__.get("forward")
    if isinstance(wrapper, _LazyHead):
        if wrapper.previous is None:
            del module.__dict__["forward"]
        else:
            module.forward = wrapper.previous  # type: ignore[method-assign]  # the instance's own forward put back
