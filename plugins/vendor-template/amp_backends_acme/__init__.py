"""amp-backends backend for the ACME accelerator (a template: it runs on the CPU).

For a real device: set ``device_type`` to the name your PyTorch extension registers
(``torch.utils.rename_privateuse1_backend("acme")``), import that extension inside
``unavailable_reason`` (never at module import), and say why it is unavailable.
"""

from __future__ import annotations

import torch

import amp_backends
from amp_backends.devices import autocast_lists


class AcmeBackend(amp_backends.Backend):
    name = "acme"
    device_type = "cpu"  # your device type, e.g. "acme"
    default_dtype = torch.bfloat16
    dist_backend = "gloo"  # your collective library's process-group backend
    # get() picks the available backend with the highest priority: the built-in accelerators
    # (cuda, mlu, npu, musa) use 100 and cpu 0. Installed, this template would win over cpu; give a
    # real device 100, and keep a backend that runs on the CPU below 0 so that cpu stays the choice.
    priority = -10
    # what your autocast does with each op (lowered, float32, promoted, refused): torch's CUDA lists unless
    # declared; write yours as CUDA's with changes, e.g. autocast_lists.CUDA.changed("torch_acme's
    # autocast_mode.cpp", fp32=...). The conformance suite runs every module under your autocast against
    # them. This template's autocast is the CPU's.
    autocast_lists = autocast_lists.CPU
    # what your fused optimizer kernels do with grad_scale and found_inf, per kind, citing your source, e.g.
    # fused_found_inf = {"adamw": ("honours", "torch_acme's FusedAdamW.cpp skips and divides")}; undeclared kinds
    # are probed on the device. Optional capabilities are mixins: a device-wide overflow register is
    # class AcmeBackend(amp_backends.OverflowStatus, amp_backends.Backend) with its two methods.

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
def amp_backends_register_backends(register) -> None:  # type: ignore[no-untyped-def]  # pluggy's register callable is untyped
    register(AcmeBackend())
