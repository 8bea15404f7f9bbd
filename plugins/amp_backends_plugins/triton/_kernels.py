"""The Triton kernels and their launch layout.

Layout: for one (device, dtype) group, every dense gradient is cut into blocks of
``TUNING[itemsize].block`` elements (the same bytes for every dtype). A block table holds, per
block, its start as an element offset from one base pointer (the 16-byte boundary at or before
the first gradient) and its length; a gradient that does not start on a 16-byte boundary gets a
short head block up to one, so that its full blocks are vectorized. One launch runs one program per
block, so the number of launches is fixed however many tensors there are. Offsets from a
base pointer are plain pointer arithmetic (no pointer loaded from memory), which
Triton's interpreter runs too, so CI tests the same kernels the GPU runs.

bf16 is moved as int16 bit patterns and widened/rounded with integer operations
(round to nearest even, NaN kept quiet), exactly as torch converts.

Non-dense gradients (strided slices) go through torch's ops instead; transposed and
other permuted-dense layouts are handled in place.

The inputs are checked as torch's op checks them (``check_inputs``, ``one_device``): ``found_inf`` and
``inv_scale`` one-element float32 tensors on the gradients' device, every gradient on one device. A
list mixing dtypes runs as one list per dtype: a launch reads every element at its group's width.
"""

# No ``from __future__ import annotations`` here: Triton 3.0 (the oldest release supported)
# recognises ``tl.constexpr`` parameters only from evaluated annotations.
import operator
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton
import triton.language as tl

from amp_backends.gradients.groups import FlatGroup
from amp_backends.gradients.kernel import TORCH_KERNEL, add_sum_of_squares, through_float32
from amp_backends.torch_private import amp_foreach_non_finite_check_and_unscale_

from . import TritonKernel, check_inputs, one_device

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class Tuning:
    """One dtype's launch shape: elements per program and warps per program."""

    block: int
    num_warps: int


#: Launch shape per element size (bytes). Every dtype moves the same bytes per program (8 KiB read
#: on a GPU): a 16-bit block is twice as many elements as an fp32 one, so a 16-bit program carries
#: as many bytes in flight and pays its fixed cost (block-table read, found_inf reduction) over as
#: many bytes. Chosen by ``bench/unscale.py --sweep`` on an NVIDIA H200 (torch 2.11, Triton 3.6,
#: 2026-11-27; bench/RESULTS.md): the best worst case per element size of 9 shapes each. Small in
#: the interpreter, so that tests span blocks. Assign an entry to try another (tables are cached per
#: block size).
TUNING: dict[int, Tuning] = (
    {4: Tuning(512, 8), 2: Tuning(1024, 8)} if INTERPRET else {4: Tuning(2048, 8), 2: Tuning(4096, 4)}
)
#: The fp32 block (elements); 16-bit dtypes use ``TUNING[2].block``.
BLOCK = TUNING[4].block
#: The default warps per program (every dtype).
NUM_WARPS = TUNING[4].num_warps
#: Bytes a vectorized access moves: a block whose first element sits on this boundary (counted from
#: a base pointer on it) loads and stores 128 bits at a time.
VEC_BYTES = 16
#: NVIDIA: a register budget for ptxas (the ``.maxnreg`` of the PTX). Without one, ptxas behind
#: Triton 3.8 (``--regAllocOptLevel=2``) caps the fp16 check+norm kernel at 32 registers and
#: spills one to the stack; with it no variant spills (the AOT test compiles every one).
MAXNREG = 128
#: Launch options per device kind: ``maxnreg`` is an NVIDIA option (ROCm's backend has none).
_NVIDIA_OPTIONS = {"maxnreg": MAXNREG} if not getattr(torch.version, "hip", None) else {}

#: Gradient dtypes the kernel handles (declared once, on the kernel); others go to torch's ops.
KERNEL_DTYPES = TritonKernel.handles_dtypes

#: Block tables by the gradients' addresses (the hit every step where they stay put) and by their
#: layout relative to the first (offsets and sizes: gradients freed and allocated again at other
#: addresses in the same arrangement, as ``zero_grad(set_to_none=True)`` leaves them, reuse the
#: table instead of building and copying a new one).
_TABLES: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
_LAYOUTS: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
#: Blocks cut by the gradients' sizes and heads (:func:`_cuts`): a new arrangement of the same
#: gradients, which the caching allocator can make every step, is placed from the cut already made.
_CUTS: OrderedDict[tuple, tuple[torch.Tensor, ...]] = OrderedDict()
_TABLE_CACHE_SIZE = 16
#: Lists up to this long are summed on every call to pick torch's op or Triton's (under 3 us).
_SCAN_UP_TO = 64
_TOTALS: dict[tuple[int, torch.dtype, int, int], int] = {}
_DTYPE = operator.attrgetter("dtype")


@triton.jit
def _block_op(
    ptrs,
    mask,
    inv_scale_ptr,
    found_inf_ptr,
    partial_ptr,
    pid,
    BF16: tl.constexpr,
    SCALE: tl.constexpr,
    WRITE: tl.constexpr,
    NORM: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Unscale/check/measure one block; ``MASKED`` False: every lane is in bounds (no mask, so
    the compiler may move 16 bytes per access where the start is aligned).

    The block's values are written back before the block-wide reductions (found_inf, the sum of
    squares): a reduction across warps is a barrier, and values still to be stored after it would
    stay in registers across it. Stored first, a thread keeps only its loaded bits and per-element
    flags, so a 16-bit block holds as few registers per byte as an fp32 one and as many programs fit
    on a multiprocessor."""
    if MASKED:
        raw = tl.load(ptrs, mask=mask, other=0)
    else:
        raw = tl.load(ptrs)
    if BF16:
        x = ((raw.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        x = raw.to(tl.float32)
    if SCALE:
        y = x * tl.load(inv_scale_ptr)
    else:
        y = x
    if WRITE:
        if BF16:
            u = y.to(tl.uint32, bitcast=True)
            rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            rounded = tl.where(y != y, 0x7FC0, rounded)
            if MASKED:
                tl.store(ptrs, rounded.to(tl.int16), mask=mask)
            else:
                tl.store(ptrs, rounded.to(tl.int16))
        else:
            if MASKED:
                tl.store(ptrs, y.to(ptrs.dtype.element_ty), mask=mask)
            else:
                tl.store(ptrs, y.to(ptrs.dtype.element_ty))
    if NORM:
        sq = y * y
        if MASKED:  # masked lanes hold 0 * inv_scale: NaN when the scale has underflowed to 0
            sq = tl.where(mask, sq, 0.0)
        tl.store(partial_ptr + pid, tl.sum(sq, axis=0))
    # inf or NaN: every exponent bit set (fp16, fp32: tested on the loaded bits, which a thread keeps
    # in fewer registers than their fp32 widening)
    if BF16:  # widened by a shift: a float compare holds the fewest registers
        bad = (x != x) | (tl.abs(x) == float("inf"))
    elif raw.dtype == tl.float16:
        bad = (raw.to(tl.int16, bitcast=True) & 0x7C00) == 0x7C00
    else:
        bad = (raw.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    if n_bad > 0:  # a branch, not a masked scalar store: Triton 3.0's interpreter ignores that mask
        tl.store(found_inf_ptr, 1.0)


@triton.jit
def _grad_kernel(
    base,
    block_offsets,
    block_lengths,
    inv_scale_ptr,
    found_inf_ptr,
    partial_ptr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    ALIGNED: tl.constexpr,
    BF16: tl.constexpr,
    SCALE: tl.constexpr,
    WRITE: tl.constexpr,
    NORM: tl.constexpr,
):
    """One program per block of the table. ``ALIGNED``: ``base`` is 16-byte aligned, so a full
    block whose start is a multiple of ``VEC`` elements takes the unmasked, vectorized path."""
    pid = tl.program_id(0)
    start = tl.load(block_offsets + pid)
    length = tl.load(block_lengths + pid)
    idx = tl.arange(0, BLOCK)
    if ALIGNED:
        if (length == BLOCK) & (start % VEC == 0):
            start = tl.multiple_of(start, VEC)
            _block_op(base + start + idx, None, inv_scale_ptr, found_inf_ptr, partial_ptr, pid,
                      BF16, SCALE, WRITE, NORM, False)
        else:
            _block_op(base + start + idx, idx < length, inv_scale_ptr, found_inf_ptr, partial_ptr, pid,
                      BF16, SCALE, WRITE, NORM, True)
    else:
        _block_op(base + start + idx, idx < length, inv_scale_ptr, found_inf_ptr, partial_ptr, pid,
                  BF16, SCALE, WRITE, NORM, True)


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


def tuning(itemsize: int) -> Tuning:
    """The launch shape for elements of ``itemsize`` bytes."""
    return TUNING[itemsize]


def _table(offsets: Sequence[int], numels: Sequence[int], device: torch.device, block: int,
           vec: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of at most ``block`` elements: its start (elements from the base) and its length.

    A tensor whose first element is off a ``vec``-element boundary of the base (a view into a
    bucket, packed after a 37-element bias) gets a head block up to the boundary; the rest is cut
    into blocks from there, so each of its full blocks starts on the boundary and is vectorized.
    A tensor that starts on one (every allocation, every arena slot) is cut from its own start:
    its blocks, partial sums and norm are the same wherever it lives.

    The cut depends on the sizes and heads alone (:func:`_cuts`, cached); placing it at these
    offsets is one copy of one offset per tensor and two small ops on the device, so gradients that
    the allocator puts elsewhere every step cost the host no work per block."""
    numels = tuple(numels)
    heads = tuple(min(-o % vec, n) for o, n in zip(offsets, numels))
    key = (device, block, numels, heads)
    cut = _CUTS.get(key)
    if cut is None:
        cut = _cuts(heads, numels, device, block)
    _remember(_CUTS, key, cut)
    owner, local, lengths = cut
    where = _to_device(torch.tensor(offsets, dtype=torch.int64), device)
    return where.index_select(0, owner).add_(local), lengths


def _cuts(heads: tuple[int, ...], numels: tuple[int, ...], device: torch.device,
          block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block: the tensor it belongs to, its start within that tensor and its length (a head block
    of ``heads[i]`` elements first where that is not 0, then full blocks), on ``device``."""
    head = torch.tensor(heads, dtype=torch.int64)
    sizes = torch.tensor(numels, dtype=torch.int64)
    body = sizes - head
    has_head = (head > 0).to(torch.int64)
    count = has_head + (body + block - 1) // block
    owner = torch.repeat_interleave(torch.arange(len(numels)), count)
    first = torch.cumsum(count, 0) - count
    k = torch.arange(int(count.sum())) - first[owner] - has_head[owner]  # -1: the head block
    in_head = k < 0
    local = torch.where(in_head, 0, head[owner] + k * block)
    lengths = torch.where(in_head, head[owner], torch.clamp(body[owner] - k * block, max=block)).to(torch.int32)
    return _to_device(owner, device), _to_device(local, device), _to_device(lengths, device)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the host) copied to ``device`` without a host sync."""
    if device.type == "cuda":  # from pageable memory CUDA waits for the stream first: a host sync
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _aligned_base(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A view of ``t``'s storage starting at the 16-byte boundary at or before ``t``'s first element,
    and how many elements before it that is; ``(t, 0)`` where ``t`` starts on one or its storage does
    not reach back to one. Launched from it, a misaligned gradient's body takes the vectorized path:
    only addresses of the gradients themselves are ever read or written."""
    shift = (t.data_ptr() % VEC_BYTES) // t.element_size()
    if shift == 0 or t.storage_offset() < shift:
        return t, 0
    return t.as_strided((1,), (1,), t.storage_offset() - shift), shift


def _block_table(
    ptrs: tuple[int, ...], numels: tuple[int, ...], itemsize: int, device: torch.device, block: int, shift: int
) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device, itemsize, block, shift, ptrs, numels)
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    offsets = tuple((p - ptrs[0]) // itemsize + shift for p in ptrs)
    layout = (device, itemsize, block, offsets, numels)
    table = _LAYOUTS.get(layout)
    if table is None:
        table = _table(offsets, numels, device, block, VEC_BYTES // itemsize)
    _remember(_LAYOUTS, layout, table)
    _remember(_TABLES, key, table)
    return table


def _remember(cache: OrderedDict[tuple, Any], key: tuple, table: Any) -> None:
    """Keep ``table`` under ``key``, the least recently used entry dropped past the cache's size."""
    cache[key] = table
    cache.move_to_end(key)
    if len(cache) > _TABLE_CACHE_SIZE:
        cache.popitem(last=False)


def _launch(
    base: torch.Tensor,
    table: tuple[torch.Tensor, torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: Optional[torch.Tensor],
    write: bool,
    norm_sq: Optional[torch.Tensor],
) -> None:
    """One launch over a block table whose offsets count from ``base`` (a dense fp32/fp16/bf16 tensor)."""
    starts, lengths = table
    n_blocks = starts.numel()
    if n_blocks == 0:
        return
    tune = TUNING[base.element_size()]
    bf16 = base.dtype == torch.bfloat16
    if bf16:
        base = base.view(torch.int16)  # bf16 moves as int16 bits: same address, same count
    partial = torch.empty(n_blocks, dtype=torch.float32, device=base.device) if norm_sq is not None else found_inf
    _grad_kernel[(n_blocks,)](
        base,
        starts,
        lengths,
        inv_scale if inv_scale is not None else found_inf,
        found_inf,
        partial,
        BLOCK=tune.block,
        VEC=VEC_BYTES // base.element_size(),
        ALIGNED=base.data_ptr() % VEC_BYTES == 0,
        BF16=bf16,
        SCALE=inv_scale is not None,
        WRITE=write,
        NORM=norm_sq is not None,
        num_warps=tune.num_warps,
        enable_fp_fusion=False,  # y * y + acc rounded twice on every target, as the interpreter does
        **(_NVIDIA_OPTIONS if base.device.type == "cuda" and not INTERPRET else {}),
    )
    if norm_sq is not None:
        norm_sq.add_(partial.sum())


def _split(grads: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int], list[int], list[torch.Tensor], list[torch.Tensor]]:
    """Dense gradients with their addresses and sizes, strided ones, and tensor subclasses
    (DTensor shards of FSDP2, whose ``data_ptr()`` is 0); empty ones dropped.

    The common case (plain, contiguous, non-empty, aligned tensors) is three C-level passes;
    anything else takes the tensor-by-tensor sort."""
    grads = list(grads)
    if all(type(g) is torch.Tensor for g in grads) and all(map(torch.Tensor.is_contiguous, grads)):
        ptrs = [g.data_ptr() for g in grads]
        numels = [g.numel() for g in grads]
        size = grads[0].element_size() if grads else 1
        if 0 not in numels and not any(p % size for p in ptrs):
            return grads, ptrs, numels, [], []
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
    if write:
        assert inv_scale is not None
        return _torch_ops(grads, found_inf, inv_scale, norm_sq)
    if not grads:
        return
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
    if grads[0].dtype == torch.bfloat16:  # CUDA's op has no bf16
        through_float32(TORCH_KERNEL, grads, found_inf, inv_scale)
    else:  # TORCH_KERNEL's op, called as it calls it (no group to build for a list of thousands)
        if inv_scale is None:
            inv_scale = torch.ones((), dtype=torch.float32, device=found_inf.device)
        amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    if norm_sq is not None:
        add_sum_of_squares(grads, norm_sq)


def _elements_below(grads: Sequence[torch.Tensor], limit: int) -> bool:
    """Whether ``grads`` hold fewer than ``limit`` elements in all, at a cost that does not grow with
    their count: a long list's total is remembered by its length and its first and last sizes (a
    training loop hands over the same layout every step). A wrong guess costs only speed: both
    paths give the same results."""
    n = len(grads)
    if n <= _SCAN_UP_TO:
        return sum(map(torch.Tensor.numel, grads)) < limit
    key = (n, grads[0].dtype, grads[0].numel(), grads[-1].numel())
    total = _TOTALS.get(key)
    if total is None:
        total = _TOTALS[key] = sum(map(torch.Tensor.numel, grads))
        if len(_TOTALS) > _TABLE_CACHE_SIZE:
            _TOTALS.pop(next(iter(_TOTALS)))
    return total < limit


def run(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: Optional[torch.Tensor],
    write: bool,
    norm_sq: Optional[torch.Tensor],
    min_elements: int = 0,
) -> None:
    """One launch over every dense gradient of one (device, dtype) group; torch for the rest.

    Below ``min_elements`` elements in all, torch's op runs an unscale or check: there its one
    C++ call costs the host less than Triton's Python launcher, and the data is too small for
    bandwidth to matter. Never a norm: torch's per-tensor norms cost the host far more.

    Inputs torch's op refuses are refused (``check_inputs``, ``one_device``); a list mixing dtypes, which the
    executor never hands over, runs as one list per dtype."""
    if not grads:
        return  # (torch's op checks nothing either)
    check_inputs(grads[0].device, found_inf, inv_scale if write else None)
    if min_elements and norm_sq is None and _elements_below(grads, min_elements):
        # torch's op checks each gradient's device and takes mixed dtypes itself: no pass over them here
        _torch_ops(grads if isinstance(grads, list) else list(grads), found_inf, inv_scale if write else None, norm_sq)
        return
    one_device(grads)
    dtypes = dict.fromkeys(map(_DTYPE, grads))
    if len(dtypes) > 1:
        for dtype in dtypes:
            run([g for g in grads if g.dtype == dtype], found_inf, inv_scale, write, norm_sq, min_elements)
        return
    dense, ptrs, numels, other, wrapped = _split(grads)
    _torch_ops(wrapped, found_inf, inv_scale if write else None, norm_sq)
    _fallback(other, found_inf, inv_scale, write, norm_sq)
    if not dense:
        return
    dtype = dense[0].dtype
    if dtype not in KERNEL_DTYPES:
        _fallback(dense, found_inf, inv_scale, write, norm_sq)
        return
    itemsize = dense[0].element_size()
    base, shift = _aligned_base(dense[0])
    table = _block_table(tuple(ptrs), tuple(numels), itemsize, dense[0].device, TUNING[itemsize].block, shift)
    _launch(base, table, found_inf, inv_scale, write, norm_sq)


def run_flat(group: FlatGroup, found_inf: torch.Tensor, inv_scale: Optional[torch.Tensor],
             norm_sq: Optional[torch.Tensor], min_elements: int = 0) -> None:
    """One launch over an arena group; its block table is made once and kept on the group.
    The blocks cover the views only: the gaps between them are never read. Below
    ``min_elements``, an unscale or check is torch's op on the whole buffer (as :func:`run`)."""
    check_inputs(group.buffer.device, found_inf, inv_scale)
    if group.dtype not in KERNEL_DTYPES:
        _fallback(group.views(), found_inf, inv_scale, inv_scale is not None, norm_sq)
        return
    if min_elements and norm_sq is None and group.buffer.numel() < min_elements:
        _torch_ops([group.buffer], found_inf, inv_scale, None)  # its gaps are zero: the arena keeps them so
        return
    itemsize = group.buffer.element_size()
    block = TUNING[itemsize].block
    base, shift = _aligned_base(group.buffer)
    key = ("triton", block, shift)
    table = group.cache.get(key)
    if table is None:
        offsets = [o + shift for o in group.offsets]
        table = group.cache[key] = _table(offsets, group.numels, group.device, block, VEC_BYTES // itemsize)
    _launch(base, table, found_inf, inv_scale, inv_scale is not None, norm_sq)
