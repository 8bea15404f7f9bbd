"""Optional capabilities of a device, each a mixin with abstract methods.

A backend that has a capability subclasses its mixin next to :class:`amp_backends.Backend`
(``class NPUBackend(OverflowStatus, ExtensionBackend)``): Python then refuses to build the backend
until every method of the capability is implemented, and the registry and the scaler recognise it
with ``isinstance``. A backend without the capability subclasses nothing more.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import cast

import torch

__all__ = ["OverflowStatus", "overflow_status"]


class OverflowStatus(ABC):
    """Overflow comes from a device-wide status register, not from inspecting the gradients (torch_npu
    on chips without inf/NaN mode).

    The first ``GradScaler.scale()`` of an iteration clears it (:meth:`clear_overflow_status`); the
    gradient op reads it instead of the tensors (:meth:`read_overflow_status_`), once per iteration: the
    scaler keeps what it read for every optimizer of the iteration and agrees on it across ranks.
    """

    #: Whether the register is in use: True. A device where only some chips keep one (torch_npu: the
    #: chips in saturation mode) overrides it with a property answering for the chip present.
    global_overflow_status: bool = True

    @abstractmethod
    def clear_overflow_status(self) -> None:
        """Clear the device's overflow register."""

    @abstractmethod
    def read_overflow_status_(self, found_inf: torch.Tensor) -> None:
        """Set the 0-dim fp32 ``found_inf`` to 1 where the register says an overflow happened since it was
        cleared (leave it as it is otherwise), and clear the register."""


def overflow_status(device: object) -> OverflowStatus:
    """``device`` as the :class:`OverflowStatus` it declares being (``global_overflow_status`` true): a
    subclass of the mixin, or a backend of the older spelling (``global_overflow_status = True`` with both
    methods, accepted with a DeprecationWarning at registration)."""
    return cast(OverflowStatus, device)
