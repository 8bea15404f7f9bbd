"""Intel Gaudi backend (``hpu``, through ``habana_frameworks.torch``): bf16 autocast by default, so
the scaler is off unless float16 is asked for (Gaudi 2 and later), HCCL process groups.

Checked against Intel Gaudi's PyTorch docs and the frameworks that drive it: importing
``habana_frameworks.torch`` registers ``torch.hpu`` (``is_available``, ``device_count``,
``get_device_name``: "GAUDI", "GAUDI2", "GAUDI3"); torch's ``autocast_mode.py`` accepts bfloat16
and float16 for hpu; Accelerate (``accelerator.py``: bf16 always on hpu) and DeepSpeed
(``accelerator/hpu_accelerator.py``: ``communication_backend_name`` "hccl"; ``is_fp16_supported``
asks ``habana_frameworks.torch.utils.experimental._is_fp16_supported()``) agree on the rest.
First-generation Gaudi has no float16 math; no Gaudi has float64.
"""

from __future__ import annotations

from typing import Any

import torch

from amp_backends import hookimpl
from amp_backends.devices import collectives as collective_libraries
from amp_backends.devices import autocast_lists
from amp_backends.extension import ExtensionBackend

__all__ = ["HPUBackend"]

#: Intel Gaudi's own fp8 training stack, for what torchao's recipes cannot run here: the Intel Gaudi
#: Transformer Engine (``habana_frameworks.torch.hpex.experimental.transformer_engine``, importing
#: ``intel_transformer_engine``) over the bridge's ``hpu::fp8_gemm_v2`` (``habana_eager/eager_custom_op_register.cpp``).
GAUDI_FP8 = ("Intel Gaudi's own fp8 stack (habana_frameworks.torch.hpex.experimental.transformer_engine, over "
             "hpu::fp8_gemm_v2)")


class HPUBackend(ExtensionBackend):
    """Mixed precision on Intel Gaudi through ``torch.autocast("hpu")``."""

    name = "hpu"
    device_type = "hpu"
    default_dtype = torch.bfloat16  # Gaudi's native dtype: no loss scaling by default
    dist_backend = "hccl"
    collectives = collective_libraries.GAUDI_HCCL  # the Gaudi bridge's HCCL: no AVG or PREMUL_SUM, fp16 reduced through float32
    priority = 100
    has_fp64 = False
    extension = "habana_frameworks.torch"
    install_hint = "install the Intel Gaudi software stack (habana-torch-plugin, matching this torch)"
    visible_devices = ("HABANA_VISIBLE_MODULES", "HABANA_VISIBLE_DEVICES")
    device_tool = "hl-smi"

    @property
    def autocast_lists(self) -> autocast_lists.AutocastLists:
        """The Gaudi bridge's lists (``hpu_ops/autocast_helpers.h``: norms, softmax and dropout in bf16;
        losses in float32; binary_cross_entropy not banned), or the files
        ``PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST`` / ``PT_HPU_AUTOCAST_FP32_OPS_LIST`` name, which
        replace them. The bridge reads the variables once, when it loads: set them before importing
        ``habana_frameworks.torch``."""
        return autocast_lists.gaudi()

    def _generation(self, module: Any) -> str | None:
        """"GAUDI", "GAUDI2", "GAUDI3" as the stack names the device; None where it cannot say."""
        query = getattr(module, "get_device_name", None)
        if not callable(query):
            return "GAUDI"
        try:
            name = query()
        except Exception:  # noqa: BLE001 - a failing name query costs only the name
            return None
        return str(name).strip().upper() or None if name is not None else None

    def _fp16(self, module: Any) -> bool:
        """The stack's own answer (``habana_frameworks.torch.utils.experimental._is_fp16_supported``,
        what DeepSpeed asks), else by generation: no fp16 on first-generation Gaudi, nor where the
        generation is unknown (bf16, every Gaudi's dtype, is unaffected)."""
        try:
            from habana_frameworks.torch.utils import experimental

            return bool(experimental._is_fp16_supported())
        except Exception:  # noqa: BLE001 - missing or failing: judged by generation
            generation = self._generation(module)
            return generation is not None and generation != "GAUDI"

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """bf16 on every Gaudi; fp16 where the stack says the device has it (Gaudi 2 on)."""
        module = self._load()
        if module is None or self.unavailable_reason() is not None:
            return (torch.bfloat16,)
        return (torch.bfloat16, torch.float16) if self._fp16(module) else (torch.bfloat16,)

    # -- fp8: read from the Gaudi bridge v1.19.0 (HabanaAI/gaudi-pytorch-bridge), not run on a Gaudi here --
    def _fp8_generation(self) -> str | None:
        module = self._load()
        if module is None or self.unavailable_reason() is not None:
            return None
        return self._generation(module)

    def fp8_dtypes(self) -> tuple[torch.dtype, ...]:
        """The bridge registers ``_scaled_mm`` for HPU (``scripts/hpu_op.yaml``, TPC guid ``fp8_gemm``;
        ``hpu_ops/backend/scaled_mm_gen.cpp`` takes Float8_e5m2 and Float8_e4m3fn operands). Gaudi 2 and
        3 have fp8 (its tests skip first-generation Gaudi: "Gaudi doesn't support fp8",
        ``tests/pytest_working/any_mode/test_hpu_scaled_mm.py``)."""
        generation = self._fp8_generation()
        return (torch.float8_e4m3fn, torch.float8_e5m2) if generation in ("GAUDI2", "GAUDI3") else ()

    def fp8_recipes(self) -> tuple[str, ...]:
        """tensorwise on Gaudi 3 only: torchao's tensorwise backward multiplies e5m2 by e4m3fn, and the
        bridge's tests run mixed operands on Gaudi 3 only ("mixed fp8 dtypes are supported only on
        gaudi3"); its tests use only one-element scales, so no rowwise recipe is declared."""
        return ("tensorwise",) if self._fp8_generation() == "GAUDI3" else ()

    def fp8_unavailable_reason(self) -> str | None:
        generation = self._fp8_generation()
        if generation is None or self.fp8_recipes():
            return None
        if generation == "GAUDI2":
            return ("has fp8 matmuls (_scaled_mm, float8_e4m3fn and float8_e5m2) that none of torchao's recipes can use "
                    "here: tensorwise needs e5m2 x e4m3fn, which the Gaudi bridge runs on Gaudi 3 only, and rowwise "
                    f"scales are untested by it (test_hpu_scaled_mm.py); for fp8 on Gaudi 2 use {GAUDI_FP8}")
        return f"has no fp8 matmul: {generation.title()} has no fp8 (Gaudi 2 and later have; see {GAUDI_FP8})"

    def describe(self) -> str | None:
        module = self._load()
        if module is None or self.unavailable_reason() is not None:
            return None
        generation = self._generation(module)
        shown = generation.title().replace("Gaudi", "Gaudi ").strip() if generation else "Gaudi (generation unknown)"
        return f"Intel {shown} ({module.device_count()} device(s))"


@hookimpl
def amp_backends_register_backends(register) -> None:
    register(HPUBackend())
