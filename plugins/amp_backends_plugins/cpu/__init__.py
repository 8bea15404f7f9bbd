"""CPU backend: bf16 autocast by default (fp16 too), torch's CPU unscale kernel, Gloo."""

from __future__ import annotations

import torch

from amp_backends import Backend, hookimpl


class CPUBackend(Backend):
    """Mixed precision on the CPU through ``torch.autocast("cpu")``."""

    name = "cpu"
    device_type = "cpu"
    default_dtype = torch.bfloat16
    dist_backend = "gloo"
    priority = 0

    def is_available(self) -> bool:
        return True

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16)


@hookimpl
def amp_backends_register_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(CPUBackend())
