"""Huawei Ascend NPU backend, through Huawei's ``torch_npu`` extension (Ascend/pytorch).

torch_npu renames PrivateUse1 to "npu" and registers ``torch.npu``. What this backend declares,
from torch_npu's source (``torch_npu/npu/amp/grad_scaler.py``, ``torch_npu/npu/utils.py``,
op-plugin's ``AmpForeachNonFiniteCheckAndUnscaleKernelNpuOpApi.cpp``):

- chips without inf/NaN mode (``is_support_inf_nan()`` False) run in saturation mode: an overflow
  saturates the values and sets a device-wide status, which ``scale()`` clears before backward
  (``clear_npu_overflow_flag``) and the unscale reads (``get_npu_overflow_flag``) instead of
  inspecting the gradients;
- 1/scale is computed in float32 (the device has no float64);
- the collective backend is HCCL;
- ``ACL_PRECISION_MODE`` (``csrc/framework/interface/EnvVariables.cpp``): on chips below Ascend910B1
  (the saturation-mode ones) torch_npu's default, ``allow_fp32_to_fp16``, lets float32 matrix ops
  run in float16: a float32 baseline, or the layers a precision policy keeps in float32, may not
  be float32 there (:meth:`NPUBackend.fp32_note`, shown by ``info``).

torch_npu is imported only when this backend is asked for. Not run on Ascend hardware: see
docs/backends/npu.md.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from amp_backends import hookimpl
from amp_backends.extension import ExtensionBackend
from amp_backends.devices.fused import ABSENT, HONOURS, IGNORES


class NPUBackend(ExtensionBackend):
    """Mixed precision on Ascend NPUs (fp16 by default, bf16 where the chip has it, HCCL)."""

    name = "npu"
    device_type = "npu"
    default_dtype = torch.float16
    dist_backend = "hccl"
    priority = 100
    extension = "torch_npu"
    install_hint = "pip install torch_npu (the release made for this torch), with the CANN toolkit"
    visible_devices = ("ASCEND_RT_VISIBLE_DEVICES",)
    device_tool = "npu-smi info"
    has_fp64 = False
    #: torch_npu's autocast bans binary_cross_entropy (csrc/aten/AutoCastOps.cpp), as CUDA's does
    fp32_ops = ("binary_cross_entropy",)
    state_dict_dynamic = True  # torch_npu's scaler requires "dynamic" in a checkpoint it loads
    #: op-plugin (op_plugin/config/op_plugin_functions.yaml, op_plugin/ops/opapi/): _fused_adamw_ takes
    #: grad_scale and found_inf and reads neither (FusedAdamWKernelNpuOpApi.cpp); no _fused_adam_;
    #: _fused_sgd_ returns when found_inf is 1 (FusedSgdKernelOpApi.cpp)
    fused_found_inf = {
        "adamw": (IGNORES, "op-plugin's _fused_adamw_ never reads grad_scale or found_inf "
                           "(FusedAdamWKernelNpuOpApi.cpp): the scaler unscales and skips it from the host"),
        "adam": (ABSENT, "op-plugin registers no _fused_adam_ for the NPU (op_plugin_functions.yaml): use "
                         "AdamW(fused=True), or Adam(fused=False)"),
        "sgd": (HONOURS, "op-plugin's _fused_sgd_ returns when found_inf is 1 (FusedSgdKernelOpApi.cpp)"),
    }

    _saturation: bool | None = None

    @property  # type: ignore[override]
    def global_overflow_status(self) -> bool:
        """True on chips in saturation mode (no inf/NaN mode): overflow is a device-wide status.
        Asked once (the chip's mode does not change in a process): every step reads it."""
        if self._saturation is None:
            if self._load() is None:
                return False
            self._saturation = not bool(self._submodule("npu.utils").is_support_inf_nan())
        return self._saturation

    @property  # type: ignore[override]
    def built_for_torch(self) -> str | None:
        """torch_npu's release number is the torch release it is built for (``2.1.0.post3``)."""
        version = getattr(self._extension_module, "__version__", None)
        return ".".join(str(version).split(".")[:3]) if version else None

    def _submodule(self, name: str) -> Any:
        return importlib.import_module(f"{self.extension}.{name}")

    def precision_mode(self) -> str | None:
        """``ACL_PRECISION_MODE`` as torch_npu decides it: what ``set_option`` set, else the chip's
        default (``allow_fp32_to_fp16`` below Ascend910B1, the chips in saturation mode)."""
        if self._load() is None:
            return None
        raw = self._submodule("_C")._npu_getOption("ACL_PRECISION_MODE")
        if raw:
            return raw.decode() if isinstance(raw, bytes) else str(raw)
        return "allow_fp32_to_fp16" if self.global_overflow_status else "must_keep_origin_dtype"

    def fp32_note(self) -> str | None:
        if self.precision_mode() != "allow_fp32_to_fp16":
            return None
        return ("ACL_PRECISION_MODE=allow_fp32_to_fp16 (torch_npu's default below Ascend910B1): float32 matmuls "
                "and convolutions may run in float16 here; to keep float32 (baselines, a precision policy's float32 "
                "layers) call torch_npu.npu.set_option({'ACL_PRECISION_MODE': 'must_keep_origin_dtype'})")

    def describe(self) -> str | None:
        mode = self.precision_mode() if self.is_available() else None
        return f"precision mode {mode}" + (" (float32 matmuls may run in float16)" if mode == "allow_fp32_to_fp16"
                                           else "") if mode else None

    def clear_overflow_status(self) -> None:
        self._submodule("npu").clear_npu_overflow_flag()

    def read_overflow_status_(self, found_inf: torch.Tensor) -> None:
        npu = self._submodule("npu")
        if npu.get_npu_overflow_flag():  # a host read, as torch_npu's own scaler does in this mode
            found_inf.fill_(1.0)
        npu.clear_npu_overflow_flag()


@hookimpl
def amp_backends_register_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(NPUBackend())
