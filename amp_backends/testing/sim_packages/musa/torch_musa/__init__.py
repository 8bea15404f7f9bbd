"""A simulated Moore Threads torch_musa 2.7.1, on the simulated PrivateUse1 device (testing only).

What it keeps of the real torch_musa: PrivateUse1 renamed "musa", ``torch.musa`` the device
module, collectives on MCCL; ``core/device.py`` ``is_bf16_supported(including_emulation=True)``:
true from compute capability 2.2 (``AMP_SIM_MUSA_CAPABILITY``, default ``2.2``), below it true if a
bf16 tensor can be made on the device (``AMP_SIM_MUSA_BF16_TENSOR=0``: it cannot), and
``get_amp_supported_dtype`` lists bf16 only when that holds; the unscale op is CUDA's (float, double and half,
no bf16); ``core/amp/grad_scaler.py``'s GradScaler is ``torch.amp.GradScaler(device="musa")``;
autocast follows torch's (CUDA's) lists; ``csrc/aten/ops/FusedAdam.cpp``: torch's fused Adam and
AdamW are refused with a TORCH_CHECK naming torch_musa's own optimizers, ``_fused_sgd_`` is
torch's kernel (``musa/FusedSgdKernel.mu``: it returns when found_inf is 1, and divides by
grad_scale); no ``_fused_adagrad_`` (``csrc/aten/ops/musa_functions.yaml``) and no CPU fallback, so
fused Adagrad raises NotImplementedError; ``_scaled_mm`` (``csrc/aten/ops/Matmul.cpp``
``ScaledMatmulOut``) refused below MUSA arch 3.1 (``AMP_SIM_MUSA_CAPABILITY=3.1`` for an MP31 chip),
with its checks: float8 operands, float32 scales of one element or one per row of mat1 / column
of mat2, its bias rule. Release 2.7.1, built for torch 2.7.1.
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


def _scaled_mm_checks(mat1, mat2, scale_a, scale_b, bias, scale_result, out_dtype):  # type: ignore[no-untyped-def]
    """``ScaledMatmulOut``'s checks (``csrc/aten/ops/Matmul.cpp``), in its order and words; the output dtype."""
    if _CAPABILITY[0] * 100 + _CAPABILITY[1] * 10 < 310:  # at::musa::getMUSAArch()
        raise RuntimeError("scaled_gemm is only supported for MUSA_ARCH >= 310")
    if mat1.dim() != 2 or mat2.dim() != 2:
        raise RuntimeError(f"{'mat1' if mat1.dim() != 2 else 'mat2'} must be a matrix")
    if mat1.shape[1] != mat2.shape[0]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({mat1.shape[0]}x{mat1.shape[1]} and "
                           f"{mat2.shape[0]}x{mat2.shape[1]})")
    for name, scale, n in (("scale_a", scale_a, mat1.shape[0]), ("scale_b", scale_b, mat2.shape[1])):
        if scale.numel() not in (1, n) or scale.dtype != torch.float32:
            raise RuntimeError(f"{name} must be float scalar or float tensor of shape {n} but got {scale.numel()}")
    if scale_result is not None and (scale_result.numel() not in (1, mat1.shape[0])
                                     or scale_result.dtype != torch.float32):
        raise RuntimeError(f"scale_result must be float scalar or float tensor of shape {mat1.shape[0]} but got "
                           f"{scale_result.numel()}")
    if bias is not None and bias.numel() != mat2.shape[1]:
        raise RuntimeError(f"Bias must be size {mat2.shape[1]} but got {bias.numel()}")
    for name, mat in (("mat1", mat1), ("mat2", mat2)):
        if mat.dtype not in _FLOAT8:
            raise RuntimeError(f"Expected {name} to be Float8 matrix got {mat.dtype}")
    out = out_dtype or mat1.dtype
    if bias is not None and not ((out == torch.float32 and bias.dtype == torch.float32) or
                                 (out != torch.float32 and bias.dtype in (torch.bfloat16, torch.float16))):
        raise RuntimeError(f"Wrong bias dtype: {bias.dtype}which doesn't match out dtype: {out}")
    return out


_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                if hasattr(torch, n))


def _scaled_mm(mat_a, mat_b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,  # type: ignore[no-untyped-def]
               use_fast_accum=False):
    out = _scaled_mm_checks(mat_a, mat_b, scale_a, scale_b, bias, scale_result, out_dtype)
    return simdevice.scaled_matmul(mat_a, mat_b, scale_a, scale_b, bias, out)


def _scaled_mm_out(mat_a, mat_b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,  # type: ignore[no-untyped-def]
                   use_fast_accum=False, *, out):
    if out_dtype is not None and out_dtype != out.dtype:
        raise RuntimeError("out_dtype must match output matrix type")
    _scaled_mm_checks(mat_a, mat_b, scale_a, scale_b, bias, scale_result, out.dtype)
    result = simdevice.scaled_matmul(mat_a, mat_b, scale_a, scale_b, bias, out.dtype)
    simdevice.raw_of(out).resize_(result.shape).copy_(simdevice.raw_of(result))
    return out


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
        **{q: simdevice.absent(q) for q in ("_fused_adagrad_", "_fused_adagrad_.tensor_lr")},
        "_scaled_mm": _scaled_mm,
        "_scaled_mm.out": _scaled_mm_out,
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
