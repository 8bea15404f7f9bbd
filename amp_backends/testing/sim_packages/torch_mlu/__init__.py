"""A simulated Cambricon torch_mlu, on the simulated PrivateUse1 device (testing only).

``AMP_SIM_MLU`` picks what it imitates:
- ``new`` (default): current torch_mlu: "mlu" is PrivateUse1, ``torch.mlu`` is a
  registered device module, and ``torch.mlu.amp.autocast``/``GradScaler`` are deprecated wrappers;
- ``legacy``: older torch_mlu: ``torch.mlu.amp.autocast`` only (no ``get_amp_supported_dtype``);
- ``broken``: the install is there but fails to import (a driver library missing);
- ``nodevice``: imports, but no MLU is visible.
``AMP_SIM_MLU_BF16=0`` imitates a chip without bf16 (device major < 5).
"""

from __future__ import annotations

import os
import warnings

import torch

_MODE = os.environ.get("AMP_SIM_MLU", "new")
if _MODE == "broken":
    raise ImportError("libcnnl.so: cannot open shared object file: No such file or directory")

from amp_backends.testing import simdevice  # noqa: E402

_BF16 = os.environ.get("AMP_SIM_MLU_BF16", "1") != "0"
mlu = simdevice.install("mlu", bf16=_BF16, device_count=0 if _MODE == "nodevice" else 1)


class _LegacyAutocast:
    """``torch.mlu.amp.autocast`` as older torch_mlu has it: sets the MLU autocast state itself."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True) -> None:
        self.enabled, self.dtype, self.cache_enabled = enabled, dtype, cache_enabled

    def __enter__(self) -> "_LegacyAutocast":
        self._prev = (torch.is_autocast_enabled("mlu"), torch.get_autocast_dtype("mlu"), torch.is_autocast_cache_enabled())
        torch.set_autocast_enabled("mlu", self.enabled)
        torch.set_autocast_dtype("mlu", self.dtype)
        torch.set_autocast_cache_enabled(self.cache_enabled)
        torch.autocast_increment_nesting()
        return self

    def __exit__(self, *exc: object) -> None:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("mlu", self._prev[0])
        torch.set_autocast_dtype("mlu", self._prev[1])
        torch.set_autocast_cache_enabled(self._prev[2])

    def __call__(self, fn):  # type: ignore[no-untyped-def]
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            with self:
                return fn(*args, **kwargs)

        return wrapped


class _DeprecatedAutocast(torch.amp.autocast_mode.autocast):
    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True) -> None:
        warnings.warn(
            "torch.mlu.amp.autocast(args...) is deprecated. Please use torch.amp.autocast('mlu', args...) instead.",
            FutureWarning,
            stacklevel=2,
        )
        super().__init__("mlu", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


class _DeprecatedGradScaler(torch.amp.GradScaler):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        warnings.warn(
            "torch.mlu.amp.GradScaler(args...) is deprecated. Please use torch.amp.GradScaler('mlu', args...) instead.",
            FutureWarning,
            stacklevel=2,
        )
        super().__init__("mlu", *args, **kwargs)


class _Amp:
    pass


amp = _Amp()
if _MODE == "legacy":
    amp.autocast = _LegacyAutocast  # type: ignore[attr-defined]
    del type(mlu).get_amp_supported_dtype
else:
    amp.autocast = _DeprecatedAutocast  # type: ignore[attr-defined]
    amp.GradScaler = _DeprecatedGradScaler  # type: ignore[attr-defined]
mlu.amp = amp  # type: ignore[attr-defined]
