"""``ExtensionBackend``: the Backend of a device a PyTorch extension registers as PrivateUse1
(torch_mlu, torch_npu, torch_musa, Gaudi's bridge). Vendors subclass it."""

from __future__ import annotations

from .backend import Backend
from .devices.extension import ExtensionDevice

__all__ = ["ExtensionBackend"]


class ExtensionBackend(ExtensionDevice, Backend):
    """A backend whose device comes from a PyTorch extension on the PrivateUse1 key: declare the
    extension's import name, install hint, visible-device variables and device tool
    (:class:`~amp_backends.devices.extension.ExtensionDevice`)."""
