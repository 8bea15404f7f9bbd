"""An LM head and its cross-entropy fused, a block of rows at a time, with the gradients made in the forward.

Under autocast the head's logits are low precision, and cross-entropy (an op every device's autocast
runs in float32) makes a float32 copy and saves its float32 log-softmax: for GPT-2 at 8,192 tokens
those are 1.5 GiB each, the largest tensors of the step. :func:`linear_cross_entropy` never holds more
than one block of rows' logits. For each block, in the forward pass, it computes the logits (the head's
matmul, in the autocast dtype as ``F.linear`` would run it), their float32 softmax, the loss and the
gradient of the loss with respect to those logits, and folds that gradient at once into the head
input's and weight's (and bias's) gradients: two more matmuls, the ones the plain head's backward does.
Three matmuls per block, as the plain head's forward and backward; nothing is recomputed. The backward
only multiplies the stored gradients by the incoming gradient (a scalar: the loss is one number), so
it is exact for any scalar grad_output (a loss scale, a weight on this loss); it has no second
derivative, and differentiating through it twice (``create_graph=True`` then a backward through the
head's gradients) raises.

Numerics: the softmax, the loss and each block's logit gradient in float32; the logit gradient rounded
to the compute dtype for the two gradient matmuls (as the plain path rounds it), the input's gradient
rounded once to the compute dtype (as the plain matmul's output is), the weight's and bias's gradients
summed over blocks in float32. The mean's division and the incoming gradient are applied in float32
after the matmuls. Under float16, whose range the plain path fills with the loss scale before its
matmuls, the block's logit gradient is multiplied by a power of two chosen on the device from bounds of
the two products (:func:`_float16_range`) before it is rounded to float16, and the matmuls' outputs are
divided by it again in float32: all three matmuls run in float16, as the plain head's do, none
overflows, and small gradients are no more lost than under the loss scale. The gradients equal the
plain path's to a few of the compute dtype's ulps and are as close to float64 (tests state the
bounds).

Block size (:func:`chunk_rows`): a block's working set, ``V * (4 + 2 * itemsize(compute))`` bytes a row
(its float32 logits turned gradient, and the low-precision logits and gradient), is kept within 1/16 of
the device's free memory (``torch.accelerator.get_memory_info``, or the device module's
``mem_get_info``), at most 512 MiB; on a CPU, or a device that does not say, 64 MiB. GPT-2 (V = 50,257,
bfloat16) on a CPU: 166 rows a block; on an H100 with 70 GiB free: 1,335.

What the forward keeps for the backward: the input's gradient (the input's shape and dtype), the
weight's (the weight's dtype) and the bias's, each in float32 where its dtype is float16 (the loss scale
is applied only in the backward); nothing of the logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..torch_private import DelayedError

__all__ = ["BLOCK_BYTES", "block_bytes", "chunk_rows", "linear_cross_entropy"]

#: A block's working set on a CPU (or a device that does not say how much memory is free).
BLOCK_BYTES = 64 * 2**20
#: On a device that says: at most this share of its free memory...
FREE_SHARE = 16
#: ... and at most this many bytes.
BLOCK_BYTES_MAX = 512 * 2**20

_DOUBLE_BACKWARD = ("linear_cross_entropy computes the head's gradients in the forward pass and has no second "
                    "derivative: for create_graph=True through the LM head (a gradient penalty), compute the logits "
                    "whole (F.cross_entropy(F.linear(hidden, weight).float(), target); memory_lean(..., lm_head=None))")


def _free_bytes(device: torch.device) -> int | None:
    """The device's free memory as the device says it, plus what torch's caching allocator holds unused
    (the driver counts that as taken), or None (a CPU, or no way to ask)."""
    if device.type in ("cpu", "meta"):
        return None
    try:
        acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        if acc is not None and acc.type == device.type and hasattr(torch.accelerator, "get_memory_info"):
            free = int(torch.accelerator.get_memory_info(device)[0])
        else:
            info = getattr(getattr(torch, device.type, None), "mem_get_info", None)
            if info is None:
                return None
            free = int(info(device)[0])
    except (RuntimeError, TypeError, ValueError, AttributeError):
        return None
    return free + _cached_bytes(device)


def _cached_bytes(device: torch.device) -> int:
    """Bytes torch's caching allocator holds for ``device`` but no tensor uses (0 where it cannot say)."""
    module = getattr(torch, device.type, None)
    try:
        return max(0, int(module.memory_reserved(device)) - int(module.memory_allocated(device)))  # type: ignore[union-attr]  # absent: said below
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return 0


def block_bytes(device: torch.device | str | None = None) -> int:
    """Bytes one block's working set may take on ``device`` (see the module docstring)."""
    free = _free_bytes(torch.device(device if device is not None else "cpu"))
    if free is None:
        return BLOCK_BYTES
    return max(2**20, min(free // FREE_SHARE, BLOCK_BYTES_MAX))


def chunk_rows(vocab: int, device: torch.device | str | None = None, compute: torch.dtype = torch.float32) -> int:
    """Rows per block for a ``vocab``-class head computing in ``compute`` on ``device``: the block's
    working set (``vocab * (4 + 2 * itemsize)`` bytes a row) within :func:`block_bytes`."""
    per_row = vocab * (4 + 2 * torch.empty((), dtype=compute).element_size())
    return max(1, block_bytes(device) // per_row)


def _scaled(t: torch.Tensor | None, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``t * scale`` computed in float32, in ``dtype`` (a new tensor; ``t`` is left as it is)."""
    if t is None:
        return None
    if scale is None:
        return t.to(dtype)
    if t.dtype in (torch.float32, torch.float64):
        return (t * scale).to(dtype)
    return (t.float() * scale).to(dtype)


def _held(dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient is held in from the forward to the backward: float32 for float16 (whose range
    would lose the small gradients a loss scale, applied only in the backward, exists to keep), else its own."""
    return torch.float32 if dtype == torch.float16 else dtype


#: float16 gradient matmuls are kept within this bound (half float16's largest finite value, a margin for rounding).
FLOAT16_TOP = 2.0**15


def _float16_range(g: torch.Tensor, h: torch.Tensor, wmax: torch.Tensor | None) -> torch.Tensor:
    """The power of two (a 0-dim float32 tensor, no host read) by which a block's float32 logit gradient ``g``
    is multiplied before its float16 matmuls: the largest that keeps ``g``, ``g.t() @ h`` and ``g @ w`` within
    :data:`FLOAT16_TOP`, by the bounds ``|sum_r g[r,k] h[r,j]| <= sum_r max|g[r]| max|h[r]|`` and
    ``|sum_k g[r,k] w[k,j]| <= sum_k |g[r,k]| max|w|``. The products' small values stay above float16's
    normal range as far as the large ones allow, and nothing overflows; the matmuls' outputs are divided
    by it again in float32 (exact: a power of two)."""
    inf = float("inf")
    rows_max = torch.linalg.vector_norm(g, inf, dim=1)
    bound = torch.stack([
        (rows_max * torch.linalg.vector_norm(h, inf, dim=1, dtype=g.dtype)).sum(),
        torch.linalg.vector_norm(g, 1, dim=1).amax() * (wmax if wmax is not None else 0.0),
        rows_max.amax(),
    ]).amax()
    return torch.exp2(torch.floor(torch.log2(FLOAT16_TOP / bound)).clamp(-64.0, 64.0))


def _blocks(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor, cw: torch.Tensor | None,
            compute: torch.dtype, smoothing: float, ignore_index: int, reduction: str, rows: int,
            need: tuple[bool, bool, bool]) -> tuple[torch.Tensor, Any, Any, Any]:
    """The summed (or mean) loss and, where ``need`` says, the gradients of (h, w, b) for a grad_output of 1."""
    n, vocab = h.shape[0], w.shape[0]
    acc = torch.float64 if compute == torch.float64 else torch.float32  # the softmax's and the sums' dtype
    hc, wc = h.to(compute), w.to(compute)
    bc = None if b is None else b.to(compute)
    valid = y != ignore_index
    ysafe = torch.where(valid, y, 0).unsqueeze(1)
    cw32 = None if cw is None else cw.to(acc)
    wy = valid.to(acc) if cw32 is None else torch.where(valid, cw32[ysafe.squeeze(1)], 0.0)
    wsum = float(vocab) if cw32 is None else cw32.sum()
    inv = None
    if reduction == "mean":
        den = wy.sum()
        # torch's gradients of an all-ignored mean are 0 (its loss nan); of a mean whose targets' class weights
        # are all 0, nan (0/0), which a loss scaler sees as an overflow
        inv = torch.where(den != 0, 1.0 / den, torch.where(valid.any(), float("nan"), 0.0))
    total = torch.zeros((), dtype=acc, device=h.device)  # the targets' term, and the smoothing's (apart, as torch divides each)
    smooth = torch.zeros((), dtype=acc, device=h.device)
    gh = torch.empty(h.shape, dtype=_held(h.dtype), device=h.device) if need[0] else None
    gw = torch.zeros(w.shape, dtype=acc, device=w.device) if need[1] else None
    gb = torch.zeros(vocab, dtype=acc, device=w.device) if need[2] and b is not None else None
    grads = gh is not None or gw is not None or gb is not None
    wmax = torch.linalg.vector_norm(wc, float("inf"), dtype=acc) if grads and compute == torch.float16 else None
    z = g = gl = None
    for s in range(0, n, rows):
        e = min(s + rows, n)
        z = g = gl = None  # the last block's logits go before this one's are made: one block alive
        z = F.linear(hc[s:e], wc, bc).to(acc)  # matmul 1; the float32 logits, worked on in place
        yb, vb, wyb = ysafe[s:e], valid[s:e], wy[s:e]
        m = z.amax(1, keepdim=True)
        z.sub_(m)  # shifted: every term of the smoothing sum below is >= 0, no cancellation
        zy = z.gather(1, yb).squeeze(1)
        zs = None
        if smoothing:
            zs = z.sum(1) if cw32 is None else (z * cw32).sum(1)
        z.exp_()
        sumexp = z.sum(1, keepdim=True)
        lse = sumexp.log().squeeze(1)
        total += torch.where(vb, wyb * (lse - zy), 0.0).sum()
        if smoothing:
            assert zs is not None
            smooth += torch.where(vb, lse * wsum - zs, 0.0).sum()
        if not grads:
            continue
        # d row / d z_k = p_k ((1-e) w_y + e W / V) - (1-e) w_y [k = y] - (e / V) w_k, zero on ignored rows
        g = z.div_(sumexp)
        alpha = (1.0 - smoothing) * wyb + (smoothing / vocab) * wsum if smoothing else wyb
        g.mul_(torch.where(vb, alpha, 0.0).unsqueeze(1))
        g.scatter_add_(1, yb, torch.where(vb, -(1.0 - smoothing) * wyb, 0.0).unsqueeze(1))
        if smoothing:
            gamma = (vb.to(acc) * (smoothing / vocab)).unsqueeze(1)
            if cw32 is None:
                g.sub_(gamma)
            else:
                g.addcmul_(gamma, cw32.unsqueeze(0), value=-1.0)
        ranged = None  # float16: the power of two the logit gradient is multiplied by to fit float16's range
        if compute == torch.float16:
            if gb is not None:
                gb.add_(g.sum(0))
            ranged = _float16_range(g, hc[s:e], wmax)
            g.mul_(ranged)
        gl = g.to(compute)
        if gb is not None and ranged is None:
            gb.add_(gl.sum(0, dtype=acc))
        if gh is not None:  # matmul 2
            gh[s:e] = _scaled(gl @ wc, inv if ranged is None else (ranged.reciprocal() if inv is None else inv / ranged),
                              gh.dtype)
        if gw is not None:
            if compute == acc:
                gw.addmm_(gl.t(), hc[s:e])  # matmul 3
            elif ranged is not None:
                gw.addcmul_(gl.t() @ hc[s:e], ranged.reciprocal())  # matmul 3 in float16, its power of two undone
            else:
                gw.add_(gl.t() @ hc[s:e])  # matmul 3, rounded to bfloat16 as the plain one is
    if inv is not None:  # as torch divides: over no weight nan (0/0), over weights summing to 0 an infinity
        den = wy.sum()
        total, smooth = total / den, smooth / den
    loss = (1.0 - smoothing) * total + (smoothing / vocab) * smooth if smoothing else total
    return (loss, gh, _scaled(gw, inv, _held(w.dtype)) if gw is not None else None,
            _scaled(gb, inv, _held(b.dtype)) if gb is not None and b is not None else None)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor,
                cw: torch.Tensor | None, compute: torch.dtype, smoothing: float, ignore_index: int, reduction: str,
                rows: int, out_dtype: torch.dtype) -> torch.Tensor:
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        loss, gh, gw, gb = _blocks(h, w, b, y, cw, compute, smoothing, ignore_index, reduction, rows, need)
        ctx.save_for_backward(gh, gw, gb)
        ctx.dtypes = (h.dtype, w.dtype, None if b is None else b.dtype)
        return loss.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        gh, gw, gb = ctx.saved_tensors
        with torch.no_grad():
            out = [None if t is None else _scaled(t, grad, dtype) for t, dtype in zip((gh, gw, gb), ctx.dtypes)]
        if torch.is_grad_enabled() and any(t is not None for t in out):
            # create_graph=True: these gradients have no graph back to the head; differentiating them raises
            held = [t for t in out if t is not None]
            fake = [t.detach().requires_grad_(True) for t in held]
            errored = iter(DelayedError(_DOUBLE_BACKWARD, len(fake))(*fake))
            out = [None if t is None else next(errored) for t in out]
        return (*out, None, None, None, None, None, None, None, None)


def _output_dtype(device_type: str, logits: torch.dtype, upcast: bool) -> torch.dtype:
    """The dtype ``F.cross_entropy`` returns for these logits: float32 where upcast or where autocast is on
    (every device's autocast runs the loss in float32), else the logits' own."""
    if upcast or torch.is_autocast_enabled(device_type) or logits == torch.float64:
        return torch.float64 if logits == torch.float64 else torch.float32
    return logits


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, *, ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, class_weight: torch.Tensor | None = None, upcast: bool = True,
                         rows: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), target, weight=class_weight,
    ignore_index=..., reduction=..., label_smoothing=...)`` over ``hidden``'s rows (all dimensions but
    the last flattened), a block of ``rows`` at a time (default :func:`chunk_rows`), never holding the
    whole logits; the gradients are made in the forward pass (see the module docstring). The head runs
    in the autocast dtype where autocast is on for ``hidden``'s device, as ``F.linear`` would; the
    softmax in float32. ``reduction``: ``'mean'`` or ``'sum'`` (``'none'`` is refused: per-row losses
    need the rows' incoming gradients inside the weight's gradient, which is summed before they exist).
    ``upcast=False``: the loss in the logits' dtype where torch would return it so (no autocast)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy(reduction={reduction!r}): 'mean' or 'sum'. Per-row losses ('none') "
                         "cannot be fused (the weight's gradient is summed over rows in the forward): compute the logits "
                         "whole, F.cross_entropy(F.linear(hidden, weight, bias).float(), target, reduction='none')")
    if target.is_floating_point() or target.is_complex():
        raise ValueError("linear_cross_entropy takes class indices as target (an integer tensor); for class "
                         "probabilities compute the logits whole and call F.cross_entropy")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"linear_cross_entropy(label_smoothing={label_smoothing}): a number in [0, 1]")
    if class_weight is not None and class_weight.shape != (weight.shape[0],):
        raise ValueError(f"linear_cross_entropy(class_weight=...): one weight per class ({weight.shape[0]}), got "
                         f"shape {tuple(class_weight.shape)}")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear_cross_entropy: hidden states of width {hidden.shape[-1]} and a head weight of "
                         f"shape {tuple(weight.shape)} (the head takes width {weight.shape[-1]})")
    device_type = hidden.device.type
    autocast = torch.is_autocast_enabled(device_type)
    compute = torch.get_autocast_dtype(device_type) if autocast else hidden.dtype
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1).long()
    if t.shape[0] != h.shape[0]:
        raise ValueError(f"linear_cross_entropy: {h.shape[0]} rows of hidden states and {t.shape[0]} targets")
    out_dtype = _output_dtype(device_type, compute, upcast)
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise ValueError(f"linear_cross_entropy(rows={rows!r}): a whole number of rows per block >= 1, or None "
                         "for the size the device's free memory allows")
    rows = rows or chunk_rows(weight.shape[0], hidden.device, compute)
    args = (class_weight, compute, float(label_smoothing), ignore_index, reduction, rows)
    with torch.autocast(device_type, enabled=False):
        if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (h, weight, bias)):
            return _blocks(h, weight, bias, t, *args, need=(False, False, False))[0].to(out_dtype)  # no gradient work
        return _FusedLinearCrossEntropy.apply(h, weight, bias, t, *args, out_dtype)
