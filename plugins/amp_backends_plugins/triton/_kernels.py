"""The Triton kernels and their launch layout.

Layout: for one (device, dtype) group, every dense gradient is cut into blocks of
``BLOCK`` elements. A block table holds, per block, its start as an element offset from
one base pointer (the first gradient) and its length. One launch runs one program per
block, so the number of launches is fixed however many tensors there are. Offsets from a
base pointer are plain pointer arithmetic (no pointer loaded from memory), which
Triton's interpreter runs too, so CI tests the same kernels the GPU runs.

bf16 is moved as int16 bit patterns and widened/rounded with integer operations
(round to nearest even, NaN kept quiet), exactly as torch converts.

Non-dense gradients (strided slices) go through torch's ops instead; transposed and
other permuted-dense layouts are handled in place.
"""

# No ``from __future__ import annotations`` here: Triton 3.0 (the oldest release supported)
# recognises ``tl.constexpr`` parameters only from evaluated annotations.
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Optional

import torch
import triton
import triton.language as tl

from amp_backends.kernels import TORCH_KERNEL, add_sum_of_squares

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
#: Elements per program: big enough to stream on a GPU, small in the interpreter so tests span blocks.
BLOCK = 512 if INTERPRET else 4096
NUM_WARPS = 8

_TABLES: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
_TABLE_CACHE_SIZE = 16


@triton.jit
def _grad_kernel(
    base,
    block_offsets,
    block_lengths,
    inv_scale_ptr,
    found_inf_ptr,
    partial_ptr,
    BLOCK: tl.constexpr,
    BF16: tl.constexpr,
    SCALE: tl.constexpr,
    WRITE: tl.constexpr,
    NORM: tl.constexpr,
):
    pid = tl.program_id(0)
    start = tl.load(block_offsets + pid)
    length = tl.load(block_lengths + pid)
    idx = tl.arange(0, BLOCK)
    mask = idx < length
    ptrs = base + start + idx
    if BF16:
        bits = tl.load(ptrs, mask=mask, other=0)
        x = ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    bad = (x != x) | (tl.abs(x) == float("inf"))
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    if n_bad > 0:  # a branch, not a masked scalar store: Triton 3.0's interpreter ignores that mask
        tl.store(found_inf_ptr, 1.0)
    if SCALE:
        y = x * tl.load(inv_scale_ptr)
    else:
        y = x
    if NORM:
        tl.store(partial_ptr + pid, tl.sum(y * y, axis=0))
    if WRITE:
        if BF16:
            u = y.to(tl.uint32, bitcast=True)
            rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            rounded = tl.where(y != y, 0x7FC0, rounded)
            tl.store(ptrs, rounded.to(tl.int16), mask=mask)
        else:
            tl.store(ptrs, y.to(base.dtype.element_ty), mask=mask)


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers a gap-free stretch of memory (contiguous in some dim order)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _block_table(
    ptrs: tuple[int, ...], numels: tuple[int, ...], itemsize: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device, itemsize, BLOCK, ptrs, numels)
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    offsets = torch.tensor([(p - ptrs[0]) // itemsize for p in ptrs], dtype=torch.int64)
    sizes = torch.tensor(numels, dtype=torch.int64)
    blocks = (sizes + BLOCK - 1) // BLOCK
    owner = torch.repeat_interleave(torch.arange(len(ptrs)), blocks)
    first = torch.cumsum(blocks, 0) - blocks
    within = torch.arange(int(blocks.sum())) - first[owner]
    starts = offsets[owner] + within * BLOCK
    lengths = torch.clamp(sizes[owner] - within * BLOCK, max=BLOCK).to(torch.int32)
    table = (starts.to(device, non_blocking=True), lengths.to(device, non_blocking=True))
    _TABLES[key] = table
    if len(_TABLES) > _TABLE_CACHE_SIZE:
        _TABLES.popitem(last=False)
    return table


def _split(grads: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int], list[int], list[torch.Tensor], list[torch.Tensor]]:
    """One pass: dense gradients with their addresses and sizes, strided ones, and tensor
    subclasses (DTensor shards of FSDP2, whose ``data_ptr()`` is 0); empty ones dropped."""
    dense, ptrs, numels, strided, wrapped = [], [], [], [], []
    for g in grads:
        if type(g) is not torch.Tensor:
            wrapped.append(g)
            continue
        n = g.numel()
        if n == 0:
            continue
        ptr = g.data_ptr()
        if is_dense(g) and ptr % g.element_size() == 0:
            dense.append(g)
            ptrs.append(ptr)
            numels.append(n)
        else:
            strided.append(g)
    return dense, ptrs, numels, strided, wrapped


def _fallback(
    grads: list[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: Optional[torch.Tensor],
    write: bool,
    norm_sq: Optional[torch.Tensor],
) -> None:
    if not grads:
        return
    if write:
        assert inv_scale is not None
        TORCH_KERNEL.unscale_and_check_(grads, found_inf, inv_scale)
    else:
        for g in grads:  # read-only: never write a gradient we were asked only to check
            found_inf.masked_fill_(~torch.isfinite(g).all(), 1.0)
    if norm_sq is not None:
        add_sum_of_squares(grads, norm_sq)


def _torch_ops(
    grads: list[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: Optional[torch.Tensor],
    norm_sq: Optional[torch.Tensor],
) -> None:
    """Tensor subclasses go to torch's op, whose dispatch (DTensor's) handles them and
    reduces found_inf over the mesh; a read-only check is torch's unscale by 1."""
    if not grads:
        return
    if inv_scale is None:
        TORCH_KERNEL.check_(grads, found_inf)
    else:
        TORCH_KERNEL.unscale_and_check_(grads, found_inf, inv_scale)
    if norm_sq is not None:
        add_sum_of_squares(grads, norm_sq)


def run(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: Optional[torch.Tensor],
    write: bool,
    norm_sq: Optional[torch.Tensor],
) -> None:
    """One launch over every dense gradient of one (device, dtype) group; torch for the rest."""
    dense, ptrs, numels, other, wrapped = _split(grads)
    _torch_ops(wrapped, found_inf, inv_scale if write else None, norm_sq)
    _fallback(other, found_inf, inv_scale, write, norm_sq)
    if not dense:
        return
    dtype = dense[0].dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        _fallback(dense, found_inf, inv_scale, write, norm_sq)
        return
    bf16 = dtype == torch.bfloat16
    base = dense[0].view(torch.int16) if bf16 else dense[0]  # bf16 moves as int16 bits: same address, same count
    starts, lengths = _block_table(tuple(ptrs), tuple(numels), base.element_size(), base.device)
    n_blocks = starts.numel()
    partial = torch.empty(n_blocks, dtype=torch.float32, device=base.device) if norm_sq is not None else found_inf
    _grad_kernel[(n_blocks,)](
        base,
        starts,
        lengths,
        inv_scale if inv_scale is not None else found_inf,
        found_inf,
        partial,
        BLOCK=BLOCK,
        BF16=bf16,
        SCALE=inv_scale is not None,
        WRITE=write,
        NORM=norm_sq is not None,
        num_warps=NUM_WARPS,
    )
    if norm_sq is not None:
        norm_sq.add_(partial.sum())
