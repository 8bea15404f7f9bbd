"""``ExtensionBackend``: the Backend of a device a PyTorch extension registers as PrivateUse1
(torch_mlu, torch_npu, torch_musa, Gaudi's bridge). Vendors subclass it.

Cambricon ``torch_mlu``, Huawei ``torch_npu`` and Moore Threads ``torch_musa`` each rename
PrivateUse1 to their device and register ``torch.<device>`` as its device module, so
``torch.autocast(device)`` and torch's device-generic unscale op work there. What differs is
declared: the extension's module name, the variables that pick visible devices (in order of
precedence), the vendor's device tool, and the torch release the extension is built for.

The extension is imported only when the backend is asked about (never by ``import
amp_backends``); why it cannot be used is said precisely: not installed, failed to import
(with its error), registered no device module, or sees no device (naming the variable that
decides which devices are visible, and its value).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

import torch

from .backend import Backend

__all__ = ["ExtensionBackend", "find_spec"]


def find_spec(name: str) -> object | None:
    """``importlib.util.find_spec``, None also where a parent package is missing
    (``habana_frameworks.torch`` without ``habana_frameworks``)."""
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


class ExtensionBackend(Backend):
    """A backend whose device comes from a PyTorch extension on the PrivateUse1 key
    (``torch.<device_type>``): declare the extension's import name, install hint, visible-device
    variables and device tool; the availability probe and the dtypes follow from them."""

    #: The extension's import name, e.g. ``"torch_npu"``.
    extension: str = ""
    #: How to get the extension, shown when it is missing.
    install_hint: str = ""
    #: Environment variables that choose the visible devices, the one that wins first.
    visible_devices: tuple[str, ...] = ()
    #: The vendor's command that lists devices and driver state (``cnmon``, ``npu-smi info``).
    device_tool: str = ""

    def __init__(self) -> None:
        self._import_error: str | None = None
        self._imported = False
        self._extension_module: Any = None

    # -- the extension, imported on first use --------------------------------------------
    def _load(self) -> Any:
        """``torch.<device_type>`` after importing the extension, or None (the reason kept)."""
        if not self._imported:
            self._imported = True
            if find_spec(self.extension) is None:
                self._import_error = f"{self.extension} is not installed: {self.install_hint}"
            else:
                try:
                    self._extension_module = importlib.import_module(self.extension)
                except Exception as exc:  # noqa: BLE001 - a broken install is a reason, not a crash
                    self._import_error = (
                        f"{self.extension} is installed but failed to import: {type(exc).__name__}: {exc}"
                    )
        return None if self._import_error else getattr(torch, self.device_type, None)

    def _device_module(self) -> Any:
        return self._load()

    def _visibility_hint(self) -> str:
        for var in self.visible_devices:
            value = os.environ.get(var)
            if value is not None:
                shadowed = [v for v in self.visible_devices[self.visible_devices.index(var) + 1:] if v in os.environ]
                also = f" ({', '.join(shadowed)} is ignored while it is set)" if shadowed else ""
                return f"{var}={value!r} decides which devices are visible{also}"
        if self.visible_devices:
            return f"none of {', '.join(self.visible_devices)} is set"
        return ""

    def unavailable_reason(self) -> str | None:
        module = self._load()
        if module is None:
            return self._import_error or (
                f"{self.extension} imported but registered no torch.{self.device_type} module"
            )
        try:
            count = int(module.device_count())
            available = bool(module.is_available())
        except Exception as exc:  # noqa: BLE001 - a vendor query that fails is the reason, said
            return f"torch.{self.device_type} failed to query devices: {type(exc).__name__}: {exc}"
        if not available or count == 0:
            hint = self._visibility_hint()
            tool = f"; check the driver with {self.device_tool}" if self.device_tool else ""
            return (f"no {self.name.upper()} device visible: torch.{self.device_type}.device_count() is 0"
                    f"{' (' + hint + ')' if hint else ''}{tool}")
        return None

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """fp16, and bf16 where the chip runs it (the extension's ``is_bf16_supported``): the
        extensions' ``get_amp_supported_dtype`` lists bf16 whatever the chip."""
        module = self._load()
        if module is None:
            return (self.default_dtype,)
        return (torch.float16, torch.bfloat16) if self._bf16(module) else (torch.float16,)

    def _bf16(self, module: Any) -> bool:
        query = getattr(module, "is_bf16_supported", None)
        return bool(query()) if callable(query) else False
