"""Cambricon MLU backend, through Cambricon's ``torch_mlu`` extension.

Every public torch_mlu with a ``torch.mlu`` module (r1.22 for torch 2.1 onwards) renames
PrivateUse1 to "mlu" and registers ``torch.mlu``, so ``torch.autocast("mlu")`` and torch's
device-generic unscale op (which torch_mlu implements) are what runs; its
``torch.mlu.amp.autocast`` is ``torch.autocast("mlu")``. torch_mlu is imported only when this
backend is asked for. Checked against torch_mlu's source: see docs/backends/mlu.md.
"""

from __future__ import annotations

import torch

from amp_backends import hookimpl
from amp_backends.extension import ExtensionBackend
from amp_backends.devices.fused import HONOURS


class MLUBackend(ExtensionBackend):
    """Mixed precision on Cambricon MLUs (fp16 by default, bf16 where the chip has it, CNCL)."""

    name = "mlu"
    device_type = "mlu"
    default_dtype = torch.float16
    dist_backend = "cncl"
    priority = 100
    extension = "torch_mlu"
    install_hint = "install Cambricon's torch_mlu build that matches this torch"
    # torch_mlu/mlu/__init__.py _parse_visible_devices: CN_VISIBLE_DEVICES, else
    # MLU_VISIBLE_DEVICES, else CUDA_VISIBLE_DEVICES
    visible_devices = ("CN_VISIBLE_DEVICES", "MLU_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    device_tool = "cnmon"
    # csrc/aten/autocast_mode.cpp bans binary_cross_entropy under autocast (it raises): a
    # precision policy built with this backend runs nn.BCELoss in float32 instead
    fp32_ops = ("binary_cross_entropy",)
    # torch_mlu's unscale kernel (csrc/aten/operators/bang/amp_unscale.cpp) takes float32 and
    # float16 gradients only, and at most INT32_MAX elements per tensor: bf16 gradients (MLU590)
    # and larger tensors are routed around it by the core.
    unscale_dtypes = (torch.float32, torch.float16)
    #: torch_mlu r2.4 registers _fused_adam_, _fused_adamw_ and _fused_sgd_ (codegen/mlu_functions.yaml);
    #: its BANG kernels return when found_inf is 1 (fused_torch_adamw_internal.mlu, fused_torch_sgd_internal.mlu)
    fused_found_inf = {kind: (HONOURS, "torch_mlu's BANG kernels skip when found_inf is 1")
                       for kind in ("adam", "adamw", "sgd")}
    max_tensor_elements = 2**31 - 1
    # torch_mlu r2.4_develop is built for torch 2.4.0 exactly
    built_for_torch = "2.4.0"


@hookimpl
def amp_backends_register_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(MLUBackend())
