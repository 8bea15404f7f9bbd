"""Cambricon MLU backend, through Cambricon's ``torch_mlu`` extension.

Every public torch_mlu with a ``torch.mlu`` module (r1.22 for torch 2.1 onwards) renames
PrivateUse1 to "mlu" and registers ``torch.mlu``, so ``torch.autocast("mlu")`` and torch's
device-generic unscale op (which torch_mlu implements) are what runs; its
``torch.mlu.amp.autocast`` is ``torch.autocast("mlu")``. torch_mlu is imported only when this
backend is asked for. Checked against torch_mlu's source: see docs/backends/mlu.md.
"""

from __future__ import annotations

import os

import torch

from amp_backends import ComputedMapping, hookimpl
from amp_backends.devices import collectives as collective_libraries
from amp_backends.extension import ExtensionBackend
from amp_backends.devices import autocast_lists
from amp_backends.devices.fused import ABSENT, HONOURS

#: torch_mlu r2.4 ``csrc/aten/MLUFallback.cpp`` ``getFallbackEnabledEnvVar``: the CPU fallback for ops
#: without an MLU kernel is on unless ``ENABLE_FALLBACK_TO_CPU`` is one of these (read once, at load).
FALLBACK_OFF = ("0", "OFF", "off")


def cpu_fallback_enabled() -> bool:
    """Whether torch_mlu runs an op it has no MLU kernel for on the CPU (``mlu_fallback``, with a
    warning), as it does by default; off, such an op raises NotImplementedError (``mlu_disable_fallback``)."""
    return os.environ.get("ENABLE_FALLBACK_TO_CPU") not in FALLBACK_OFF


def fused_kernels() -> dict[str, tuple[str, str]]:
    """Read from torch_mlu r2.4_develop's source (not run on an MLU here):

    - ``_fused_adam_``, ``_fused_adamw_``, ``_fused_sgd_`` (+ ``.tensor_lr``) are registered
      (``codegen/mlu_functions.yaml``); the BANG kernels return first when found_inf is 1
      (``internal/fused_torch_adamw_internal.mlu``, ``internal/fused_torch_sgd_internal.mlu``, ``call``)
      and multiply each gradient by 1/grad_scale, written back (same files);
    - no ``_fused_adagrad_`` (nothing in ``codegen/`` or ``torch_mlu/csrc/``): ``Adagrad(fused=True)``
      goes to torch_mlu's CPU fallback (``csrc/aten/MLUFallback.cpp`` ``mlu_fallback``, on by
      default), which runs torch's CPU kernel (it skips and divides) on copies and writes them back,
      slowly and with a warning; with ``ENABLE_FALLBACK_TO_CPU=0`` it raises NotImplementedError."""
    declared = {kind: (HONOURS, "torch_mlu's BANG kernels skip when found_inf is 1 and multiply the gradients "
                                "by 1/grad_scale (internal/fused_torch_adamw_internal.mlu, "
                                "fused_torch_sgd_internal.mlu)")
                for kind in ("adam", "adamw", "sgd")}
    if cpu_fallback_enabled():
        declared["adagrad"] = (HONOURS, "torch_mlu registers no _fused_adagrad_: its CPU fallback "
                                        "(csrc/aten/MLUFallback.cpp mlu_fallback) runs torch's CPU kernel, which "
                                        "skips and divides, slowly and with a warning")
    else:
        declared["adagrad"] = (ABSENT, "torch_mlu registers no _fused_adagrad_ and ENABLE_FALLBACK_TO_CPU=0 turns "
                                       "off its CPU fallback (csrc/aten/MLUFallback.cpp mlu_disable_fallback): "
                                       "use Adagrad(fused=False), or unset ENABLE_FALLBACK_TO_CPU")
    return declared


class MLUBackend(ExtensionBackend):
    """Mixed precision on Cambricon MLUs (fp16 by default, bf16 where the chip has it, CNCL)."""

    name = "mlu"
    device_type = "mlu"
    default_dtype = torch.float16
    dist_backend = "cncl"
    collectives = collective_libraries.CNCL  # torch_mlu process_group_cncl.cpp: no float8, AVG divides first, no PREMUL_SUM
    priority = 100
    extension = "torch_mlu"
    install_hint = "install Cambricon's torch_mlu build that matches this torch"
    # torch_mlu/mlu/__init__.py _parse_visible_devices: CN_VISIBLE_DEVICES, else
    # MLU_VISIBLE_DEVICES, else CUDA_VISIBLE_DEVICES
    visible_devices = ("CN_VISIBLE_DEVICES", "MLU_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    device_tool = "cnmon"
    #: csrc/aten/autocast_mode.cpp registers torch's macros (CUDA's lists, with norm in float32) and bans
    #: binary_cross_entropy (it raises): a precision policy runs nn.BCELoss in float32 instead
    autocast_lists = autocast_lists.CUDA.changed("torch_mlu r2.4 csrc/aten/autocast_mode.cpp (torch's macros)")
    # torch_mlu's unscale kernel (csrc/aten/operators/bang/amp_unscale.cpp) takes float32 and
    # float16 gradients only, and at most INT32_MAX elements per tensor: bf16 gradients (MLU590)
    # and larger tensors are routed around it by the core.
    unscale_dtypes = (torch.float32, torch.float16)
    max_tensor_elements = 2**31 - 1
    # torch_mlu r2.4_develop is built for torch 2.4.0 exactly
    built_for_torch = "2.4.0"
    #: What the fused optimizer kernels do with found_inf and grad_scale (:func:`fused_kernels`: it depends on
    #: ENABLE_FALLBACK_TO_CPU, so it is computed when read)
    fused_found_inf = ComputedMapping(fused_kernels)

    def fp8_unavailable_reason(self) -> str | None:
        """torch_mlu registers no ``_scaled_mm`` (r2.4_develop and every branch in Cambricon's public
        repository: nothing in ``codegen/`` or ``torch_mlu/``); its CPU fallback lands on torch 2.4,
        which has no CPU ``_scaled_mm`` either."""
        return ("has no fp8 matmul through torch: torch_mlu registers no _scaled_mm (codegen/mlu_functions.yaml, "
                "r2.4), and its CPU fallback reaches torch 2.4, which has none")


@hookimpl
def amp_backends_register_backends(register) -> None:
    register(MLUBackend())
