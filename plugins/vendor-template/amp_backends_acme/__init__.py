"""amp-backends backend for the ACME accelerator (a template: it runs on the CPU).

For a real device: set ``device_type`` to the name your PyTorch extension registers
(``torch.utils.rename_privateuse1_backend("acme")``), import that extension inside
``unavailable_reason`` (never at module import), and say why it is unavailable.
"""

from __future__ import annotations

import torch

import amp_backends


class AcmeBackend(amp_backends.Backend):
    name = "acme"
    device_type = "cpu"  # your device type, e.g. "acme"
    default_dtype = torch.bfloat16
    dist_backend = "gloo"  # your collective library's process-group backend
    # get() picks the available backend with the highest priority: the built-in accelerators
    # (cuda, mlu, npu, musa) use 100 and cpu 0. Installed, this template would win over cpu; give a
    # real device 100, and keep a backend that runs on the CPU below 0 so that cpu stays the choice.
    priority = -10

    def unavailable_reason(self) -> str | None:
        # the one availability probe: None where the device can be used, else why not
        # e.g.: if importlib.util.find_spec("torch_acme") is None: return "torch_acme is not installed"
        return None

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16)

    def native_dtypes(self) -> tuple[torch.dtype, ...]:
        # the dtypes your chip's math units run (emulated ones make autocast warn and info say so);
        # this template computes on the CPU, so it reports what the cpu backend found on this CPU
        return amp_backends.get("cpu").native_dtypes()


@amp_backends.hookimpl
def amp_backends_register_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(AcmeBackend())
