"""CUDA backend (NVIDIA, and AMD through ROCm builds of torch): fp16 by default, bf16 where supported, NCCL."""

from __future__ import annotations

import os

import torch

from amp_backends import Backend, hookimpl


class CUDABackend(Backend):
    """Mixed precision on CUDA devices through ``torch.autocast("cuda")``."""

    name = "cuda"
    device_type = "cuda"
    default_dtype = torch.float16
    dist_backend = "nccl"
    priority = 100
    #: torch's CUDA unscale op (aten/src/ATen/native/cuda/AmpKernels.cu) dispatches on float,
    #: double and half only: bf16 gradients go through a float32 copy unless the kernel (Triton)
    #: handles them itself.
    unscale_dtypes = (torch.float32, torch.float16, torch.float64)

    def is_available(self) -> bool:
        return self.unavailable_reason() is None

    def unavailable_reason(self) -> str | None:
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return (
                f"torch was built without CUDA (torch {torch.__version__} is a CPU build); "
                "install a CUDA build of torch to use NVIDIA GPUs"
            )
        try:
            count = torch.cuda.device_count()
        except Exception as exc:  # noqa: BLE001 - a broken driver is a reason, not a crash
            return f"the CUDA runtime failed to start: {type(exc).__name__}: {exc}"
        if count == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={visible!r} hides the others)" if visible is not None else ""
            return f"no CUDA device visible: the driver reports 0 devices{hint}"
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False although devices are counted; check the driver"
        return None

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        if not self.is_available():
            return (torch.float16,)
        try:
            bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # torch < 2.5 has no including_emulation
            bf16 = torch.cuda.is_bf16_supported()
        return (torch.float16, torch.bfloat16) if bf16 else (torch.float16,)

    def native_dtypes(self) -> tuple[torch.dtype, ...]:
        supported = self.supported_dtypes()
        if torch.bfloat16 not in supported or getattr(torch.version, "hip", None):
            return supported
        major, _ = torch.cuda.get_device_capability()
        return supported if major >= 8 else (torch.float16,)  # bf16 tensor cores from Ampere (8.0)

    def emulation_reason(self, dtype: torch.dtype) -> str:
        major, minor = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}) has no bf16 tensor cores (8.0+)"


@hookimpl
def amp_backends_register_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(CUDABackend())
