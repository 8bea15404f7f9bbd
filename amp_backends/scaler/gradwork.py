"""The scaler's gradient op over one optimizer: its gradients (the arena's buffers, or one walk),
the device's op through the executor, and found_inf agreed on across ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..devices.contract import Device
from ..gradients import executor
from ..gradients.collect import collect
from ..gradients.kernel import Kernel
from ..registry.registry import kernel_for
from . import consensus

if TYPE_CHECKING:
    from ..gradients.arena import FlatGrads

__all__ = ["GradientOp"]


class GradientOp:
    """One scaler's gradient op on ``device``, agreeing over ``process_group`` (None: no agreement;
    ``"world"``: the default group)."""

    def __init__(self, device: Device, process_group: Any) -> None:
        self.device = device
        self.process_group = process_group
        #: a device-wide overflow status seen this iteration (shared by every optimizer of it)
        self.status_overflow = False
        #: the kernel the op runs on, settled at the first op (the registry's choice, or one pinned on the backend)
        self.kernel: Kernel | None = None

    def settled_kernel(self) -> Kernel:
        """The kernel the op runs on: the registry's choice (or one pinned on the backend) at the first
        call, then kept, so that the clip asks the kernel the op runs rather than the registry again."""
        if self.kernel is None:
            self.kernel = kernel_for(self.device)
        return self.kernel

    def inv_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """1/scale as torch computes it (in float64), or in float32 where the device has no float64."""
        return scale.double().reciprocal().float() if self.device.has_fp64 else scale.reciprocal()

    def run(self, optimizer: torch.optim.Optimizer, scale: torch.Tensor | None, found_inf: torch.Tensor,
            allow_fp16: bool, norm_sq: torch.Tensor | None = None, inv_scale_finite: bool = False, *,
            inv_scale: torch.Tensor | None = None, agree: bool = True,
            require: bool = True) -> tuple[dict[torch.device, torch.Tensor], FlatGrads | None]:
        """Unscale ``optimizer``'s gradients by 1/``scale`` and check them (``scale`` None: check only),
        adding the fp32 sum of squares to ``norm_sq`` when given. ``inv_scale_finite``: the caller knows
        1/scale is finite; ``inv_scale``: 1/scale computed by the caller (torch's ``_unscale_grads_``);
        ``agree=False``: this rank's found_inf only, the caller agrees once (:meth:`agree`);
        ``require=False``: no rank having a gradient is no error (``check_finite``: nothing to check).
        Returns found_inf per device and the arena whose buffers the op ran on (None:
        a walk found the gradients)."""
        consensus.check_group_ready(self.process_group)
        groups, arena = collect(optimizer, allow_fp16, norm_sq is not None)
        kernel = self.settled_kernel()
        if inv_scale is None and scale is not None:
            inv_scale = self.inv_scale(scale)
        found = executor.run_on_groups_(self.device, kernel, groups, found_inf, inv_scale, norm_sq,
                                        inv_scale_finite=inv_scale_finite)
        return (self.agree(found, found_inf, require) if agree else found), (arena if groups else None)

    def agree(self, found: dict[torch.device, torch.Tensor], found_inf: torch.Tensor,
              require: bool = True) -> dict[torch.device, torch.Tensor]:
        """``found`` agreed across the ranks of the process group (one collective, made by every rank
        whatever its gradients), or as it is in one process. A rank with no gradient (an FSDP shard or
        ZeRO partition empty this step, an expert no token reached) joins with ``found_inf`` clear, as
        torch's ``ShardedGradScaler`` does: the others wait in that all-reduce. Where no rank had a
        gradient, every rank raises torch's "No inf checks were recorded" (:func:`consensus.agree`)."""
        if self.device.global_overflow_status:
            if not found and consensus.ranks_agree_on_status(self.process_group):
                # no gradient on this rank: it reads its status and still takes part in the agreement the
                # other ranks wait in (torch_npu always all-reduces)
                self.device.read_overflow_status_(found_inf)  # type: ignore[attr-defined]  # declared with global_overflow_status (checked at registration)
                found = {found_inf.device: found_inf}
            if found:
                self.status_overflow = consensus.share_status(found, self.status_overflow, self.process_group)
        elif self.process_group is not None:
            checked = bool(found)
            if not checked:
                found = {found_inf.device: found_inf}
            consensus.agree(found, self.process_group, checked or not require)
        return found
