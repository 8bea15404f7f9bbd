"""Intel GPU backend (``xpu``, in torch itself since 2.4): fp16 and bf16 autocast, the scaler's
float32 path on GPUs without float64 (Arc), XCCL or oneCCL process groups.

Checked against torch's ``torch/xpu/__init__.py`` (``_is_compiled``, ``is_available``, ``device_count``,
``is_bf16_supported(including_emulation)``, ``get_device_properties(i).has_fp64``),
``torch/amp/autocast_mode.py`` (xpu accepts float16 and bfloat16) and
``torch/distributed/distributed_c10d.py`` (``is_xccl_available``, ``Backend.default_device_backend_map``).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from amp_backends import Backend, hookimpl

__all__ = ["XPUBackend"]

#: Variables that choose which Intel GPUs are visible (oneAPI Level Zero, the SYCL runtime).
VISIBLE = ("ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR")


def _module() -> Any:
    return getattr(torch, "xpu", None)


class XPUBackend(Backend):
    """Mixed precision on Intel GPUs through ``torch.autocast("xpu")``."""

    name = "xpu"
    device_type = "xpu"
    default_dtype = torch.float16
    priority = 100

    def unavailable_reason(self) -> str | None:
        xpu = _module()
        if xpu is None or not callable(getattr(xpu, "is_available", None)):
            return (f"torch {torch.__version__} has no torch.xpu (Intel GPUs need torch 2.4+ built for XPU: "
                    "pip install torch --index-url https://download.pytorch.org/whl/xpu)")
        compiled = getattr(xpu, "_is_compiled", None)
        if callable(compiled) and not compiled():
            return (f"torch {torch.__version__} is not built for XPU: install an XPU build "
                    "(pip install torch --index-url https://download.pytorch.org/whl/xpu)")
        try:
            count = int(xpu.device_count())
            available = bool(xpu.is_available())
        except Exception as exc:  # noqa: BLE001 - a broken driver is a reason, not a crash
            return f"the XPU runtime failed to start: {type(exc).__name__}: {exc}"
        if count == 0 or not available:
            set_vars = [f"{v}={os.environ[v]!r}" for v in VISIBLE if v in os.environ]
            hint = f" ({', '.join(set_vars)} decides which are visible)" if set_vars else ""
            return f"no Intel GPU visible: torch.xpu.device_count() is 0{hint}; check the driver with xpu-smi"
        return None

    def _bf16(self, emulation: bool) -> bool:
        query = getattr(_module(), "is_bf16_supported", None)
        if not callable(query):
            return False
        try:
            return bool(query(including_emulation=emulation))
        except TypeError:  # torch before including_emulation
            return bool(query())

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        if not self.is_available():
            return (torch.float16,)
        return (torch.float16, torch.bfloat16) if self._bf16(True) else (torch.float16,)

    def native_dtypes(self) -> tuple[torch.dtype, ...]:
        supported = self.supported_dtypes()
        return supported if self._bf16(False) else tuple(d for d in supported if d != torch.bfloat16)

    def emulation_reason(self, dtype: torch.dtype) -> str:
        return f"{self.describe()} reports no native bf16 (torch.xpu.is_bf16_supported(including_emulation=False))"

    @property
    def has_fp64(self) -> bool:  # type: ignore[override]
        """Per device: Arc GPUs have no float64 (torch issue 147731); the scaler then computes
        1/scale in float32."""
        if not self.is_available():
            return True
        try:
            props = _module().get_device_properties(_module().current_device())
        except Exception:  # noqa: BLE001 - unknown: float32, which every device has, is the safe answer
            return False
        return bool(getattr(props, "has_fp64", True))

    dist_install_hint = ("use a torch XPU build with XCCL (torch.distributed.is_xccl_available()), or install "
                         "oneCCL's bindings (pip install oneccl_bind_pt, from Intel's index for your torch)")

    @property
    def dist_backend(self) -> str:  # type: ignore[override]
        """XCCL where torch has it (``is_xccl_available()``), else oneCCL's ``ccl`` where its bindings
        are installed; else none (gloo reduces cpu and cuda tensors only, never xpu ones)."""
        import torch.distributed as dist

        xccl = getattr(dist, "is_xccl_available", None)
        if callable(xccl) and xccl():
            return "xccl"
        if importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None:
            return "ccl"
        return ""

    def describe(self) -> str | None:
        if not self.is_available():
            return None
        xpu = _module()
        try:
            name = xpu.get_device_name(xpu.current_device()) or "Intel GPU (no name reported)"
        except Exception as exc:  # noqa: BLE001 - a failing name query costs only the name
            name = f"Intel GPU (name unavailable: {type(exc).__name__})"
        fp64 = "" if self.has_fp64 else ", no float64"
        return f"{name} (torch.xpu, {xpu.device_count()} device(s){fp64})"


@hookimpl
def amp_backends_register_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(XPUBackend())
