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


npu_module = simdevice.install("npu", bf16=BF16, device_count=1, saturation=not INF_NAN, module_class=_NPUModule)

from . import npu  # noqa: E402  (torch_npu.npu: the overflow-status functions and utils)

__version__ = ".".join(torch.__version__.split("+")[0].split(".")[:3]) + ".post1"
