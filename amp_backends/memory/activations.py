"""GELUs written out in Python, run as torch's one fused op instead.

Transformers' GPT-2 (``activation_function="gelu_new"``), and every model configured with ``gelu_new``,
``gelu_fast``, ``gelu_accurate`` or ``gelu_python``, computes its GELU as a chain of elementwise ops
(``NewGELUActivation``: ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3))))``). Autograd
saves what each op of the chain needs for backward: ``pow``'s input, ``tanh``'s output and both factors of
the last product, four tensors of the MLP's widest shape where ``F.gelu`` saves one, its input. On GPT-2
small at 16 x 512 tokens that is 1,728 MiB of bfloat16 activations (the ledger, on fake tensors). The
chain also runs about eight kernels forward and ten backward where ``F.gelu`` runs one each.

:func:`fused_activations` makes each such module compute the same function with ``F.gelu`` (the tanh
approximation where the module's formula is it, the exact erf form where it is ``gelu_python``). The
function is the same; its rounding is not: under autocast the chain rounds every intermediate to the
low-precision dtype, ``F.gelu`` computes in float32 inside and rounds once, so its outputs and gradients
are closer to the exact function's (``tests/memory/test_activations.py`` asserts both against float64,
and float32 within a few ulps of the chain). Only the classes in :data:`FUSED` are changed, by their
qualified names (nothing here imports transformers).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import patches

__all__ = ["FUSED", "FusedActivations", "fused_activations"]

#: Modules, by qualified class name, whose forward is a GELU written out in Python -> ``F.gelu``'s
#: ``approximate`` for the same function. (transformers' ``GELUActivation`` is in it only when built
#: with ``use_gelu_python=True``; ``QuickGELUActivation``, ``x * sigmoid(1.702 x)``, is another function.)
FUSED: dict[str, str] = {
    "transformers.activations.NewGELUActivation": "tanh",
    "transformers.activations.FastGELUActivation": "tanh",
    "transformers.activations.AccurateGELUActivation": "tanh",
    "transformers.activations.GELUActivation": "none",
}


def class_forward_is_its_own(kind: type[nn.Module]) -> bool:
    """Whether ``kind.forward`` is the one its module defined for it: not replaced on the class (a
    function of another name, or one wrapped with ``functools.wraps``, which keeps the name but sets
    ``__wrapped__``: a fake-quantizing patch), so that its function is the one known by the class."""
    forward = kind.__dict__.get("forward")
    return (forward is not None and getattr(forward, "__qualname__", None) == f"{kind.__qualname__}.forward"
            and getattr(forward, "__module__", None) == kind.__module__ and not hasattr(forward, "__wrapped__"))


def _approximate(module: nn.Module) -> str | None:
    """``F.gelu``'s ``approximate`` for the function ``module`` computes, or None where it is not a written-out GELU."""
    kind = FUSED.get(f"{type(module).__module__}.{type(module).__qualname__}")
    if kind is None or not class_forward_is_its_own(type(module)):
        return None
    if kind == "none":  # transformers' GELUActivation: F.gelu already, unless built with use_gelu_python
        act = getattr(module, "act", None)
        return "none" if getattr(act, "__name__", "") == "_gelu_python" else None
    if type(module).__qualname__ == "AccurateGELUActivation" and not math.isclose(
            float(getattr(module, "precomputed_constant", math.sqrt(2 / math.pi))), math.sqrt(2 / math.pi)):
        return None  # a constant of its own: another function
    return kind


class _FusedGelu:
    """The forward of a written-out GELU module: ``F.gelu`` of its input (picklable)."""

    def __init__(self, module: nn.Module, previous: Any, approximate: str) -> None:
        self.module, self.previous, self.approximate = module, previous, approximate

    def __call__(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  # (the name the module's forward takes)
        return F.gelu(input, approximate=self.approximate)


class FusedActivations(patches.Wrapped):
    """The modules :func:`fused_activations` changed; :meth:`remove` restores them."""

    kind = _FusedGelu

    def __repr__(self) -> str:
        return f"FusedActivations({len(self.modules)} modules)"


def fused_activations(model: nn.Module) -> FusedActivations:
    """Make every written-out GELU of ``model`` (:data:`FUSED`) run as ``F.gelu``: the same function,
    one saved tensor instead of four, one kernel instead of a chain (see the module docstring). A module
    whose ``forward`` something else replaced already (a precision policy, the user) is left alone."""
    changed = []
    for m in model.modules():
        approximate = _approximate(m)
        if approximate is None or "forward" in m.__dict__:
            continue  # not a written-out GELU; or fused already, or its forward is another's (a precision
            # policy running it in float32, a user's own): that is kept as it is
        patches.wrap(m, "forward", _FusedGelu(m, m.__dict__.get("forward"), approximate),
                     scope="until FusedActivations.remove()",
                     cause=f"the GELU written out in Python runs as F.gelu(approximate={approximate!r})")
        changed.append(m)
    return FusedActivations(changed)
