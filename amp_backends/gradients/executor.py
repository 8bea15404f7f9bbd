"""The executor: the kernel's op on an optimizer's gradient groups, within what the device declares.

A device states the limits of its own unscale op (:class:`~amp_backends.devices.contract.Device`:
``unscale_dtypes``, ``max_tensor_elements``, ``global_overflow_status``) and this module applies them,
with torch's results: gradients of a dtype the op does not take go through float32 copies, larger
tensors in slices, and a device-wide overflow status is read instead of the values. The kernel is
called for each (device, dtype) group and nothing else is: it is the one place a device's op plugs in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .groups import FlatGroup, GradGroup, TensorGroup
from ..torch_private import foreach_mul_
from .kernel import Kernel, add_sum_of_squares

if TYPE_CHECKING:
    from ..devices.contract import Device

__all__ = ["run_on_groups_"]


def run_on_groups_(device: Device, kernel: Kernel, groups: Sequence[GradGroup], found_inf: torch.Tensor,
                   inv_scale: torch.Tensor | None, norm_sq: torch.Tensor | None = None, *,
                   inv_scale_finite: bool = False) -> dict[torch.device, torch.Tensor]:
    """The op over gradient groups: unscale and check (``inv_scale`` set) or check only, adding the
    fp32 sum of squares of the result to ``norm_sq`` when given. Returns found_inf per torch device:
    ``found_inf`` itself for its own device, a copy for each other. ``inv_scale_finite``: the caller
    knows ``inv_scale`` is finite (else an arena buffer multiplied whole is marked dirty)."""
    found: dict[torch.device, torch.Tensor] = {}
    partials: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for group in groups:
            where = group.device
            if where not in found:
                found[where] = found_inf if found_inf.device == where else found_inf.to(where, copy=True)
                if norm_sq is not None:
                    partials[where] = torch.zeros((), dtype=torch.float32, device=where)
            inv = inv_scale if inv_scale is None or inv_scale.device == where else inv_scale.to(where, non_blocking=True)
            if isinstance(group, FlatGroup):
                _flat(device, kernel, group, found[where], inv, partials.get(where), inv_scale_finite)
            else:
                _tensors(device, kernel, group, found[where], inv, partials.get(where))
        if norm_sq is not None:
            for partial in partials.values():
                norm_sq.add_(partial.to(norm_sq.device))
    return found


def _runs_dtype_as_is(device: Device, kernel: Kernel, dtype: torch.dtype) -> bool:
    """Whether ``kernel`` runs gradients of ``dtype`` as they are (else through float32)."""
    if kernel.handles_dtypes is not None and dtype in kernel.handles_dtypes:
        return True
    return device.unscale_dtypes is None or dtype in device.unscale_dtypes


def _tensors(device: Device, kernel: Kernel, group: TensorGroup, found_inf: torch.Tensor,
             inv_scale: torch.Tensor | None, norm_sq: torch.Tensor | None) -> None:
    """The op on one list: as it is where the device's op takes its dtype and sizes, else on
    stand-ins (float32 copies, slices of contiguous copies) written back after an unscale."""
    if device.global_overflow_status:
        return _by_overflow_status(device, group.tensors, group.tensors, found_inf, inv_scale, norm_sq)
    limit = device.max_tensor_elements
    grads = group.tensors
    through_fp32 = not _runs_dtype_as_is(device, kernel, group.dtype)
    if not through_fp32 and (limit is None or all(g.numel() <= limit for g in grads)):
        return kernel.grad_op_(group, found_inf, inv_scale, norm_sq)
    stand_ins = [g.float() if through_fp32 else g for g in grads]
    if limit is not None:
        stand_ins = [s.contiguous() if s.numel() > limit else s for s in stand_ins]
    # one device and one dtype still: the pieces go to the op together
    pieces = [p for s in stand_ins for p in (s.view(-1).split(limit) if limit and s.numel() > limit else (s,))]
    kernel.grad_op_(TensorGroup(group.device, pieces[0].dtype, pieces), found_inf, inv_scale, norm_sq)
    if inv_scale is not None:
        for g, s in zip(grads, stand_ins):
            if s is not g:
                g.copy_(s)


def _flat(device: Device, kernel: Kernel, group: FlatGroup, found_inf: torch.Tensor, inv_scale: torch.Tensor | None,
          norm_sq: torch.Tensor | None, inv_scale_finite: bool) -> None:
    """The op on one arena buffer: whole where the device's op takes it, else on its views."""
    if device.global_overflow_status:
        _by_overflow_status(device, [group.buffer], group.views(), found_inf, inv_scale, norm_sq)
    elif not _runs_dtype_as_is(device, kernel, group.dtype) or (device.max_tensor_elements is not None
                                                     and group.buffer.numel() > device.max_tensor_elements):
        return _tensors(device, kernel, TensorGroup(group.device, group.dtype, group.views()), found_inf, inv_scale, norm_sq)
    else:
        kernel.grad_op_(group, found_inf, inv_scale, norm_sq)
    if inv_scale is not None and not inv_scale_finite:
        group.dirty = True  # 0 * inf is NaN: the arena zeroes the gaps and free slots before their next use


def _by_overflow_status(device: Device, to_scale: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                        found_inf: torch.Tensor, inv_scale: torch.Tensor | None, norm_sq: torch.Tensor | None) -> None:
    """The op of a device with a global overflow status, as its unscale op runs it: read (and reset)
    the status first; on overflow set found_inf and leave the gradients scaled (op-plugin's NPU kernel
    returns before unscaling), else unscale. The norm of a group that overflowed is inf: its saturated
    values are no gradient."""
    device.read_overflow_status_(found_inf)
    overflow = found_inf > 0
    if inv_scale is not None:
        foreach_mul_(list(to_scale), torch.where(overflow, torch.ones_like(inv_scale), inv_scale))
    if norm_sq is not None:
        add_sum_of_squares(grads, norm_sq)
        norm_sq.copy_(torch.where(overflow.to(norm_sq.device), torch.full_like(norm_sq, math.inf), norm_sq))


def __getattr__(name: str) -> object:
    if name != "run_":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings

    warnings.warn(f"{__name__}.run_ is now run_on_groups_ (the old name goes in 0.3.0): use run_on_groups_",
                  DeprecationWarning, stacklevel=2)
    return run_on_groups_
