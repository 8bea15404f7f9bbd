"""The MXFP8 layer a precision policy installs: torchao's ``MXFP8Linear`` holding a Linear's own
parameters, on any device's autocast.

torchao's ``MXFP8Linear.forward`` runs ``mx_mm`` (its three matmuls in MXFP8) and adds the bias; it
does nothing about autocast. Here, as torchao's float8 layer does on CUDA: under the input's device's
autocast the input is cast to the autocast dtype (what a Linear's matmul would take), torchao's forward
runs with autocast off, and the output is in the autocast dtype. The weight is cast from its own
dtype (the float32 master weights), as torchao's real path does. Emulated (``KernelPreference.EMULATED``)
the casts are torchao's ``to_mx`` and the matmul runs on the dequantized operands in the weight's dtype
(float32: the autocast-dtype input widened exactly), then is rounded to the autocast dtype; the real
kernels (``torch._scaled_mm`` with e8m0 scales) take the autocast-dtype input and return bfloat16.
Emulated, the layer runs eagerly inside a compiled model (``torch.compiler.disable``): torchao does not
support compiling its emulated path, and compiled its casts give other values. torchao's ``to_mx``
takes contiguous tensors only (a bare ``AssertionError: unsupported`` otherwise): the input is made
contiguous, and a non-contiguous weight (a Parameter made from a transpose) is passed on as a
contiguous copy that autograd differentiates back to the parameter. Importing this module imports
torchao (:func:`amp_backends.precision.fp8.engine.mx_layer_class`).
"""

from __future__ import annotations

import torch
from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear, _to_mxfp8_then_scaled_mm
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.quantization.quantize_.common import KernelPreference

from .mx import MxConfig, tokens_reason

__all__ = ["MxLinear"]

_HP = (torch.float32, torch.bfloat16)


class MxLinear(MXFP8Linear):
    """torchao's ``MXFP8Linear`` with the autocast dtype taken from the input's device, built around an
    existing Linear's parameters (:meth:`from_linear`)."""

    is_fp8 = True
    fp8_recipe = "mxfp8"
    config: MxConfig

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, config: MxConfig) -> MxLinear:
        """An MX layer holding ``linear``'s own ``weight`` and ``bias`` (the same parameter objects)."""
        kernel = KernelPreference.EMULATED if config.emulate else KernelPreference.AUTO
        with torch.device("meta"):
            layer = cls(linear.in_features, linear.out_features, bias=False, kernel_preference=kernel,
                        scale_calculation_mode=ScaleCalculationMode.RCEIL, wgrad_with_hp=config.wgrad_with_hp)
        layer.weight = linear.weight
        layer.bias = linear.bias
        layer.config = config
        layer.fp8_recipe = config.recipe
        layer.train(linear.training)
        return layer

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.kernel_preference == KernelPreference.EMULATED:
            return _eager(self, input)  # torchao does not support compiling its emulated MX path
        return self._forward(input)

    def _forward(self, input: torch.Tensor) -> torch.Tensor:
        device_type = input.device.type
        low = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        x = input if low is None else input.to(low)
        if self.kernel_preference == KernelPreference.EMULATED:
            x = x.to(self.weight.dtype)  # the emulated matmul multiplies both dequantized operands in one dtype
        elif x.dtype not in _HP:
            x = x.float()  # torchao's casts take float32 or bfloat16; float16 widens exactly
        x = x.contiguous()  # torchao's to_mx asserts a contiguous tensor
        if torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad):
            why = tokens_reason(x.numel() // max(1, x.shape[-1]), self.config.recipe)
            if why is not None:
                raise ValueError(f"MXFP8 layer ({self.in_features} -> {self.out_features}): {why}")
        if low is None:
            return self._mm(x)
        with torch.autocast(device_type, enabled=False):
            out = self._mm(x)
        return out.to(low)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        """torchao's forward; with a non-contiguous weight, the same on a contiguous copy of it (torchao's
        layer casts ``self.weight`` as it is, and ``to_mx`` refuses strided tensors)."""
        if self.weight.is_contiguous():
            return super().forward(x)
        out = _to_mxfp8_then_scaled_mm(x, self.weight.contiguous(), kernel_preference=self.kernel_preference,
                                       scale_calculation_mode=self.scale_calculation_mode,
                                       wgrad_with_hp=self.wgrad_with_hp)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        emulated = ", emulated" if self.config.emulate else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={self.config.recipe}{emulated}")


@torch.compiler.disable
def _eager(layer: MxLinear, input: torch.Tensor) -> torch.Tensor:
    """The emulated layer's forward, run eagerly inside a compiled model: compiled, torchao 0.18's
    emulated casts give other values than eager (its tests skip compiling the emulated recipe)."""
    return layer._forward(input)
