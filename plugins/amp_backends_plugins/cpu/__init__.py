"""CPU backend: bf16 autocast by default (fp16 too), torch's CPU unscale kernel, Gloo.

Which of them run natively depends on the CPU (AVX512-BF16/AMX on x86, BF16 on aarch64):
see :mod:`amp_backends.devices.hardware`.
"""

from __future__ import annotations

import torch

from amp_backends import Backend, hookimpl
from amp_backends.devices import collectives as collective_libraries
from amp_backends.devices import autocast_lists
from amp_backends.devices.fused import HONOURS
from amp_backends.devices.hardware import cpu_native_dtypes, cpu_summary, missing_cpu_features, onednn_blocker


class CPUBackend(Backend):
    """Mixed precision on the CPU through ``torch.autocast("cpu")``."""

    name = "cpu"
    device_type = "cpu"
    default_dtype = torch.bfloat16
    dist_backend = "gloo"
    collectives = collective_libraries.GLOO  # gloo's dtypes and ops (amp_backends/devices/collectives.py)
    priority = 0
    #: torch's CPU lists (aten/src/ATen/autocast_mode.cpp, CPU block): norms and softmax in their input's
    #: dtype, binary_cross_entropy in float32 (not banned)
    autocast_lists = autocast_lists.CPU
    #: torch's CPU kernels (aten/src/ATen/native/FusedAdam.cpp, FusedSGD.cpp, FusedAdagrad.cpp) return
    #: when found_inf is 1 and divide each gradient by grad_scale (cpu/FusedAdamKernel.cpp,
    #: cpu/FusedSGDKernel.cpp, cpu/FusedAdagradKernel.cpp ``adagrad_math``); fused Adagrad on the CPU
    #: since pytorch PR 124905 (torch 2.4). Read from torch's source; the conformance suite checks each
    #: here (tests run on the CPU).
    fused_found_inf = {
        **{kind: (HONOURS, "torch's CPU fused kernels skip when found_inf is 1 and divide by grad_scale "
                           "(aten/src/ATen/native/cpu/FusedAdamKernel.cpp, FusedSGDKernel.cpp)")
           for kind in ("adam", "adamw", "sgd")},
        "adagrad": (HONOURS, "torch's CPU _fused_adagrad_ returns when found_inf is 1 (aten/src/ATen/native/"
                             "FusedAdagrad.cpp) and divides by grad_scale (cpu/FusedAdagradKernel.cpp adagrad_math)"),
    }

    def unavailable_reason(self) -> str | None:
        return None  # every machine has a CPU

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16)

    def native_dtypes(self) -> tuple[torch.dtype, ...]:
        native = cpu_native_dtypes()
        return tuple(d for d in self.supported_dtypes() if d in native)

    def emulation_reason(self, dtype: torch.dtype) -> str:
        blocked = onednn_blocker(dtype)
        if blocked is not None:
            return blocked
        wanted = " or ".join(f.upper() for f in missing_cpu_features(dtype)) or "native support"
        return f"this CPU ({cpu_summary()}) lacks {wanted}"


@hookimpl
def amp_backends_register_backends(register) -> None:
    register(CPUBackend())
