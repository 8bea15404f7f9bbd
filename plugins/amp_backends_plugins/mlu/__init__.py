"""Cambricon MLU backend, through Cambricon's ``torch_mlu`` extension.

Current torch_mlu registers "mlu" as PyTorch's PrivateUse1 device, so ``torch.autocast("mlu")``
and torch's device-generic unscale op (implemented by torch_mlu) are used. Older
torch_mlu only has ``torch.mlu.amp.autocast``; that is used where ``torch.autocast("mlu")``
cannot work. torch_mlu is imported only when this backend is asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from amp_backends import Backend, hookimpl


class MLUBackend(Backend):
    """Mixed precision on Cambricon MLUs (fp16 by default, bf16 where the chip has it, CNCL)."""

    name = "mlu"
    device_type = "mlu"
    default_dtype = torch.float16
    dist_backend = "cncl"
    priority = 100
    # torch_mlu's unscale kernel (csrc/aten/operators/bang/amp_unscale.cpp) takes float32 and
    # float16 gradients only, and at most INT32_MAX elements per tensor: bf16 gradients (MLU590)
    # and larger tensors are routed around it by the core.
    unscale_dtypes = (torch.float32, torch.float16)
    max_tensor_elements = 2**31 - 1

    def __init__(self) -> None:
        self._import_error: str | None = None
        self._imported = False

    def _load(self) -> Any:
        """``torch.mlu`` after importing torch_mlu, or None (the reason kept)."""
        if not self._imported:
            self._imported = True
            if importlib.util.find_spec("torch_mlu") is None:
                self._import_error = (
                    "torch_mlu is not installed: install Cambricon's torch_mlu build that matches "
                    f"torch {torch.__version__.split('+')[0]}"
                )
            else:
                try:
                    importlib.import_module("torch_mlu")
                except Exception as exc:  # noqa: BLE001 - a broken install is a reason, not a crash
                    self._import_error = f"torch_mlu is installed but failed to import: {type(exc).__name__}: {exc}"
        return None if self._import_error else getattr(torch, "mlu", None)

    def unavailable_reason(self) -> str | None:
        mlu = self._load()
        if mlu is None:
            return self._import_error or "torch_mlu imported but registered no torch.mlu module"
        try:
            count = int(mlu.device_count())
            available = bool(mlu.is_available())
        except Exception as exc:  # noqa: BLE001
            return f"torch.mlu failed to query devices: {type(exc).__name__}: {exc}"
        if not available or count == 0:
            return "no MLU device visible: torch.mlu.device_count() is 0 (check MLU_VISIBLE_DEVICES and the driver with cnmon)"
        return None

    def is_available(self) -> bool:
        return self.unavailable_reason() is None

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        mlu = self._load()
        bf16 = mlu is not None and bool(getattr(mlu, "is_bf16_supported", lambda: False)())
        return (torch.float16, torch.bfloat16) if bf16 else (torch.float16,)

    def uses_legacy_autocast(self) -> bool:
        """True where only ``torch.mlu.amp.autocast`` exists (torch_mlu before PrivateUse1)."""
        mlu = self._load()
        generic = (
            mlu is not None
            and torch._C._get_privateuse1_backend_name() == "mlu"
            and callable(getattr(mlu, "get_amp_supported_dtype", None))
        )
        return not generic and mlu is not None and hasattr(getattr(mlu, "amp", None), "autocast")

    def autocast(
        self,
        dtype: torch.dtype | str | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> Any:
        resolved = self.resolve_dtype(dtype)
        self.warn_if_emulated(resolved, enabled)
        if self.uses_legacy_autocast():
            return torch.mlu.amp.autocast(  # type: ignore[attr-defined]
                enabled=enabled, dtype=resolved, cache_enabled=True if cache_enabled is None else cache_enabled
            )
        return torch.autocast("mlu", dtype=resolved, enabled=enabled, cache_enabled=cache_enabled)


@hookimpl
def amp_backends_register_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(MLUBackend())
