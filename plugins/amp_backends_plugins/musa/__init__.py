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
from amp_backends.devices import collectives as collective_libraries
from amp_backends.extension import ExtensionBackend
from amp_backends.devices import autocast_lists
from amp_backends.devices.fused import ABSENT, HONOURS, REFUSED

#: torch_musa's ``_scaled_mm`` (``csrc/aten/ops/Matmul.cpp`` ``ScaledMatmulOut``) refuses a device below
#: MUSA arch 310 (``getMUSAArch()``: major * 100 + minor * 10, ``csrc/aten/musa/MUSAContext.cpp``).
FP8_CAPABILITY = (3, 1)


class MUSABackend(ExtensionBackend):
    """Mixed precision on Moore Threads GPUs (fp16 by default, bf16 native from capability 2.2 and
    emulated below it where torch_musa allows, MCCL)."""

    name = "musa"
    device_type = "musa"
    default_dtype = torch.float16
    dist_backend = "mccl"
    collectives = collective_libraries.MCCL  # torch_musa ProcessGroupMCCL.cpp: AVG native, no PREMUL_SUM
    priority = 100
    extension = "torch_musa"
    install_hint = "install Moore Threads' torch_musa wheel for this torch (torch_musa 2.7.1 needs torch 2.7.1)"
    visible_devices = ("MUSA_VISIBLE_DEVICES",)
    device_tool = "mthreads-gmi"
    unscale_dtypes = (torch.float32, torch.float16, torch.float64)
    #: torch_musa's autocast registers torch's macros and bans binary_cross_entropy (csrc/amp/autocast_mode.cpp)
    autocast_lists = autocast_lists.CUDA.changed("torch_musa 2.7.1 csrc/amp/autocast_mode.cpp (torch's macros)")
    #: Read from torch_musa 2.7.1's source (not run on MUSA hardware): it refuses torch's fused Adam and
    #: AdamW with a TORCH_CHECK (csrc/aten/ops/FusedAdam.cpp); its _fused_sgd_ kernel returns when
    #: found_inf is 1 and divides by grad_scale (csrc/aten/ops/musa/FusedSgdKernel.mu); it registers no
    #: _fused_adagrad_ (csrc/aten/ops/musa_functions.yaml) and has no CPU fallback, so fused Adagrad
    #: raises NotImplementedError.
    fused_found_inf = {
        "adam": (REFUSED, "torch_musa refuses torch.optim.Adam(fused=True) (csrc/aten/ops/FusedAdam.cpp): use "
                          "torch_musa.optim.FusedAdam, or fused=False"),
        "adamw": (REFUSED, "torch_musa refuses torch.optim.AdamW(fused=True) (csrc/aten/ops/FusedAdam.cpp): use "
                           "torch_musa.optim.FusedAdamW, or fused=False"),
        "sgd": (HONOURS, "torch_musa's _fused_sgd_ kernel skips when found_inf is 1 and divides by grad_scale "
                         "(csrc/aten/ops/musa/FusedSgdKernel.mu)"),
        "adagrad": (ABSENT, "torch_musa registers no _fused_adagrad_ (csrc/aten/ops/musa_functions.yaml) and has no "
                            "CPU fallback: use Adagrad(fused=False)"),
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

    def fp8_dtypes(self) -> tuple[torch.dtype, ...]:
        """torch_musa's ``_scaled_mm`` (``csrc/aten/ops/musa_functions.yaml``; ``Matmul.cpp``
        ``ScaledMatmulOut``) runs from compute capability 3.1 (MP31): any float8 operands, float32
        scales of one element or one per row of mat1 / column of mat2. Read from torch_musa 2.7.1's
        source; not run on MUSA hardware."""
        module = self._load()
        if module is None or not self.is_available() or self._capability(module) < FP8_CAPABILITY:
            return ()
        return (torch.float8_e4m3fn, torch.float8_e5m2)

    def fp8_unavailable_reason(self) -> str | None:
        module = self._load()
        if module is None or not self.is_available() or self.fp8_dtypes():
            return None
        major, minor = self._capability(module)
        return (f"has no fp8 matmul: compute capability {major}.{minor}; torch_musa's _scaled_mm needs 3.1 (MP31) "
                "and refuses below (csrc/aten/ops/Matmul.cpp ScaledMatmulOut)")

    @staticmethod
    def _capability(module: Any) -> tuple[int, int]:
        query = getattr(module, "get_device_capability", None)
        return tuple(query()) if callable(query) else (0, 0)


@hookimpl
def amp_backends_register_backends(register) -> None:
    register(MUSABackend())
