"""``Backend``: what ``amp_backends.get()`` returns and the one class a device's plugin subclasses.

A Backend declares the facts of :class:`~amp_backends.devices.contract.Device` (how the layers below
name it: never subclassed by vendors) and implements its two abstract methods, the training loop's
entry points: :meth:`Backend.grad_scaler` and the :attr:`Backend.kernel` its gradient ops run on. It
sits above the scaler and the registry, so the device contract below needs neither. Optional
capabilities are mixins (:class:`amp_backends.OverflowStatus`); a device a PyTorch extension registers
as PrivateUse1 subclasses :class:`amp_backends.ExtensionBackend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from .devices.contract import FP8_RECIPES, Device
from .gradients.kernel import Kernel
from .registry import registry
from .registry.registry import kernel_for

if TYPE_CHECKING:
    from .scaler.scaler import GradScaler

__all__ = ["FP8_RECIPES", "Backend", "get"]


class Backend(Device):
    """Base class of every backend: declare the device's facts (the class attributes of
    :class:`~amp_backends.devices.contract.Device`), implement :meth:`unavailable_reason`;
    ``autocast()`` and ``grad_scaler()`` then work on it. The registry accepts only its instances."""

    def grad_scaler(self, dtype: torch.dtype | str | None = None, **kwargs: Any) -> GradScaler:
        """A GradScaler for training under ``autocast(dtype)``.

        It scales when the dtype is float16; for bfloat16 it is free (no scaling, no
        unscale pass) and, with ``check_finite=True``, still refuses non-finite steps.
        """
        from .scaler.scaler import GradScaler  # on first use: import amp_backends stays cheap
        from .scaler.validation import flag

        needs_scaling = self.resolve_dtype(dtype) == torch.float16
        kwargs["enabled"] = flag("enabled", kwargs.get("enabled", True)) and needs_scaling
        return GradScaler(self, **kwargs)

    @property
    def kernel(self) -> Kernel:
        """The kernel this backend's gradient ops run on: chosen by the registry once
        (``AMP_BACKENDS_KERNEL`` forces one), or set here by hand (``backend.kernel = MyKernel()``)."""
        return kernel_for(self)

    @kernel.setter
    def kernel(self, kernel: Kernel) -> None:
        if not isinstance(kernel, Kernel):
            raise TypeError(f"a backend's kernel is an amp_backends.Kernel, got {type(kernel).__name__}")
        self._kernel = kernel


def get(name: str | None = None) -> Backend:
    """A backend by name (``"cpu"``, ``"cuda"``, a vendor's); the best available one for None or
    ``"auto"`` (``AMP_BACKEND`` overrides)."""
    return cast(Backend, registry.get(name))
