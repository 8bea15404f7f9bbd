"""A kernel checked on the device before it is adopted: its op's results against torch's own.

The registry runs :func:`kernel_self_check` on a plugin's kernel before a backend uses it; a kernel
that raises, misses an inf/NaN, writes when it should only read, or gets a value wrong is not adopted.
"""

from __future__ import annotations

import torch

from ..torch_private import amp_foreach_non_finite_check_and_unscale_
from .groups import FlatGroup, TensorGroup, layout
from .kernel import Kernel

__all__ = ["kernel_self_check"]


def kernel_self_check(kernel: Kernel, device: torch.device) -> str | None:
    """What is wrong with ``kernel`` on ``device`` (None: nothing). Float32 and float16 gradients, contiguous,
    transposed, channels_last and a strided slice: values unscaled by 1/3 bitwise equal to torch's op
    (and nothing between a slice's elements written), inf and NaN found, a found_inf already set kept (an
    earlier group's), read-only ops write nothing, the sum of squares right (every layout counted);
    float32, float16 and bfloat16 gradients longer than any block with the inf/NaN only at their end,
    as a list and as an arena's flat buffer. A kernel that raises is reported, not propagated."""
    threshold = getattr(kernel, "min_elements", None)
    if threshold:  # a kernel that hands small inputs to torch is checked on its own code too
        kernel.min_elements = 0  # type: ignore[attr-defined]  # the Triton kernel's size threshold, lowered for the check
    try:
        return _self_check_problem(kernel, device)
    except Exception as exc:  # noqa: BLE001 - a broken kernel is a finding, not a crash
        return f"raised {type(exc).__name__}: {exc}"
    finally:
        if threshold:
            kernel.min_elements = threshold  # type: ignore[attr-defined]  # the Triton kernel's size threshold, put back


#: The self-check's long gradients: longer than any block of the Triton kernel's (on GPUs 4096 fp32
#: or 8192 16-bit elements, the same bytes; 512 and 1024 interpreted) with an odd tail, so a kernel
#: that looks at only the first block, or only the first 64 elements, misses the inf/NaN put at the end.
_LONG = 2 * 4096 + 3


def _group(grads: list[torch.Tensor]) -> TensorGroup:
    return TensorGroup(grads[0].device, grads[0].dtype, grads)


def _expected(values: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """What an unscale must give: the product computed in float32, cast back (torch's op)."""
    return (values.float() * inv.float().cpu()).to(values.dtype)


def _long_and_flat_problem(kernel: Kernel, device: torch.device, dtype: torch.dtype) -> str | None:
    """Gradients longer than any block, an inf or NaN only at their very end, as a list and on an
    arena's flat buffer: found, and clean values unscaled exactly."""
    name = str(dtype).replace("torch.", "")
    inv = torch.full((), 0.5, dtype=torch.float32, device=device)
    pattern = (torch.arange(_LONG, dtype=torch.float32) % 7 - 3).to(dtype)
    for bad in (None, float("inf"), float("nan")):
        # a list: a short one, then the long one with the bad value last
        host = [pattern[:37].clone(), pattern.clone()]
        if bad is not None:
            host[1][-1] = bad
        grads = [h.to(device, copy=True) for h in host]
        found = torch.zeros((), dtype=torch.float32, device=device)
        kernel.grad_op_(_group(grads), found, inv)
        if bool(found.item()) != (bad is not None):
            return f"{'missed an' if bad is not None else 'reported an'} inf/NaN at element {_LONG - 1} of a {name} gradient"
        if bad is None and not all(torch.equal(g.cpu(), _expected(h, inv)) for g, h in zip(grads, host)):
            return f"unscaled {name} values of a {_LONG}-element gradient differ from torch's"
        # the arena's flat buffer: views 16-byte aligned, zero gaps between them
        sizes = (5, 37, _LONG)
        offsets, total = layout(sizes, torch.empty((), dtype=dtype).element_size())
        buffer = torch.zeros(total, dtype=dtype, device=device)
        params = []
        for off, n in zip(offsets, sizes):
            p = torch.zeros(n, dtype=dtype, device=device, requires_grad=True)
            p.grad = buffer[off:off + n]
            params.append(p)
        values = [pattern[:n].clone() for n in sizes]
        if bad is not None:
            values[-1][-1] = bad
        for p, v in zip(params, values):
            p.grad.copy_(v.to(device, copy=True))
        group = FlatGroup(device, dtype, buffer, tuple(params), tuple(offsets), sizes, tuple(p.shape for p in params))
        found = torch.zeros((), dtype=torch.float32, device=device)
        kernel.grad_op_(group, found, inv)
        if bool(found.item()) != (bad is not None):
            return f"its op {'missed an' if bad is not None else 'reported an'} inf/NaN in a {name} arena buffer"
        if bad is None and not all(torch.equal(p.grad.cpu(), _expected(v, inv)) for p, v in zip(params, values)):
            return f"its op unscaled {name} values of an arena buffer differently from torch's"
    return None


def _self_check_problem(kernel: Kernel, device: torch.device) -> str | None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        # bf16 gradients reach a kernel that takes them (a bf16 model): the long and flat checks
        small = _small_problem(kernel, device, dtype) if dtype != torch.bfloat16 else None
        problem = small or _long_and_flat_problem(kernel, device, dtype)
        if problem:
            return problem
    return None


def _small_grads(dtype: torch.dtype, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Short gradients in every layout a backward leaves (contiguous; transposed and channels_last, dense
    but not contiguous; a strided slice, not dense), and the tensors that own their memory (compared
    whole: a kernel must write the slice's elements and nothing between them)."""
    values = (torch.arange(48, dtype=torch.float32) % 11 - 5) * 1.75  # a third of these is inexact
    base = torch.tensor([1.5, -2.0, 0.25, 3.0, 0.0, -0.75, 6.0, 1.0])
    owners = [base.clone(), base[:5].clone(), values[:12].reshape(3, 4).clone(), values[:24].reshape(2, 3, 2, 2).clone(),
              values[:10].clone()]
    owners = [o.to(dtype).to(device) for o in owners]
    grads = [owners[0], owners[1], owners[2].t(), owners[3].contiguous(memory_format=torch.channels_last),
             owners[4][::2]]
    owners[3] = grads[3]  # (its own memory, in channels_last order)
    return grads, owners


def _small_problem(kernel: Kernel, device: torch.device, dtype: torch.dtype) -> str | None:
    """Short gradients in every layout (:func:`_small_grads`) against torch's own op: unscale by a factor
    that rounds (1/3), the read-only check, the norm."""
    inv = torch.full((), 1 / 3, dtype=torch.float32, device=device)
    for bad in (None, float("inf"), float("nan")):
        grads, owners = _small_grads(dtype, device)
        if bad is not None:  # the inf in a contiguous gradient, the NaN in the strided slice
            grads[1 if bad == float("inf") else 4][2] = bad
        reference, ref_owners = _small_grads(dtype, device)
        if bad is not None:
            reference[1 if bad == float("inf") else 4][2] = bad
        found, ref_found = (torch.zeros((), dtype=torch.float32, device=device) for _ in range(2))
        kernel.grad_op_(_group(grads), found, inv)
        amp_foreach_non_finite_check_and_unscale_(reference, ref_found, inv)
        if bool(found.item()) != (bad is not None):
            return f"{'missed an' if bad is not None else 'reported an'} inf/NaN in {dtype} gradients"
        if bad is None:
            for kind, a, b in zip(_LAYOUTS, owners, ref_owners):
                if not torch.equal(a, b):
                    return f"unscaled {dtype} values differ from torch's in a {kind} gradient"
        untouched = [o.clone() for o in owners]
        found.zero_()
        kernel.grad_op_(_group(grads), found)
        if bool(found.item()) != (bad is not None):
            return f"its read-only check {'missed' if bad is not None else 'invented'} an inf/NaN"
        if not all(torch.equal(a, b) or (a.isnan().any() and b.isnan().any()) for a, b in zip(owners, untouched)):
            return "its read-only check wrote the gradients"
    for scale in (inv, None):  # found_inf already set (an earlier group's inf/NaN): kept, never cleared
        kept = torch.ones((), dtype=torch.float32, device=device)
        kernel.grad_op_(_group(_small_grads(dtype, device)[0][:1]), kept, scale)
        if not bool(kept.item()):
            return (f"its {'unscale' if scale is not None else 'read-only check'} cleared a found_inf already set "
                    "(by an earlier group of gradients): it must only ever raise it")
    grads, reference = _small_grads(dtype, device)[0], _small_grads(dtype, device)[0]
    amp_foreach_non_finite_check_and_unscale_(reference, torch.zeros_like(inv), inv)
    norm_sq = torch.zeros((), dtype=torch.float32, device=device)
    found = torch.zeros((), dtype=torch.float32, device=device)
    kernel.grad_op_(_group(grads), found, inv, norm_sq)
    expected = float(sum(r.double().pow(2).sum() for r in reference))  # of torch's unscaled values
    if abs(float(norm_sq.item()) - expected) > 1e-3 * expected:
        return f"sum of squares {float(norm_sq.item()):g} where {expected:g} is right (every layout counted)"
    return None


#: The layouts of :func:`_small_grads`, in its order.
_LAYOUTS = ("contiguous", "short contiguous", "transposed", "channels_last", "strided slice")
