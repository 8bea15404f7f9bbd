"""The number formats a layer's matmuls can run in, what each does to every matmul operand, and their
order by cost: the vocabulary of the statistics (:mod:`.stats`) and the plan (:mod:`.plan`).

A Linear layer runs three matmuls (GEMMs), each on two operands, named here as TransformerEngine and
Megatron name them:

======================  ===========  ==========================================================
operand                 tensor       reduction dimension (the axis a row scale or an MX block runs along)
======================  ===========  ==========================================================
``fwd.input``           input x      K (in features): one scale per token
``fwd.weight``          weight W     K: one scale per output feature
``dgrad.grad_output``   grad_output  N (out features): one scale per token
``dgrad.weight``        weight W     N: one scale per input feature
``wgrad.grad_output``   grad_output  M (tokens): one scale per output feature
``wgrad.input``         input x      M: one scale per input feature
======================  ===========  ==========================================================

(torchao's ``Float8Linear`` uses exactly these axes, ``axiswise_dim`` in ``float8_linear.py``; its
MXFP8 layer casts along the same dimensions in blocks of 32.) The formats:

- ``fp32``, ``bf16``, ``fp16``: a cast, no scale;
- ``fp8_tensorwise``: torchao's ``tensorwise`` recipe: one dynamic scale per tensor, e4m3 for inputs
  and weights, e5m2 for gradients;
- ``fp8_rowwise``: torchao's ``rowwise``: e4m3, one power-of-two scale per row along the reduction
  dimension;
- ``fp8_rowwise_with_gw_hp``: torchao's ``rowwise_with_gw_hp``: as rowwise, the weight tensorwise for
  dgrad, the weight gradient in high precision;
- ``mxfp8``: e4m3 with one e8m0 scale per block of 32 along the reduction dimension (RCEIL);
- ``mxfp8_with_gw_hp``: as mxfp8, the weight gradient in high precision.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["AXIS", "COST_ORDER", "FORMATS", "FORMAT_OF_RECIPE", "OPERANDS", "PLAN_FORMATS", "RECIPE_OF", "Spec",
           "TENSOR", "check_formats", "dtype_format", "spec"]

FORMATS = ("fp32", "bf16", "fp16", "fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_with_gw_hp", "mxfp8",
           "mxfp8_with_gw_hp")
#: The candidates a plan measures by default.
PLAN_FORMATS = ("fp32", "bf16", "fp16", "fp8_tensorwise", "fp8_rowwise", "mxfp8")
#: 16-bit and 32-bit formats: the dtype autocast (or no autocast) runs them in.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The precision policy's ``fp8_recipe`` for each 8-bit format.
RECIPE_OF = {"fp8_tensorwise": "tensorwise", "fp8_rowwise": "rowwise", "fp8_rowwise_with_gw_hp": "rowwise_with_gw_hp",
             "mxfp8": "mxfp8", "mxfp8_with_gw_hp": "mxfp8_with_gw_hp"}
FORMAT_OF_RECIPE = {recipe: name for name, recipe in RECIPE_OF.items()}
#: Cheapest first, for the matmuls of a layer large enough to gain from 8 bits. The 8-bit order is
#: torchao's published Llama3-8B training speedups over bf16 (torchao 0.18
#: ``docs/source/workflows/training.md``: on B200, float8 tensorwise +25.4%, mxfp8 (cuBLAS, RCEIL)
#: +16.1%, float8 rowwise +4.0%); the variants with the weight gradient in high precision run one of
#: the three matmuls in 16 bits, so they come after their recipe. bf16 and fp16 run at the same
#: tensor-core rate; fp32 last.
COST_ORDER = ("fp8_tensorwise", "mxfp8", "fp8_rowwise", "mxfp8_with_gw_hp", "fp8_rowwise_with_gw_hp", "bf16", "fp16",
              "fp32")
OPERANDS = ("fwd.input", "fwd.weight", "dgrad.grad_output", "dgrad.weight", "wgrad.grad_output", "wgrad.input")
#: operand -> the tensor it is
TENSOR = {"fwd.input": "input", "fwd.weight": "weight", "dgrad.grad_output": "grad_output", "dgrad.weight": "weight",
          "wgrad.grad_output": "grad_output", "wgrad.input": "input"}
#: operand -> the axis of its 2-D tensor (input and grad_output as (M, K) and (M, N), the weight as (N, K))
#: that a row scale or an MX block runs along: the matmul's reduction dimension
AXIS = {"fwd.input": -1, "fwd.weight": -1, "dgrad.grad_output": -1, "dgrad.weight": 0, "wgrad.grad_output": 0,
        "wgrad.input": 0}

_E4, _E5 = "e4m3", "e5m2"


class Spec(NamedTuple):
    """How one operand is quantized: ``kind`` "cast" (to ``dtype``), "tensorwise", "rowwise" (an fp8
    ``element`` with torchao's scales, power-of-two ones where ``pow2``), "mx" (MXFP8, block 32) or "hp"
    (left in the precision it is in)."""

    kind: str
    dtype: torch.dtype | None = None
    element: str | None = None
    pow2: bool = False


def spec(format: str, operand: str) -> Spec:
    """How ``format`` quantizes ``operand`` (torchao's recipes, operand by operand)."""
    if format in DTYPES:
        return Spec("cast", DTYPES[format])
    gradient = TENSOR[operand] == "grad_output"
    wgrad = operand.startswith("wgrad.")
    if format == "fp8_tensorwise":
        return Spec("tensorwise", element=_E5 if gradient else _E4)
    if format == "fp8_rowwise":
        return Spec("rowwise", element=_E4, pow2=True)
    if format == "fp8_rowwise_with_gw_hp":
        if wgrad:
            return Spec("hp")
        if operand == "dgrad.weight":
            return Spec("tensorwise", element=_E4, pow2=True)
        return Spec("rowwise", element=_E4, pow2=True)
    if format in ("mxfp8", "mxfp8_with_gw_hp"):
        return Spec("hp") if wgrad and format == "mxfp8_with_gw_hp" else Spec("mx", element=_E4)
    raise ValueError(f"unknown format {format!r}; the formats are {', '.join(FORMATS)}")


def dtype_format(dtype: torch.dtype) -> str:
    """"bf16" for torch.bfloat16, and so on (float32, bfloat16, float16)."""
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"{dtype} is not one of the formats' dtypes (float32, bfloat16, float16)")


def check_formats(formats: object, argument: str) -> tuple[str, ...]:
    """``formats`` (names from :data:`FORMATS`), checked: a clear error naming the argument."""
    if isinstance(formats, str):
        formats = (formats,)
    try:
        names = tuple(formats)  # type: ignore[arg-type]  # not iterable: the TypeError below says so
    except TypeError:
        raise TypeError(f"{argument} takes format names ({', '.join(FORMATS)}), got {type(formats).__name__}") from None
    unknown = [f for f in names if f not in FORMATS]
    if unknown or not names:
        raise ValueError(f"{argument}: unknown format {', '.join(map(repr, unknown)) or '(none given)'}; the formats "
                         f"are {', '.join(FORMATS)}")
    return tuple(dict.fromkeys(names))
