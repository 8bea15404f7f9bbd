"""``ExtensionBackend``: the Backend of a device a PyTorch extension registers as PrivateUse1
(torch_mlu, torch_npu, torch_musa, Gaudi's bridge). Vendors subclass it."""

from __future__ import annotations

from .devices.extension import ExtensionBackend

__all__ = ["ExtensionBackend"]
