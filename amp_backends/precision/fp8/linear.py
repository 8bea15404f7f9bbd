"""The fp8 layer a precision policy installs: torchao's ``Float8Linear`` on any device's autocast.

torchao's ``Float8Linear.forward`` casts its input to the autocast dtype of CUDA alone
(``torch.is_autocast_enabled()``, ``get_autocast_gpu_dtype()``); on another device under autocast
the input stays float32 while autocast lowers some of the emulated matmuls, and the recipe that keeps
the weight gradient in high precision fails in its backward with mixed dtypes. This subclass does
what torchao does on CUDA for the input's own device type, then runs torchao's forward with that
device's autocast off (the output is in the autocast dtype, as a Linear's is). It takes what a Linear
takes: a non-contiguous input is made contiguous first (torchao's axiswise casts refuse to copy a
strided 3-D input: "aten.clone.default with axiswise scaling is not supported yet"), and a batch of
no tokens, which has no amax to scale by, runs as the plain matmul (an empty output, zero weight
gradient). Importing it imports torchao (``amp_backends.precision.fp8.engine.engine``).
"""

from __future__ import annotations

import torch

from .engine import engine, plain_weight

__all__ = ["Fp8Linear"]

_Float8Linear = engine().float8_linear.Float8Linear


class Fp8Linear(_Float8Linear):  # type: ignore[misc, valid-type]  # torchao's class is Any where torchao is not installed
    """``Float8Linear`` with the autocast dtype taken from the input's device."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.numel() == 0:
            # torchao's amax over no values raises; the product of an empty batch is empty either way
            return torch.nn.functional.linear(input, plain_weight(self.weight), self.bias)
        input = input.contiguous()  # torchao's rowwise casts cannot copy a strided input themselves
        device_type = input.device.type
        if device_type == "cuda" or not torch.is_autocast_enabled(device_type):
            return super().forward(input)  # torchao's own path: CUDA autocast, or no autocast at all
        input = input.to(torch.get_autocast_dtype(device_type))
        with torch.autocast(device_type, enabled=False):
            return super().forward(input)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        # fp8 all-gather wraps the weight in torchao's cast-on-all-gather subclass; a checkpoint holds
        # the plain tensor under the same key, as a bf16 or float32 run's does.
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in ("weight", "bias"):
            if prefix + name in destination:
                value = destination[prefix + name]
                inner = plain_weight(value)
                if inner is not value:
                    destination[prefix + name] = inner if keep_vars else inner.detach()
