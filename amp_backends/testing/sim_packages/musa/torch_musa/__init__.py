"""A simulated Moore Threads torch_musa 2.7.1, on the simulated PrivateUse1 device (testing only).

What it keeps of the real torch_musa: PrivateUse1 renamed "musa", ``torch.musa`` the device
module, collectives on MCCL; ``core/device.py`` ``is_bf16_supported(including_emulation=True)``:
true from compute capability 2.2 (``AMP_SIM_MUSA_CAPABILITY``, default ``2.2``), below it true if a
bf16 tensor can be made on the device (``AMP_SIM_MUSA_BF16_TENSOR=0``: it cannot), and
``get_amp_supported_dtype`` lists bf16 only when that holds; the unscale op is CUDA's (float, double and half,
no bf16); ``core/amp/grad_scaler.py``'s GradScaler is ``torch.amp.GradScaler(device="musa")``;
autocast follows torch's (CUDA's) lists; ``csrc/aten/ops/FusedAdam.cpp``: torch's fused Adam and
AdamW are refused with a TORCH_CHECK naming torch_musa's own optimizers, ``_fused_sgd_`` is
torch's kernel (``musa/FusedSgdKernel.mu``: it returns when found_inf is 1). Release 2.7.1, built
for torch 2.7.1.
"""

from __future__ import annotations

import os

import torch

from amp_backends.testing import simdevice

_CAPABILITY = tuple(int(x) for x in os.environ.get("AMP_SIM_MUSA_CAPABILITY", "2.2").split("."))


#: Whether a bf16 tensor can be made on the device (``AMP_SIM_MUSA_BF16_TENSOR=0``: it cannot).
_BF16_TENSOR = os.environ.get("AMP_SIM_MUSA_BF16_TENSOR", "1") != "0"


class _MUSAModule(simdevice._DeviceModule):
    def get_device_capability(self, device: object = None) -> tuple[int, int]:
        return _CAPABILITY  # type: ignore[return-value]

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        """``core/device.py``: native from capability 2.2; below it, with emulation counted (the
        default), whether a bf16 tensor can be made on the device."""
        if _CAPABILITY >= (2, 2):
            return True
        return including_emulation and _BF16_TENSOR

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        """bf16 listed only where ``is_bf16_supported()`` holds."""
        return [torch.float16, torch.bfloat16] if self.is_bf16_supported() else [torch.float16]


musa = simdevice.install(
    "musa",
    bf16=_CAPABILITY >= (2, 2),
    device_count=1,
    unscale_dtypes=(torch.float32, torch.float16, torch.float64),
    unscale_message='"_amp_foreach_non_finite_check_and_unscale_musa" not implemented for \'{dtype}\'',
    module_class=_MUSAModule,
    kernels={
        **{f"_fused_adam_{o}": simdevice.refusing(
            "torch.optim.Adam(fused=True) is not supported, try torch_musa.optim.FusedAdam instead")
           for o in ("", ".tensor_lr")},
        **{f"_fused_adamw_{o}": simdevice.refusing(
            "torch.optim.AdamW(fused=True) is not supported, try torch_musa.optim.FusedAdamW instead")
           for o in ("", ".tensor_lr")},
    },
)


class _GradScaler(torch.amp.GradScaler):
    """``torch_musa.core.amp.GradScaler``: torch's scaler on "musa"."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__("musa", *args, **kwargs)


class _Amp:
    GradScaler = _GradScaler


musa.amp = _Amp()  # type: ignore[attr-defined]
__version__ = "2.7.1"
