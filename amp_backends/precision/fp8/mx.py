"""MXFP8 training for chosen Linear layers: torchao's MX layer as the engine, the device's declaration,
and which layers it can take (loading the layer: :func:`.engine.mx_layer_class`).

MXFP8 (OCP microscaling) stores each matmul operand in float8_e4m3fn with one power-of-two scale
(e8m0) per block of 32 values along the matmul's reduction dimension, the scale rounded up from the
block's maximum (RCEIL, cuBLAS's rule). torchao 0.18 trains Linear layers in it with
``torchao.prototype.moe_training.mxfp8_linear.MXFP8Linear``; the policy installs a subclass holding
the Linear's own parameters (:mod:`.mx_linear`), not ``quantize_``'s weight wrapper, which in torchao
0.18 drops the layer's bias (pytorch/ao#4846) and replaces the parameter objects.

Recipes: ``"mxfp8"`` (the three matmuls of a Linear in MXFP8) and ``"mxfp8_with_gw_hp"`` (the weight
gradient in high precision, torchao's ``wgrad_with_hp``). Shapes: in and out features multiples of 32,
and for ``"mxfp8"`` the tokens of a batch (the input's leading dimensions) too, since the weight
gradient casts along them.
"""

from __future__ import annotations

from torch import nn

__all__ = ["MX_ALIGN", "MX_HARDWARE", "MX_RECIPES", "MxConfig", "shape_reason", "tokens_reason"]

#: The policy's MX recipes: all three matmuls in MXFP8, or the weight gradient in high precision.
MX_RECIPES = ("mxfp8", "mxfp8_with_gw_hp")
#: MX blocks: 32 values share one scale, along each matmul's reduction dimension.
MX_ALIGN = 32
#: Where MXFP8 training runs natively, as the backends declare it (docs/precision.md: the sources).
MX_HARDWARE = ("NVIDIA GPUs of compute capability 10.x (B200, GB200, B300) with CUDA 12.8+, where torchao's MX "
               "cast kernels load (torch's MX matmul, _scaled_mm with e8m0 block scales, needs 10.0+); AMD Instinct "
               "MI350/MI355 (gfx950) only with a torchao whose MXFP8 layer casts on ROCm (0.18's does not)")


class MxConfig:
    """What the MX layer needs: the recipe, emulated or not."""

    def __init__(self, recipe: str, emulate: bool) -> None:
        self.recipe, self.emulate = recipe, bool(emulate)
        self.wgrad_with_hp = recipe == "mxfp8_with_gw_hp"

    def __repr__(self) -> str:
        return f"MxConfig(recipe={self.recipe!r}, emulate={self.emulate})"


def shape_reason(module: nn.Module, recipe: str) -> str | None:
    """Why ``module`` (a Linear the fp8 layer could take) cannot train in ``recipe``'s MX format, or None."""
    import torch

    n, k = module.weight.shape
    if n % MX_ALIGN or k % MX_ALIGN:
        return (f"in_features={k}, out_features={n}: MXFP8 casts in blocks of {MX_ALIGN} along both, so both must "
                f"be multiples of {MX_ALIGN}")
    if module.weight.dtype not in (torch.float32, torch.bfloat16):
        return (f"its weight is {str(module.weight.dtype).replace('torch.', '')}: torchao's MX casts take float32 or "
                "bfloat16 (to_mx); keep the weights in float32 and train under autocast")
    return None


def tokens_reason(tokens: int, recipe: str) -> str | None:
    """Why a batch of ``tokens`` rows (the input's leading dimensions flattened) cannot train in
    ``recipe``: the weight gradient casts along the tokens in blocks of 32, unless in high precision."""
    if recipe == "mxfp8" and tokens % MX_ALIGN:
        return (f"{tokens} tokens (the input's leading dimensions): MXFP8's weight-gradient matmul casts along them "
                f"in blocks of {MX_ALIGN}; use a batch whose tokens are a multiple of {MX_ALIGN}, or "
                "fp8_recipe='mxfp8_with_gw_hp' (the weight gradient in high precision)")
    return None
