"""Gradient kernels: the ops a backend's unscale/inf-check goes through.

A :class:`Kernel` works on one list of gradients that share a device and a dtype.
:class:`TorchKernel` is the pure-torch default every device falls back to; plugins
(the Triton plugin) register faster ones through ``amp_backends_register_kernels``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .groups import FlatGroup, layout

__all__ = ["Kernel", "TorchKernel", "TORCH_KERNEL", "add_sum_of_squares", "kernel_self_check", "through_float32"]


def add_sum_of_squares(grads: Sequence[torch.Tensor], norm_sq: torch.Tensor) -> None:
    """Add the sum of squares of every element of ``grads`` to the 0-dim fp32 ``norm_sq``.

    Each tensor's norm is accumulated and returned in fp32 whatever its dtype (an fp16
    gradient of 60000s does not overflow). DTensor gradients (FSDP2) give their global
    norm, reduced over their mesh as ``torch.nn.utils.clip_grad_norm_`` reduces it.
    """
    if not grads:
        return
    grads = list(grads)
    if all(g.dtype == torch.float32 for g in grads):
        norms = torch._foreach_norm(grads, 2.0)  # already fp32: DTensor (torch 2.14) refuses the dtype argument
    elif any(type(g) is not torch.Tensor for g in grads):
        norms = torch._foreach_norm([g.float() for g in grads], 2.0)  # exact upcast: the same fp32 norms
    else:
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    total = torch.linalg.vector_norm(torch.stack(list(norms)))
    full_tensor = getattr(total, "full_tensor", None)  # a DTensor: reduce its partial norm
    if callable(full_tensor):
        total = full_tensor()
    norm_sq.add_(total.square())


class Kernel:
    """A provider of the fused gradient ops; subclass and override what you accelerate."""

    name: str = "kernel"
    #: Higher wins when several kernels can run on a device type.
    priority: int = 0
    #: True when :meth:`unscale_check_norm_` measures the norm in the same pass as the
    #: unscale; the scaler's ``clip_grad_norm_`` then uses it instead of torch's recipe.
    one_pass_norm: bool = False
    #: Gradient dtypes this kernel handles itself on every device (None: it relies on the
    #: device's op, so the backend's ``unscale_dtypes`` apply).
    handles_dtypes: tuple[torch.dtype, ...] | None = None

    def supports(self, device_type: str) -> bool:
        """Whether this kernel can run on tensors of ``device_type`` (when forced)."""
        return True

    def auto_select(self, device_type: str) -> bool:
        """Whether to pick this kernel for ``device_type`` when nothing is forced."""
        return self.supports(device_type)

    def unavailable_reason(self, device_type: str) -> str | None:
        """Why the kernel cannot run on ``device_type``, or None where it can."""
        return None if self.supports(device_type) else f"kernel {self.name!r} does not support {device_type!r}"

    def unscale_and_check_(
        self, grads: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
    ) -> None:
        """Multiply ``grads`` by ``inv_scale`` in place; set ``found_inf`` to 1 on any inf/NaN."""
        torch._amp_foreach_non_finite_check_and_unscale_(list(grads), found_inf, inv_scale)

    def check_(self, grads: Sequence[torch.Tensor], found_inf: torch.Tensor) -> None:
        """Set ``found_inf`` to 1 on any inf/NaN in ``grads`` without changing them."""
        one = torch.ones((), dtype=torch.float32, device=found_inf.device)
        torch._amp_foreach_non_finite_check_and_unscale_(list(grads), found_inf, one)

    def unscale_check_norm_(
        self,
        grads: Sequence[torch.Tensor],
        found_inf: torch.Tensor,
        inv_scale: torch.Tensor,
        norm_sq: torch.Tensor,
    ) -> None:
        """Unscale and check like :meth:`unscale_and_check_`, and add the sum of squares
        of the unscaled gradients (in fp32) to the 0-dim fp32 tensor ``norm_sq``."""
        grads = list(grads)
        self.unscale_and_check_(grads, found_inf, inv_scale)
        add_sum_of_squares(grads, norm_sq)

    def check_norm_(self, grads: Sequence[torch.Tensor], found_inf: torch.Tensor, norm_sq: torch.Tensor) -> None:
        """Read-only: check like :meth:`check_` and add the fp32 sum of squares of ``grads`` to ``norm_sq``."""
        grads = list(grads)
        self.check_(grads, found_inf)
        add_sum_of_squares(grads, norm_sq)

    def flat_op_(
        self,
        group: FlatGroup,
        found_inf: torch.Tensor,
        inv_scale: torch.Tensor | None,
        norm_sq: torch.Tensor | None,
    ) -> None:
        """The ops on one arena group (:class:`~amp_backends.gradients.groups.FlatGroup`): unscale and check
        (``inv_scale`` set) or check only, adding the fp32 sum of squares to ``norm_sq`` if given.

        The default runs this kernel's own op once on the whole buffer (its zero gaps change
        nothing) and measures the norm over the views, as the per-tensor path does."""
        group.clear_gaps_()
        if inv_scale is None:
            self.check_([group.buffer], found_inf)
        else:
            self.unscale_and_check_([group.buffer], found_inf, inv_scale)
        if norm_sq is not None:
            add_sum_of_squares(group.views(), norm_sq)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def through_float32(op: Callable[..., None], grads: Sequence[torch.Tensor], *args: torch.Tensor,
                    write: bool) -> None:
    """Run ``op`` on float32 copies of ``grads`` (written back when ``write``): the results of
    torch's op, which computes in float32, for dtypes a device's op does not take (bf16 on CUDA)."""
    stand_ins = [g.float() for g in grads]
    op(stand_ins, *args)
    if write:
        for g, s in zip(grads, stand_ins):
            g.copy_(s)


class TorchKernel(Kernel):
    """torch's own ops: ``_amp_foreach_non_finite_check_and_unscale_`` and ``_foreach_norm``."""

    name = "torch"
    priority = -1


TORCH_KERNEL = TorchKernel()


def kernel_self_check(kernel: Kernel, device: torch.device) -> str | None:
    """What is wrong with ``kernel`` on ``device`` (None: nothing). Float32 and float16 gradients:
    unscale values bitwise equal to torch's op, inf and NaN found, read-only ops write nothing,
    the sum of squares right; float32, float16 and bfloat16 gradients longer than any block with
    the inf/NaN only at their end, per tensor and through ``flat_op_`` on an arena buffer. A kernel
    that raises is reported, not propagated."""
    threshold = getattr(kernel, "min_elements", None)
    if threshold:  # a kernel that hands small inputs to torch is checked on its own code too
        kernel.min_elements = 0  # type: ignore[attr-defined]
    try:
        return _self_check_problem(kernel, device)
    except Exception as exc:  # noqa: BLE001 - a broken kernel is a finding, not a crash
        return f"raised {type(exc).__name__}: {exc}"
    finally:
        if threshold:
            kernel.min_elements = threshold  # type: ignore[attr-defined]


#: The self-check's long gradients: two blocks of 4096 (the Triton kernel's on GPUs; 16 of 512
#: interpreted) and an odd tail, so a kernel that looks at only the first block, or only the first
#: 64 elements, misses the inf/NaN put at the end.
_LONG = 2 * 4096 + 3


def _expected(values: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """What an unscale must give: the product computed in float32, cast back (torch's op)."""
    return (values.float() * inv.float().cpu()).to(values.dtype)


def _long_and_flat_problem(kernel: Kernel, device: torch.device, dtype: torch.dtype) -> str | None:
    """Gradients longer than any block, an inf or NaN only at their very end, per tensor and
    on an arena's flat buffer (``flat_op_``): found, and clean values unscaled exactly."""

    name = str(dtype).replace("torch.", "")
    inv = torch.full((), 0.5, dtype=torch.float32, device=device)
    pattern = (torch.arange(_LONG, dtype=torch.float32) % 7 - 3).to(dtype)
    for bad in (None, float("inf"), float("nan")):
        # per tensor: a short one, then the long one with the bad value last
        host = [pattern[:37].clone(), pattern.clone()]
        if bad is not None:
            host[1][-1] = bad
        grads = [h.to(device, copy=True) for h in host]
        found = torch.zeros((), dtype=torch.float32, device=device)
        kernel.unscale_and_check_(grads, found, inv)
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
        kernel.flat_op_(group, found, inv, None)
        if bool(found.item()) != (bad is not None):
            return f"its flat_op_ {'missed an' if bad is not None else 'reported an'} inf/NaN in a {name} arena buffer"
        if bad is None and not all(torch.equal(p.grad.cpu(), _expected(v, inv)) for p, v in zip(params, values)):
            return f"its flat_op_ unscaled {name} values differently from torch's"
    return None


def _self_check_problem(kernel: Kernel, device: torch.device) -> str | None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        # bf16 gradients reach a kernel that takes them (a bf16 model): the long and flat checks
        small = _small_problem(kernel, device, dtype) if dtype != torch.bfloat16 else None
        problem = small or _long_and_flat_problem(kernel, device, dtype)
        if problem:
            return problem
    return None


def _small_problem(kernel: Kernel, device: torch.device, dtype: torch.dtype) -> str | None:
    """Two short gradients against torch's own op: unscale, the read-only check, the norm."""
    base = torch.tensor([1.5, -2.0, 0.25, 3.0, 0.0, -0.75, 6.0, 1.0], dtype=dtype)
    inv = torch.full((), 0.5, dtype=torch.float32, device=device)
    for bad in (None, float("inf"), float("nan")):
        grads = [base.clone().to(device), base[:5].clone().to(device)]
        if bad is not None:
            grads[1][2] = bad
        reference = [g.clone() for g in grads]
        found, ref_found = (torch.zeros((), dtype=torch.float32, device=device) for _ in range(2))
        kernel.unscale_and_check_(grads, found, inv)
        torch._amp_foreach_non_finite_check_and_unscale_(reference, ref_found, inv)
        if bool(found.item()) != (bad is not None):
            return f"{'missed an' if bad is not None else 'reported an'} inf/NaN in {dtype} gradients"
        if bad is None and not all(torch.equal(a, b) for a, b in zip(grads, reference)):
            return f"unscaled {dtype} values differ from torch's"
        untouched = [g.clone() for g in grads]
        found.zero_()
        kernel.check_(grads, found)
        if bool(found.item()) != (bad is not None):
            return f"its read-only check {'missed' if bad is not None else 'invented'} an inf/NaN"
        if not all(torch.equal(a, b) or (a.isnan().any() and b.isnan().any()) for a, b in zip(grads, untouched)):
            return "its read-only check wrote the gradients"
    grads = [base.clone().to(device)]
    norm_sq = torch.zeros((), dtype=torch.float32, device=device)
    found = torch.zeros((), dtype=torch.float32, device=device)
    kernel.unscale_check_norm_(grads, found, inv, norm_sq)
    expected = float((base.double() * 0.5).pow(2).sum())
    if abs(float(norm_sq.item()) - expected) > 1e-3 * expected:
        return f"sum of squares {float(norm_sq.item()):g} where {expected:g} is right"
    return None
