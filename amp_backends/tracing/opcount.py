"""Every matmul-like op a model runs, forward and backward, with the module it ran in, the dtype it
computed in, its FLOPs and whether its shape suits low-precision matrix units; and the first op whose
output held inf/NaN.

FLOPs are torch's own formulas (``torch.utils.flop_counter``, what ``FlopCounterMode`` counts:
mm, addmm, bmm, baddbmm, convolutions and their backward, the fused attention kernels); for the ops
it has none for, the formulas here (:data:`FORMULAS`), stated in docs/precision.md: ``mv``/``addmv``
``2*m*n``; ``dot``/``vdot`` ``2*n``; ``addbmm`` ``2*b*m*n*k``; ``addr`` ``2*m*n``; CPU flash attention
(``_scaled_dot_product_flash_attention_for_cpu``, and its backward) as torch's flash formula;
oneDNN's RNN layer (``mkldnn_rnn_layer``) ``2*seq*batch*(|W_ih|+|W_hh|)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..torch_private import DisableTorchDispatch, TorchDispatchMode, tree_leaves
from .produced import ProducedWatch

__all__ = ["ALIGN", "FORMULAS", "NonFinite", "Op", "OpRecorder"]

#: fp16/bf16 Tensor Cores (and AMD matrix cores) take dimensions in multiples of this.
ALIGN = 8
_LOW = (torch.float16, torch.bfloat16)
_aten = torch.ops.aten


def _torch_formulas() -> dict[Any, Callable[..., int]]:
    from torch.utils.flop_counter import flop_registry

    return dict(flop_registry)


def _sdpa_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return int(sdpa_flop_count(query.shape, key.shape, value.shape))


def _sdpa_cpu_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       *args: Any, **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return int(sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape))


def _rnn_layer(x: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    seq, batch = (x.shape[0], x.shape[1]) if x.dim() == 3 else (x.shape[0], 1)
    return 2 * seq * batch * (w_ih.numel() + w_hh.numel())


#: The formulas for the matmul-like ops torch's flop counter has none for (by op packet name).
FORMULAS: dict[str, Callable[..., int]] = {
    "mv": lambda a, v, *r, **k: 2 * a.shape[0] * a.shape[1],
    "addmv": lambda s, a, v, *r, **k: 2 * a.shape[0] * a.shape[1],
    "dot": lambda a, b, *r, **k: 2 * a.shape[0],
    "vdot": lambda a, b, *r, **k: 2 * a.shape[0],
    "addbmm": lambda s, a, b, *r, **k: 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2],
    "addr": lambda s, a, b, *r, **k: 2 * a.shape[0] * b.shape[0],
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa_cpu,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_cpu_backward,
    "mkldnn_rnn_layer": _rnn_layer,
}


@dataclass
class Op:
    """One matmul-like op: where and how it ran."""

    module: str
    name: str
    backward: bool
    dtype: torch.dtype
    flops: int
    #: e.g. "mm 30x100x7"; dims not multiples of ALIGN in a low-precision op make it "misaligned"
    shape: str
    misaligned: bool


@dataclass
class NonFinite:
    """The first op that produced inf/NaN (:mod:`.produced`: an overflow or a NaN made by arithmetic, not an
    inf written on purpose or carried on from its inputs)."""

    module: str
    op: str
    backward: bool
    dtype: str
    shape: tuple[int, ...]
    count: int

    def __str__(self) -> str:
        where = self.module or "(model)"
        phase = "backward" if self.backward else "forward"
        return (f"{phase}: {self.op} in {where} ({self.dtype} {list(self.shape)}) produced {self.count} inf/NaN "
                f"value{'s' if self.count != 1 else ''}")


class OpRecorder(TorchDispatchMode):
    """A ``TorchDispatchMode`` (below autocast: it sees the dtypes ops really run in) that records
    the matmul-like ops with the innermost module running (``where()``: its name and whether this is
    the backward), and notes, on the device with no host read, how many inf/NaN each op produced
    (in-place ops and ``out=`` arguments included: the tensor written is the output), for
    :meth:`first_nonfinite`."""

    def __init__(self, where: Callable[[], tuple[str, bool]], watch_nonfinite: bool = True) -> None:
        super().__init__()
        self.where = where
        self.watch_nonfinite = watch_nonfinite
        self._produced = ProducedWatch() if watch_nonfinite else None
        self.ops: list[Op] = []
        self._counts: list[tuple[torch.Tensor, str, str, bool, str, tuple[int, ...]]] = []
        self._torch = _torch_formulas()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pending = self._produced.before(func, args, kwargs) if self._produced is not None else None
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        torch_formula = self._torch.get(packet)
        formula = torch_formula or FORMULAS.get(packet.__name__)
        found = self._produced.after(pending, out) if pending is not None else None
        if formula is None and found is None:
            return out
        module, backward = self.where()
        if formula is not None:
            self._record(func, formula, torch_formula is not None, args, kwargs, out, module, backward)
        if found is not None:
            count, dtype, shape = found
            self._counts.append((count, module, packet.__name__, backward, dtype, shape))
        return out

    def _record(self, func: Any, formula: Callable[..., int], torch_formula: bool, args: Any, kwargs: Any, out: Any,
                module: str, backward: bool) -> None:
        try:
            flops = int(formula(*args, **kwargs, out_val=out) if torch_formula else formula(*args, **kwargs))
        except Exception:  # noqa: BLE001 - a formula that cannot read these arguments counts nothing
            flops = 0
        tensors = [a for a in tree_leaves(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        if not tensors:
            return
        name = func.overloadpacket.__name__
        dtype = tensors[1].dtype if len(tensors) > 1 and name.startswith("add") else tensors[0].dtype
        label, dims = _shape(func, args)
        misaligned = dtype in _LOW and any(d % ALIGN for d in dims)
        self.ops.append(Op(module, name, backward, dtype, flops, label, misaligned))

    def first_nonfinite(self, backward: bool) -> NonFinite | None:
        """The first op of the forward (or backward) that produced inf/NaN: one host read."""
        rows = [r for r in self._counts if r[3] == backward]
        if not rows:
            return None
        with DisableTorchDispatch():
            counts = torch.stack([r[0].to(rows[0][0].device).reshape(()) for r in rows]).cpu()
        hits = torch.nonzero(counts).flatten()
        if not hits.numel():
            return None
        i = int(hits[0])
        _, module, op, bw, dtype, shape = rows[i]
        return NonFinite(module, op, bw, dtype, shape, int(counts[i]))


def _shape(func: Any, args: tuple[Any, ...]) -> tuple[str, tuple[int, ...]]:
    """A short label and the dimensions that need alignment for low-precision matrix units."""
    name = func.overloadpacket.__name__
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    try:
        if name in ("mm", "bmm", "addmm", "baddbmm", "addbmm"):
            a, b = (tensors[1], tensors[2]) if name.startswith("add") else (tensors[0], tensors[1])
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            return f"{name} {m}x{n}x{k}", (m, n, k)
        if name in ("convolution", "_convolution", "convolution_backward"):
            if name == "convolution_backward":
                x, w = tensors[1], tensors[2]
                groups = args[-2] if isinstance(args[-2], int) else 1
                transposed = bool(args[7]) if len(args) > 7 and isinstance(args[7], bool) else False
            else:
                x, w = tensors[0], tensors[1]
                groups = args[8] if len(args) > 8 and isinstance(args[8], int) else 1
                transposed = bool(args[6]) if len(args) > 6 and isinstance(args[6], bool) else False
            # weight: (out, in/groups, k...) or transposed (in, out/groups, k...); per-group channels matter
            per_in = (w.shape[0] // groups) if transposed else w.shape[1]
            per_out = w.shape[1] if transposed else (w.shape[0] // groups)
            kind = "conv_transpose" if transposed else "conv"
            label = f"{kind} {x.shape[1]}->{per_out * groups} k{'x'.join(map(str, w.shape[2:]))}"
            return label + (f" g{groups}" if groups > 1 else ""), (per_in, per_out)
        if name in ("mv", "addmv"):
            a = tensors[1] if name == "addmv" else tensors[0]
            return f"{name} {a.shape[0]}x{a.shape[1]}", tuple(a.shape)
        if "attention" in name:
            q = tensors[0] if not name.endswith("backward") else tensors[1]
            return f"{name.strip('_')} {'x'.join(map(str, q.shape))}", (q.shape[-1],)
        shape = tuple(tensors[0].shape) if tensors else ()
        return f"{name} {'x'.join(map(str, shape))}", ()
    except (IndexError, AttributeError, TypeError, ZeroDivisionError):
        return name, ()
