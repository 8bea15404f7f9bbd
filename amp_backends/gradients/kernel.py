"""The kernel interface: the one gradient op every device runs, and torch's implementation of it.

A :class:`Kernel` runs :meth:`Kernel.grad_op_` on one group of gradients that share a device and a
dtype (a :class:`~.groups.TensorGroup` or an arena's :class:`~.groups.FlatGroup`): unscale and check
for inf/NaN, or check only, adding the fp32 sum of squares when asked. :class:`TorchKernel` is torch's
own op, which every device falls back to; plugins register faster ones (the Triton plugin) through
``amp_backends_register_kernels``. The executor (:mod:`.executor`) calls nothing else.

Where a kernel runs is one method, :meth:`Kernel.unavailable_reason`; where it is chosen without being
asked, one declaration, :attr:`Kernel.auto_device_types` (:func:`selects_itself` combines them); the
dtypes it runs itself, one declaration, :attr:`Kernel.handles_dtypes`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from ..devices.old_contract import KERNEL_METHODS, KERNEL_SPELLINGS, REMOVED_IN, Removed, defines
from ..torch_private import amp_foreach_non_finite_check_and_unscale_, foreach_norm
from .groups import FlatGroup, GradGroup, TensorGroup

__all__ = ["Kernel", "TORCH_KERNEL", "TorchKernel", "add_sum_of_squares", "selects_itself", "through_float32"]


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
        norms = foreach_norm(grads, 2.0)  # already fp32: DTensor (torch 2.14) refuses the dtype argument
    elif any(type(g) is not torch.Tensor for g in grads):
        norms = foreach_norm([g.float() for g in grads], 2.0)  # exact upcast: the same fp32 norms
    else:
        norms = foreach_norm(grads, 2.0, dtype=torch.float32)
    total = torch.linalg.vector_norm(torch.stack(list(norms)))
    full_tensor = getattr(total, "full_tensor", None)  # a DTensor: reduce its partial norm
    if callable(full_tensor):
        total = full_tensor()
    norm_sq.add_(total.square())


def torch_op_(group: GradGroup, found_inf: torch.Tensor, inv_scale: torch.Tensor | None,
              norm_sq: torch.Tensor | None) -> None:
    """torch's op on ``group``: ``_amp_foreach_non_finite_check_and_unscale_`` (by 1 for a check) on its
    tensors, or on an arena's whole buffer at once (its zero gaps change nothing); the sum of squares
    over the gradients."""
    tensors = [group.buffer] if isinstance(group, FlatGroup) else list(group.tensors)
    if inv_scale is None:
        inv_scale = torch.ones((), dtype=torch.float32, device=found_inf.device)
    amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)
    if norm_sq is not None:
        add_sum_of_squares(group.gradients(), norm_sq)


class Kernel:
    """A provider of the gradient op; subclass and override :meth:`grad_op_`, and
    :meth:`unavailable_reason` where it does not run everywhere."""

    name: str = "kernel"
    #: Higher wins when several kernels can run on a device type.
    priority: int = 0
    #: True when :meth:`grad_op_` measures the norm in the same pass as the unscale; the
    #: scaler's ``clip_grad_norm_`` then uses it instead of torch's recipe.
    one_pass_norm: bool = False
    #: Gradient dtypes this kernel handles itself on every device (None: it relies on the
    #: device's op, so the device's ``unscale_dtypes`` apply). The one declaration of its dtypes.
    handles_dtypes: tuple[torch.dtype, ...] | None = None
    #: Device types the registry chooses this kernel for when nothing is forced, where it is available
    #: (None: every device type it is available on). ``AMP_BACKENDS_KERNEL`` forces it anywhere available.
    auto_device_types: tuple[str, ...] | None = None

    def unavailable_reason(self, device_type: str) -> str | None:
        """Why the kernel cannot run on tensors of ``device_type`` (not installed, no compiler for the
        device...), or None where it can: the one availability method."""
        if defines(type(self), "supports", Kernel):  # the older spelling, warned about at registration
            return None if self.supports(device_type) else f"kernel {self.name!r} does not support {device_type!r}"
        return None

    def supports(self, device_type: str) -> bool:
        """Deprecated: ``unavailable_reason(device_type) is None``."""
        _deprecated_call("supports", "unavailable_reason(device_type) is None")
        if type(self).unavailable_reason is Kernel.unavailable_reason:
            return True  # the base's answer, not asked through an override of supports() calling this one
        return self.unavailable_reason(device_type) is None

    def auto_select(self, device_type: str) -> bool:
        """Deprecated: :func:`selects_itself`."""
        _deprecated_call("auto_select", "amp_backends.gradients.kernel.selects_itself(kernel, device_type)")
        return _declared_selection(self, device_type)

    def grad_op_(self, group: GradGroup, found_inf: torch.Tensor, inv_scale: torch.Tensor | None = None,
                 norm_sq: torch.Tensor | None = None) -> None:
        """The op, on one group of gradients sharing a device and a dtype: multiply each in place by
        ``inv_scale`` (None: only read them); set the 0-dim fp32 ``found_inf`` to 1 on any inf, -inf or
        NaN; add the fp32 sum of squares of the result to ``norm_sq`` when given. A
        :class:`~.groups.FlatGroup` may be run as its whole buffer (everything outside the gradients
        is zero). Within what the device's op accepts: the executor hands over only those dtypes and
        sizes (the device's ``unscale_dtypes``, ``max_tensor_elements``). The default is torch's op."""
        torch_op_(group, found_inf, inv_scale, norm_sq)

    # the earlier contract's ops (grad_op_ now): named where read, refused at registration where overridden
    unscale_and_check_ = Removed(KERNEL_METHODS)
    check_ = Removed(KERNEL_METHODS)
    unscale_check_norm_ = Removed(KERNEL_METHODS)
    check_norm_ = Removed(KERNEL_METHODS)
    flat_op_ = Removed(KERNEL_METHODS)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def selects_itself(kernel: Kernel, device_type: str) -> bool:
    """Whether the registry chooses ``kernel`` for ``device_type`` when nothing is forced: a device type
    of its :attr:`~Kernel.auto_device_types` where it is available (the older ``auto_select()``, where a
    kernel still overrides it)."""
    if defines(type(kernel), "auto_select", Kernel):  # the older spelling, warned about at registration
        return bool(kernel.auto_select(device_type))
    return _declared_selection(kernel, device_type)


def _declared_selection(kernel: Kernel, device_type: str) -> bool:
    wanted = kernel.auto_device_types is None or device_type in kernel.auto_device_types
    return wanted and kernel.unavailable_reason(device_type) is None


def _deprecated_call(name: str, instead: str) -> None:
    warnings.warn(f"Kernel.{name}() is deprecated and is removed in amp-backends {REMOVED_IN}: use {instead} "
                  f"({KERNEL_SPELLINGS[name]})", DeprecationWarning, stacklevel=3)


def through_float32(kernel: Kernel, grads: Sequence[torch.Tensor], found_inf: torch.Tensor,
                    inv_scale: torch.Tensor | None) -> None:
    """Run ``kernel``'s op on float32 copies of ``grads`` (written back after an unscale): the results
    of torch's op, which computes in float32, for dtypes a device's op does not take (bf16 on CUDA)."""
    if not grads:
        return
    stand_ins = [g.float() for g in grads]
    kernel.grad_op_(TensorGroup(stand_ins[0].device, torch.float32, stand_ins), found_inf, inv_scale)
    if inv_scale is not None:
        for g, s in zip(grads, stand_ins):
            g.copy_(s)


class TorchKernel(Kernel):
    """torch's own ops: ``_amp_foreach_non_finite_check_and_unscale_`` and ``_foreach_norm``."""

    name = "torch"
    priority = -1


TORCH_KERNEL = TorchKernel()
