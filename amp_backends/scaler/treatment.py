"""How ``GradScaler.step`` treats one optimizer: a :class:`Treatment`, decided once per optimizer by
:func:`choose` (at its first step) and kept by the scaler."""

from __future__ import annotations

import enum
import inspect
from typing import TYPE_CHECKING

import torch

from ..devices import fused
from ..eager import eager

if TYPE_CHECKING:
    from ..devices.contract import Device

__all__ = ["Treatment", "choose", "momentum_buffers_missing"]


class Treatment(enum.Enum):
    """What ``GradScaler.step`` does around ``optimizer.step()``."""

    #: Scaling off (bf16) and nothing to check: the optimizer steps.
    FORWARD = "forward"
    #: Scaling off, ``check_finite`` on: the gradients are checked (one host read) before the step.
    CHECK_ONLY = "check_only"
    #: torch's path for a plain optimizer: unscale (unless done), then skip from the host (the step's one sync).
    PLAIN = "plain"
    #: A fused kernel that honours both: it gets ``grad_scale`` and ``found_inf`` and skips on the device.
    FUSED = "fused"
    #: A fused kernel that skips on found_inf but does not divide by ``grad_scale``: the gradients are
    #: unscaled first and it gets ``found_inf`` with ``grad_scale`` None (torch's protocol after ``unscale_``).
    UNSCALED_FUSED = "unscaled_fused"
    #: A fused kernel not trusted with found_inf: checked, then skipped from the host with the gradients
    #: untouched (what torch's fused protocol leaves), or unscaled and stepped.
    FROM_HOST = "from_host"
    #: The optimizer's own ``step(grad_scaler=...)`` (torch_mlu's FusedLAMBAMP): torch's ``GradScaler.step``
    #: hands it the scaler, and it unscales, checks and skips itself.
    OPTIMIZER_OWNED = "optimizer_owned"
    #: A fused kernel the device cannot run (absent, or refused by its extension): refused before anything changes.
    REFUSED = "refused"

    def __init__(self, value: str) -> None:
        #: whether the optimizer's kernel skips the step on the device (found_inf stays there); a plain
        #: attribute, which the step reads under torch.compile without entering a Python frame
        self.skips_on_device = value in ("fused", "unscaled_fused", "optimizer_owned")


def choose(enabled: bool, check_finite: bool, device: Device, optimizer: torch.optim.Optimizer) -> Treatment:
    """The treatment of ``optimizer``'s steps, from whether scaling is on, whether the optimizer takes
    part in torch's fused protocol (``_step_supports_amp_scaling``), and what the device's fused kernel
    for it does with grad_scale and found_inf (:func:`~amp_backends.devices.fused.fused_kernel_of`:
    declared by the backend, or probed once on the device):

    =========================  ==========================  ========================  ==================
    scaling                    the optimizer               its fused kernel          treatment
    =========================  ==========================  ========================  ==================
    off                        any                         any                       CHECK_ONLY with
                                                                                     ``check_finite``,
                                                                                     else FORWARD
    on                         not in the protocol         absent or refused         REFUSED
    on                         not in the protocol         any other, or none        PLAIN
    on                         in the protocol             absent or refused         REFUSED
    on                         in the protocol             scale-blind               UNSCALED_FUSED
    on                         ``step(grad_scaler=)``      honours                   OPTIMIZER_OWNED
    on                         in the protocol             honours                   FUSED
    on                         in the protocol             ignores or rejects        FROM_HOST
    =========================  ==========================  ========================  ==================

    "Not in the protocol" with a fused kernel is a torch optimizer with ``fused=True`` that sets no
    ``_step_supports_amp_scaling`` (torch 2.11's ``Adagrad``; 2.13's sets it): torch's scaler steps it as a
    plain one. A treatment that skips on the device is downgraded to FROM_HOST for a step of fused SGD
    with momentum whose buffers are not all made yet (:func:`momentum_buffers_missing`, in ``step()``)."""
    if not enabled:
        return Treatment.CHECK_ONLY if check_finite else Treatment.FORWARD
    in_protocol = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
    if not in_protocol and not fused.runs_fused_kernel(optimizer):
        return Treatment.PLAIN
    status = fused.fused_kernel_of(device, optimizer).status
    if status in (fused.FusedStatus.ABSENT, fused.FusedStatus.REFUSED):
        return Treatment.REFUSED
    if not in_protocol:
        return Treatment.PLAIN
    if status is fused.FusedStatus.SCALE_BLIND:
        return Treatment.UNSCALED_FUSED
    if status is not fused.FusedStatus.HONOURS:
        return Treatment.FROM_HOST
    owned = "grad_scaler" in inspect.signature(optimizer.step).parameters
    return Treatment.OPTIMIZER_OWNED if owned else Treatment.FUSED


@eager
def momentum_buffers_missing(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is an SGD with momentum some of whose parameters have no momentum buffer yet.
    torch's fused SGD makes a parameter's first buffer with ``empty_like`` and lets the kernel fill it; a
    kernel that skips (found_inf) leaves it uninitialised, and the next step trains on garbage (torch 2.13;
    CPU and CUDA kernels, and op-plugin's and torch_musa's, have the same early return). Such a step is
    skipped from the host instead."""
    if not isinstance(optimizer, torch.optim.SGD) or not any(g.get("momentum") for g in optimizer.param_groups):
        return False
    state = optimizer.state
    if len(state) >= sum(len(g["params"]) for g in optimizer.param_groups):
        return False  # (every parameter has its buffer: the common case, counted)
    # a parameter that never gets a gradient, or one in a group without momentum, never gets a buffer:
    # only those this step moves count
    return any(p.grad is not None and "momentum_buffer" not in state.get(p, {})
               for g in optimizer.param_groups if g.get("momentum") for p in g["params"])
