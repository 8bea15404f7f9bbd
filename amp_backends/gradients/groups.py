"""The flat gradient buffer a kernel works on: :class:`FlatGroup` and its layout.

The data type shared by the arena (:mod:`amp_backends.gradients.arena`, which builds groups) and the
kernels (which run on them); it depends on nothing else of the package.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch

__all__ = ["ALIGN_BYTES", "ARENA_ATTR", "FP16_PARAMS", "FlatGroup", "GradGroup", "TensorGroup",
           "group_by_device_and_dtype", "layout", "slot_strides", "views_of"]

#: Every gradient starts at a multiple of this many bytes from its buffer's start (128-bit loads).
ALIGN_BYTES = 16
#: The optimizer attribute that holds its flat gradient arena (:func:`amp_backends.flat_grads`).
ARENA_ATTR = "_amp_backends_flat_grads"
FP16_PARAMS = (
    "Attempting to unscale FP16 gradients: the parameters themselves are float16. Keep parameters "
    "in float32 and let autocast lower the compute, or use bf16 without a scaler."
)


@dataclass(eq=False)
class TensorGroup:
    """Gradients that share a device and a dtype, as a list (any strides, sparse values included)."""

    device: torch.device
    dtype: torch.dtype
    tensors: list[torch.Tensor]

    def gradients(self) -> list[torch.Tensor]:
        """The gradients, for a norm."""
        return self.tensors


@dataclass(eq=False)
class FlatGroup:
    """The gradients of one (device, dtype): a parameter that holds a gradient holds a view of
    ``buffer[offsets[i]:offsets[i] + numels[i]]`` as ``params[i].grad``. Every other element of the
    buffer (the slots of parameters without a gradient, the gaps between slots) is zero whenever a
    kernel runs on it: an op that multiplies the whole buffer by a factor that may be inf or NaN
    sets :attr:`dirty`, and the arena zeroes those elements again before it hands the buffer out."""

    device: torch.device
    dtype: torch.dtype
    buffer: torch.Tensor
    params: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    #: each slot's strides: its parameter's where that is dense (channels_last, a transposed weight), as
    #: torch's AccumulateGrad lays a gradient out; () : contiguous, every slot
    strides: tuple[tuple[int, ...], ...] = ()
    #: Kernels keep what they derive from the layout here (Triton: its block table), built once.
    cache: dict[Any, Any] = field(default_factory=dict)
    #: Whether the gaps and free slots may hold non-zero values: a whole-buffer multiply by a factor
    #: that may have been inf or NaN (0 * inf is NaN) ran since they were last zeroed.
    dirty: bool = False

    def gradients(self) -> list[torch.Tensor]:
        """The gradients the parameters hold (:meth:`views`), for a norm."""
        return self.views()

    def views(self) -> list[torch.Tensor]:
        """The gradients the parameters hold, in slot order (parameters without one are left out,
        as the per-tensor path leaves them out)."""
        return [g for g in map(_grad_of, self.params) if g is not None]

    def view(self, i: int) -> torch.Tensor:
        """A new view of slot ``i``, shaped as its parameter."""
        return views_of(self.buffer, self.offsets[i:i + 1], self.shapes[i:i + 1], self.strides[i:i + 1])[0]

    def stride(self, i: int) -> tuple[int, ...]:
        """Slot ``i``'s strides."""
        return self.strides[i] if self.strides else _contiguous_strides(self.shapes[i])


#: One (device, dtype) group of gradients as the op takes it: an arena buffer, or a list.
GradGroup = Union[FlatGroup, TensorGroup]


def group_by_device_and_dtype(tensors: Iterable[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """Split tensors into lists that share a device and a dtype, keeping their order."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    return groups


def _grad_of(t: torch.Tensor) -> torch.Tensor | None:
    return t.grad


def _aligned(n: int, itemsize: int) -> int:
    step = max(ALIGN_BYTES // itemsize, 1)
    return -(-n // step) * step


def layout(numels: Sequence[int], itemsize: int) -> tuple[list[int], int]:
    """Where each of ``numels`` elements starts in a flat buffer (every start 16-byte aligned),
    and the buffer's length."""
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total = _aligned(total + n, itemsize)
    return offsets, total


def views_of(buffer: torch.Tensor, offsets: Sequence[int], shapes: Sequence[torch.Size],
             strides: Sequence[tuple[int, ...]] = ()) -> list[torch.Tensor]:
    """Views of ``buffer`` at ``offsets`` with ``shapes`` and ``strides`` (contiguous where not given; one
    ``as_strided`` each)."""
    given = list(strides) or [_contiguous_strides(shape) for shape in shapes]
    return [buffer.as_strided(shape, stride, off) for off, shape, stride in zip(offsets, shapes, given)]


def slot_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides torch's AccumulateGrad gives ``t``'s gradient: ``t``'s own where ``t`` is dense and
    non-overlapping (channels_last, a transposed weight), else contiguous ones."""
    contiguous = _contiguous_strides(t.shape)
    if t.is_contiguous():
        return contiguous  # (as torch lays out a contiguous parameter's gradient, whatever its size-1 strides)
    expected = 1
    for d in sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d))):
        if t.size(d) == 1:
            continue
        if t.stride(d) != expected:
            return contiguous
        expected *= t.size(d)
    return tuple(t.stride())


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
