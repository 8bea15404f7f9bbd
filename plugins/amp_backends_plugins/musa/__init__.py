"""Moore Threads MUSA backend, through Moore Threads' ``torch_musa`` extension.

torch_musa renames PrivateUse1 to "musa", registers ``torch.musa`` and MCCL, and its GradScaler
is a thin subclass of ``torch.amp.GradScaler(device="musa")`` (``torch_musa/core/amp/
grad_scaler.py``). Its unscale op reuses CUDA's implementation, which has no bf16 (bf16
gradients go through a float32 copy); bf16 autocast from compute capability 2.2. torch_musa
2.7.1 pins torch 2.7.1. Imported only when this backend is asked for. Not run on MUSA hardware:
see docs/backends/musa.md.
"""

from __future__ import annotations

from typing import Any

import torch

from amp_backends import hookimpl
from amp_backends.extension import ExtensionBackend
from amp_backends.devices.fused import HONOURS, REFUSED


class MUSABackend(ExtensionBackend):
    """Mixed precision on Moore Threads GPUs (fp16 by default, bf16 native from capability 2.2 and
    emulated below it where torch_musa allows, MCCL)."""

    name = "musa"
    device_type = "musa"
    default_dtype = torch.float16
    dist_backend = "mccl"
    priority = 100
    extension = "torch_musa"
    install_hint = "install Moore Threads' torch_musa wheel for this torch (torch_musa 2.7.1 needs torch 2.7.1)"
    visible_devices = ("MUSA_VISIBLE_DEVICES",)
    device_tool = "mthreads-gmi"
    unscale_dtypes = (torch.float32, torch.float16, torch.float64)
    #: torch_musa's autocast is CUDA's, which bans binary_cross_entropy
    fp32_ops = ("binary_cross_entropy",)
    #: torch_musa (csrc/aten/ops/FusedAdam.cpp) refuses torch's fused Adam and AdamW with a TORCH_CHECK;
    #: its _fused_sgd_ kernel (musa/FusedSgdKernel.mu) returns when found_inf is 1
    fused_found_inf = {
        "adam": (REFUSED, "torch_musa refuses torch.optim.Adam(fused=True) (csrc/aten/ops/FusedAdam.cpp): use "
                          "torch_musa.optim.FusedAdam, or fused=False"),
        "adamw": (REFUSED, "torch_musa refuses torch.optim.AdamW(fused=True) (csrc/aten/ops/FusedAdam.cpp): use "
                           "torch_musa.optim.FusedAdamW, or fused=False"),
        "sgd": (HONOURS, "torch_musa's _fused_sgd_ kernel skips when found_inf is 1"),
    }
    built_for_torch = "2.7.1"

    # torch_musa core/device.py: is_bf16_supported(including_emulation=True) holds from compute
    # capability 2.2, and below it wherever a bf16 tensor can be made (emulated). The base class asks
    # it (emulation counted) for the autocast dtypes; native math is the capability rule.
    def native_dtypes(self) -> tuple[torch.dtype, ...]:
        module = self._load()
        supported = self.supported_dtypes()
        if module is None or self._capability(module) >= (2, 2):
            return supported
        return tuple(d for d in supported if d != torch.bfloat16)

    def emulation_reason(self, dtype: torch.dtype) -> str:
        module = self._load()
        if dtype == torch.bfloat16 and module is not None:
            major, minor = self._capability(module)
            return f"this GPU's compute capability {major}.{minor} is below 2.2, the first with bf16 math"
        return super().emulation_reason(dtype)

    @staticmethod
    def _capability(module: Any) -> tuple[int, int]:
        query = getattr(module, "get_device_capability", None)
        return tuple(query()) if callable(query) else (0, 0)  # type: ignore[return-value]


@hookimpl
def amp_backends_register_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(MUSABackend())
