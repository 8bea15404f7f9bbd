"""Per-layer precision: modules kept in float32 inside autocast, Linear layers trained in fp8 or MXFP8,
each layer's format measured and planned.

    handle = amp_backends.precision_policy(model, fp32=[torch.nn.BatchNorm2d, "head"])

Owns the policy (:mod:`.policy`), the selectors and the recipe (:mod:`.selectors`), the float32
forward wrapper (:mod:`.fp32_forward`), fp8 and MXFP8 (:mod:`.fp8`), the module wrapper that enters
autocast in the thread it runs in (:mod:`.autocast_module`), the formats and their quantization as
torchao computes it (:mod:`.formats`, :mod:`.quantize`), statistics per layer (:mod:`.stats`), and
the plan (:mod:`.plan`: the data; :mod:`.planner`: measuring and choosing).

May import: :mod:`amp_backends.tracing`, :mod:`amp_backends.backend`, :mod:`amp_backends.scaler`,
:mod:`amp_backends.registry`, :mod:`amp_backends.errors`, :mod:`amp_backends.patches`,
:mod:`amp_backends.torch_private` and torch.
"""

from __future__ import annotations

from .policy import NORM_TYPES, OP_MODULES, RECIPE, PrecisionPolicy, Selector, fp32_modules, precision_policy

__all__ = ["NORM_TYPES", "OP_MODULES", "RECIPE", "PrecisionPolicy", "Selector", "fp32_modules", "precision_policy"]
