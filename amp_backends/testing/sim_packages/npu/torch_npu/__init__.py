"""A simulated Huawei torch_npu (Ascend/pytorch), on the simulated PrivateUse1 device (testing only).

What it keeps of the real torch_npu (the files named are torch_npu's and op-plugin's):

- PrivateUse1 renamed "npu", ``torch.npu`` the device module, collectives on HCCL;
- ``npu/utils.py`` ``is_support_inf_nan()``: chips with inf/NaN mode (Atlas A2) produce inf
  and NaN as IEEE says; chips without (``AMP_SIM_NPU_INF_NAN=0``, Atlas training series) run in
  saturation mode: overflowing results saturate to the largest finite value (NaN to 0) and set
  a device-wide status, read by ``torch_npu.npu.get_npu_overflow_flag()`` and reset by
  ``clear_npu_overflow_flag()``;
  on chips with inf/NaN mode ``get_npu_overflow_flag()`` raises and ``clear_npu_overflow_flag()``
  warns and does nothing;
- op-plugin ``AmpForeachNonFiniteCheckAndUnscaleKernelNpuOpApi.cpp``: in saturation mode the
  unscale op reads and resets that status instead of inspecting the gradients, and when it says
  overflow sets found_inf and returns without unscaling;
- ``npu/autocast_utils.py``: ``get_amp_supported_dtype()`` lists ``[fp16, bf16, fp32]`` when
  ``is_bf16_supported()``, else ``[fp16, fp32]``;
- ``is_bf16_supported()``: True (``AMP_SIM_NPU_BF16=0`` for a chip without);
- the release number is the torch release it is built for.

- op-plugin's fused optimizers (``op_plugin/config/op_plugin_functions.yaml``,
  ``op_plugin/ops/opapi/``): ``_fused_adamw_`` takes ``grad_scale`` and ``found_inf`` and reads
  neither (``FusedAdamWKernelNpuOpApi.cpp``: the update runs on the gradients as they are); no
  ``_fused_adam_`` and no ``_fused_adamw_.tensor_lr``; ``_fused_sgd_`` returns when found_inf is 1,
  and refuses momentum <= 0 (``FusedSgdKernelOpApi.cpp``).

Autocast follows torch's (CUDA's) lists with ``binary_cross_entropy`` banned; torch_npu's own
lists were not compared op by op (docs/backends/npu.md).
"""

from __future__ import annotations

import os

import torch

from amp_backends.testing import simdevice

INF_NAN = os.environ.get("AMP_SIM_NPU_INF_NAN", "1") != "0"
BF16 = os.environ.get("AMP_SIM_NPU_BF16", "1") != "0"


class _NPUModule(simdevice._DeviceModule):
    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        if self.is_bf16_supported():
            return [torch.float16, torch.bfloat16, torch.float32]
        return [torch.float16, torch.float32]


def _fused_sgd(qualified: str):  # type: ignore[no-untyped-def]
    """op-plugin's ``_fused_sgd_``: found_inf = 1 returns first; then momentum must be positive."""
    op = getattr(torch.ops.aten._fused_sgd_, "tensor_lr" if qualified.endswith("tensor_lr") else "default")

    def kernel(*args, **kwargs):  # type: ignore[no-untyped-def]
        found_inf = kwargs.get("found_inf")
        if found_inf is not None and float(found_inf.item()) == 1:
            return None
        if not kwargs["momentum"] > 0:
            raise RuntimeError(f"momentum must be positive, but got {float(kwargs['momentum'])}")
        return simdevice._fallback(op, *args, **kwargs)

    return kernel


_KERNELS = {
    "_fused_adamw_": simdevice.ignoring_found_inf("_fused_adamw_"),
    "_fused_adamw_.tensor_lr": simdevice.absent("_fused_adamw_.tensor_lr"),
    "_fused_adam_": simdevice.absent("_fused_adam_"),
    "_fused_adam_.tensor_lr": simdevice.absent("_fused_adam_.tensor_lr"),
    "_fused_sgd_": _fused_sgd("_fused_sgd_"),
    "_fused_sgd_.tensor_lr": _fused_sgd("_fused_sgd_.tensor_lr"),
}
npu_module = simdevice.install("npu", bf16=BF16, device_count=1, saturation=not INF_NAN, module_class=_NPUModule,
                               kernels=_KERNELS)

from . import npu  # noqa: E402  (torch_npu.npu: the overflow-status functions and utils)

__version__ = ".".join(torch.__version__.split("+")[0].split(".")[:3]) + ".post1"
