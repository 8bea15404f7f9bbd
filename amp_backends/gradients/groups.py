"""The flat gradient buffer a kernel works on: :class:`FlatGroup` and its layout.

The data type shared by the arena (:mod:`amp_backends.gradients.arena`, which builds groups) and the
kernels (which run on them); it depends on nothing else of the package.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch

__all__ = ["ALIGN_BYTES", "FlatGroup", "GradGroup", "layout", "views_of"]

#: Every gradient starts at a multiple of this many bytes from its buffer's start (128-bit loads).
ALIGN_BYTES = 16


@dataclass(eq=False)
class FlatGroup:
    """The gradients of one (device, dtype): a parameter that holds a gradient holds a view of
    ``buffer[offsets[i]:offsets[i] + numels[i]]`` as ``params[i].grad``. Every other element of the
    buffer (the slots of parameters without a gradient, the gaps between slots) is zero whenever a
    kernel runs on it."""

    device: torch.device
    dtype: torch.dtype
    buffer: torch.Tensor
    params: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    #: Kernels keep what they derive from the layout here (Triton: its block table), built once.
    cache: dict[Any, Any] = field(default_factory=dict)
    #: Whether the gaps may hold non-zero values: a whole-buffer multiply by a factor that may have
    #: been inf or NaN (0 * inf is NaN) ran since they were last zeroed.
    dirty: bool = False

    def views(self) -> list[torch.Tensor]:
        """The gradients the parameters hold, in slot order (parameters without one are left out,
        as the per-tensor path leaves them out)."""
        return [g for g in map(_grad_of, self.params) if g is not None]

    def view(self, i: int) -> torch.Tensor:
        """A new view of slot ``i``, shaped as its parameter."""
        return views_of(self.buffer, self.offsets[i:i + 1], self.shapes[i:i + 1])[0]

    def clear_gaps_(self) -> None:
        """Zero the alignment gaps between views, for an op that reads the whole buffer, where they
        may be :attr:`dirty` (a multiply by inf or NaN, an unscale at scale 0 or a clip by a NaN
        norm, reached them and no ``zero_grad()`` came since); one small op, or none."""
        if not self.dirty:
            return
        self.dirty = False
        gaps = self.cache.get("gaps")
        if gaps is None:
            ends = [o + n for o, n in zip(self.offsets, self.numels)]
            starts = list(self.offsets[1:]) + [self.buffer.numel()]
            index = [i for e, s in zip(ends, starts) for i in range(e, s)]
            gaps = self.cache["gaps"] = torch.tensor(index, dtype=torch.int64, device=self.device)
        if gaps.numel():
            self.buffer.index_fill_(0, gaps, 0)


#: One (device, dtype) group of gradients as a backend op takes it: an arena buffer, or
#: (device, dtype, gradients) found by walking the parameters.
GradGroup = Union[FlatGroup, "tuple[torch.device, torch.dtype, list[torch.Tensor]]"]


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


def views_of(buffer: torch.Tensor, offsets: Sequence[int], shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Contiguous views of ``buffer`` at ``offsets`` with ``shapes`` (one ``as_strided`` each)."""
    return [buffer.as_strided(shape, _contiguous_strides(shape), off) for off, shape in zip(offsets, shapes)]


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
