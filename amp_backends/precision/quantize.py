"""Each format's quantization of one matmul operand, computed as torchao computes it, in plain torch
ops on the tensor's own device (no float8 dtype needed, no host read), with the figures the statistics
keep.

- tensorwise and rowwise (``torchao.float8.float8_utils``): ``amax = max|x|`` (per tensor, or per row
  along the reduction axis) in the tensor's dtype; ``scale = fmax / max(amax, 1e-12)`` rounded to
  float32 (``amax_to_scale``, which divides in float64: float32's correctly rounded quotient, a true
  float32 division of two tensors, is the same number, since 53 >= 2*24 + 2 makes the double rounding
  innocuous; ``fmax / amax`` with a Python float would be a reciprocal then a product, two
  roundings, and a subnormal reciprocal above 2**126), floored to a power of two
  for the rowwise recipes (``_round_scale_down_to_power_of_2``); ``q = fp8(clamp(x * scale, +-fmax))``
  (``to_fp8_saturated``, round to nearest even); dequantized ``q / scale`` (the emulated matmul's).
- MXFP8 RCEIL (``torchao.prototype.mx_formats.mx_tensor._to_mx_rceil``): per block of 32 along the
  reduction axis, ``e = clamp(ceil(log2(amax / 448)), -127, 127) + 127``, the multiplier
  ``2**(127 - e)`` (1 where ``e == 0``), ``q = e4m3(clamp(x * mult, +-448))``, dequantized
  ``q * 2**(e - 127)`` (``get_fp_scale``).
- bf16, fp16, fp32: the cast.

The rounding to an fp8 grid is torch's float8 cast on CPUs and CUDA GPUs, and elsewhere integer and
float32 arithmetic (:func:`round_fp8`, exact: the quantum is a power of two read from the value's
exponent bits), for devices without float8 casts; both are tested bitwise against
``Tensor.to(torch.float8_e4m3fn)`` and the whole quantizers against torchao's.

The figures, per operand and format: ``numel``; ``underflow``, values not zero that quantize to zero;
``overflow``, values beyond the format's range before saturation (fp8, MX: ``|x * scale|`` past the
format's rounding boundary, where the cast without saturation leaves the format: above 464 for
e4m3, from 61440 for e5m2; a value that only rounds to the largest one, such as 448.00003, is not
counted; bf16, fp16: a finite value that becomes inf); ``sse``, the sum of squared errors of the
dequantized values (``mse = sse / numel``, TransformerEngine's ``mse``); ``sum_sq``, the sum of squares
of the values (relative error ``sqrt(sse / sum_sq)``), both divided by ``norm**2``, ``norm`` the power of
two at or below ``amax`` (float32 squares of values below 1e-19 underflow and above 1e19 overflow;
the reader multiplies back in float64); ``amax``; the smallest and largest dequantization scale
(value = q * scale: the reciprocal of torchao's float8 ``scale``, MX's ``2**(e - 127)``; 1 for
casts), TransformerEngine's ``scale_inv``; and ``norm``.
"""

from __future__ import annotations

import math
from typing import cast

import torch

from .formats import Spec

__all__ = ["FP8", "amax_to_scale", "beyond", "figures", "qdq", "round_fp8"]

#: fp8 element formats: (largest value, mantissa bits, smallest normal exponent)
FP8 = {"e4m3": (448.0, 3, -6), "e5m2": (57344.0, 2, -14)}
_EPS = 1e-12  # torchao.float8.float8_utils.EPS
MX_BLOCK = 32


def _eps_threshold() -> float:
    """The smallest float32 at or above torchao's EPS (1e-12, a float64): amax below it is clamped."""
    t = torch.tensor(_EPS, dtype=torch.float64).float()
    if float(t) < _EPS:
        t = torch.nextafter(t, torch.tensor(float("inf")))
    return float(t)


_EPS32 = _eps_threshold()
#: fmax / EPS rounded to float32, torchao's scale for an all-zero tensor
_ZERO_SCALE = {name: float(torch.tensor(fmax / _EPS, dtype=torch.float64).float()) for name, (fmax, _, _) in FP8.items()}


def round_fp8(y: torch.Tensor, element: str) -> torch.Tensor:
    """``y`` (float32, within the element format's range) rounded to the nearest ``element`` value,
    ties to even: ``y.to(float8).float()`` without a float8 dtype."""
    _, mbits, emin = FP8[element]
    a = y.abs()
    exponent = torch.clamp((a.view(torch.int32) >> 23) - 127, min=emin)  # a >= 0: no sign bit
    quantum = ((exponent - mbits + 127) << 23).view(torch.float32)  # 2**(exponent - mbits), exactly
    return torch.copysign(torch.round(a / quantum) * quantum, y)


#: Device types whose float8 casts are used for the rounding (the same values, one pass); others
#: round with :func:`round_fp8`.
_NATIVE_FP8 = ("cpu", "cuda")


def _to_grid(y: torch.Tensor, element: str) -> torch.Tensor:
    """``y`` rounded to the ``element`` grid: torch's float8 cast where the device has it, else :func:`round_fp8`."""
    dtype = getattr(torch, "float8_e4m3fn" if element == "e4m3" else "float8_e5m2", None)
    if dtype is not None and y.device.type in _NATIVE_FP8:
        return y.to(dtype).float()
    return round_fp8(y, element)


def _boundary(element: str) -> tuple[float, bool]:
    """Where ``element``'s cast without saturation leaves the format: halfway between its largest value
    and the next step, and whether the halfway point itself does (a tie rounds to the even mantissa:
    448 is even, so 464 rounds to 448; 57344 is odd, so 61440 rounds up, to inf)."""
    fmax, mbits, _ = FP8[element]
    step = 2.0 ** (math.floor(math.log2(fmax)) - mbits)
    return fmax + step / 2, int(fmax / step) % 2 == 1


#: per element format: (rounding boundary, whether the boundary itself overflows)
_BOUNDARY = {name: _boundary(name) for name in FP8}


def beyond(y: torch.Tensor, element: str) -> torch.Tensor:
    """Where ``y`` (scaled, before saturation) is out of ``element``'s range: the values the cast
    without saturation would make inf or NaN, not those that merely round to the largest value."""
    bound, inclusive = _BOUNDARY[element]
    a = y.abs()
    return a >= bound if inclusive else a > bound


def amax_to_scale(amax: torch.Tensor, element: str, pow2: bool) -> torch.Tensor:
    """torchao's ``amax_to_scale``, bitwise: ``fmax / max(amax, 1e-12)`` rounded once to float32, floored
    to a power of two where ``pow2``."""
    fmax = FP8[element][0]
    amax = amax.float()
    # a true division of two float32 tensors, rounded once like torchao's float64 quotient cast to
    # float32; a Python-float numerator would make torch multiply by the reciprocal (two roundings)
    quotient = torch.full_like(amax, fmax) / amax
    scale = torch.where(amax < _EPS32, torch.full_like(amax, _ZERO_SCALE[element]), quotient)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def _scaled(x: torch.Tensor, spec: Spec, axis: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dequantized float32, overflow mask, dequantization scales) of tensorwise or rowwise fp8."""
    fmax = FP8[spec.element][0]
    amax = x.abs().amax() if spec.kind == "tensorwise" else x.abs().amax(dim=axis, keepdim=True)
    scale = amax_to_scale(amax, spec.element, spec.pow2)
    y = x.float() * scale
    q = _to_grid(torch.clamp(y, -fmax, fmax), spec.element)
    return q / scale, beyond(y, cast(str, spec.element)), 1.0 / scale


def _mx(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dequantized float32, overflow mask, dequantization scales) of MXFP8 RCEIL along ``axis``; the
    dequantized values and mask in ``x``'s layout."""
    fmax = FP8["e4m3"][0]
    rows = x if axis in (-1, x.dim() - 1) else x.t().contiguous()
    blocks = rows.reshape(rows.shape[0], -1, MX_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True).float()
    exponent = torch.clamp(torch.ceil(torch.log2(amax / fmax)), min=-127, max=127) + 127
    mult = torch.where(exponent == 0, torch.ones_like(exponent), torch.exp2(127 - exponent))
    y = blocks.float() * mult
    q = _to_grid(torch.clamp(y, -fmax, fmax), "e4m3")
    scale = torch.pow(torch.full_like(exponent, 2.0), exponent - 127)
    deq, over = (q * scale).reshape(rows.shape), beyond(y, "e4m3").reshape(rows.shape)
    if rows is not x:
        deq, over = deq.t(), over.t()
    return deq, over, scale


def qdq(x: torch.Tensor, spec: Spec, axis: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (2-D) quantized by ``spec`` along ``axis`` and dequantized: (float32 values, overflow mask,
    dequantization scales). Raises ValueError for MX along an axis whose length is not a multiple of 32."""
    if spec.kind == "cast":
        low = x.to(spec.dtype)
        return low.float(), torch.isinf(low) & torch.isfinite(x), torch.ones((), device=x.device)
    if spec.kind == "hp":
        return x.float(), torch.zeros_like(x, dtype=torch.bool), torch.ones((), device=x.device)
    if spec.kind == "mx":
        if x.shape[axis] % MX_BLOCK:
            raise ValueError(f"MXFP8 casts in blocks of {MX_BLOCK}: dimension {x.shape[axis]} is not a multiple")
        return _mx(x, axis)
    return _scaled(x, spec, axis)


def figures(x: torch.Tensor, spec: Spec, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The statistics of quantizing ``x`` (2-D, not empty) by ``spec`` along ``axis``, as device tensors
    (no host read): int64 ``[numel, underflow, overflow]`` and float32 ``[sse / norm**2, sum_sq / norm**2,
    amax, scale_min, scale_max, norm]``, ``norm`` the power of two at or below ``amax`` (1 where ``amax``
    is 0, inf or NaN)."""
    deq, over, scale = qdq(x, spec, axis)
    x32 = x.float()
    underflow = ((x32 != 0) & (deq == 0)).sum()
    counts = torch.stack([torch.full_like(underflow, x.numel()), underflow, over.sum()])
    amax = x32.abs().amax()
    # squares taken relative to a power of two near amax (an exact division): float32 squares of the
    # values themselves underflow below 1e-19 (small gradients) and overflow above 1e19
    usable = torch.isfinite(amax) & (amax > 0)
    exponent = torch.floor(torch.log2(torch.where(usable, amax, 1.0))).clamp(max=127)  # log2 may round up to 128
    norm = torch.where(usable, torch.exp2(exponent), 1.0)
    err, xn = (deq - x32) / norm, x32 / norm
    values = torch.stack([(err * err).sum(), (xn * xn).sum(), amax, scale.min().float(), scale.max().float(), norm])
    return counts, values
