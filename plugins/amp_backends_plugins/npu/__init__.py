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
import os
import re
from typing import Any

import torch

from amp_backends import ComputedMapping, OverflowStatus, hookimpl
from amp_backends.devices import collectives as collective_libraries
from amp_backends.extension import ExtensionBackend
from amp_backends.devices import autocast_lists
from amp_backends.devices.fused import ABSENT, HONOURS, IGNORES, SCALE_BLIND
from amp_backends.torch_private import dispatch_has_kernel_for_dispatch_key

#: ``c10_npu::SocVersion`` (torch_npu ``csrc/core/npu/NpuVariables.h``): what
#: ``torch_npu._C._npu_get_soc_version()`` returns for the first chips with inf/NaN mode and bf16
#: (Ascend910B1) and for the first with op-plugin's ``_scaled_mm`` (Ascend950).
ASCEND910B1, ASCEND950 = 220, 260


def cpu_fallback_enabled() -> bool:
    """torch_npu runs an op without an NPU kernel on the CPU (``csrc/aten/VariableFallbackKernel.cpp``
    ``npu_cpu_fallback``, with a warning) unless ``TORCH_NPU_FALLBACK_CPU_DISABLE`` is a non-zero
    integer (``OptionsManager::IsCpuFallbackEnable``, strtol; torch_npu master since 2026-08-20, older
    releases ignore it and always fall back)."""
    match = re.match(r"\s*[+-]?\d+", os.environ.get("TORCH_NPU_FALLBACK_CPU_DISABLE", ""))
    return match is None or int(match.group()) == 0


def _fallback_kernel(op: str, kind: str) -> tuple[str, str]:
    """The declaration for an optimizer op-plugin has no NPU kernel for."""
    if cpu_fallback_enabled():
        return (HONOURS, f"op-plugin registers no {op}: torch_npu's CPU fallback (csrc/aten/VariableFallbackKernel.cpp "
                         "npu_cpu_fallback) runs torch's CPU kernel, which skips and divides, slowly and with a warning")
    return (ABSENT, f"op-plugin registers no {op} and TORCH_NPU_FALLBACK_CPU_DISABLE turns off torch_npu's CPU "
                    f"fallback (csrc/framework/utils/CpuFallbackUtils.h): use {kind}(fused=False), or unset it")


#: torch_npu's autocast lists (``torch_npu/csrc/aten/AutoCastOps.cpp``), told as their differences from
#: torch's CUDA lists.
AUTOCAST = autocast_lists.CUDA.changed(
    "torch_npu csrc/aten/AutoCastOps.cpp",
    lower=(autocast_lists.CUDA.lower - {"linalg_vecdot", "cudnn_convolution", "cudnn_convolution_transpose"}),
    fp32=(autocast_lists.CUDA.fp32 - autocast_lists.UPSAMPLE - {"rms_norm"}),
    promote=autocast_lists.CUDA.promote - {"vdot"},
)


def fused_kernels() -> dict[str, tuple[str, str]]:
    """Read from op-plugin (``op_plugin/config/op_plugin_functions.yaml``, ``op_plugin/ops/opapi/``)
    and torch_npu (master), not run on an Ascend NPU here:

    - ``_fused_adamw_`` takes grad_scale and found_inf and reads neither
      (``FusedAdamWKernelNpuOpApi.cpp``): ignores; the scaler checks, skips or unscales from the host;
    - ``_fused_sgd_`` returns when found_inf is 1 (``FusedSgdKernelOpApi.cpp``, a host read) and
      hands grad_scale to CANN's ``aclnnFusedSgd``, whose use of it op-plugin does not show: not
      trusted to divide, so the scaler unscales first and hands grad_scale None (an empty tensor
      to ``aclnnFusedSgd``);
    - no ``_fused_adam_``, ``_fused_adamw_.tensor_lr`` or ``_fused_adagrad_``: torch_npu's CPU
      fallback runs torch's CPU kernels (they skip and divide), unless it is turned off."""
    return {
        "adamw": (IGNORES, "op-plugin's _fused_adamw_ never reads grad_scale or found_inf "
                           "(FusedAdamWKernelNpuOpApi.cpp): the scaler unscales and skips it from the host"),
        "adam": _fallback_kernel("_fused_adam_", "Adam"),
        "sgd": (SCALE_BLIND, "op-plugin's _fused_sgd_ returns when found_inf is 1 (FusedSgdKernelOpApi.cpp) and "
                             "hands grad_scale to CANN's aclnnFusedSgd, whose use of it op-plugin does not show"),
        "adagrad": _fallback_kernel("_fused_adagrad_", "Adagrad"),
    }


class NPUBackend(OverflowStatus, ExtensionBackend):
    """Mixed precision on Ascend NPUs (fp16 by default, bf16 where the chip has it, HCCL)."""

    name = "npu"
    device_type = "npu"
    default_dtype = torch.float16
    dist_backend = "hccl"
    collectives = collective_libraries.HCCL  # torch_npu ProcessGroupHCCL.cpp: AVG is a SUM divided afterwards, fp8 gathers only
    priority = 100
    extension = "torch_npu"
    install_hint = "pip install torch_npu (the release made for this torch), with the CANN toolkit"
    visible_devices = ("ASCEND_RT_VISIBLE_DEVICES",)
    device_tool = "npu-smi info"
    has_fp64 = False
    #: torch_npu's own lists (csrc/aten/AutoCastOps.cpp): CUDA's with flash attention lowered, no
    #: linalg_vecdot or cuDNN convolutions, no upsampling in float32, no vdot promoted; BCE banned
    autocast_lists = AUTOCAST
    state_dict_dynamic = True  # torch_npu's scaler requires "dynamic" in a checkpoint it loads
    #: What the fused optimizer kernels do with found_inf and grad_scale (:func:`fused_kernels`: it depends on
    #: TORCH_NPU_FALLBACK_CPU_DISABLE, so it is computed when read)
    fused_found_inf = ComputedMapping(fused_kernels)

    def _soc_version(self) -> int | None:
        """``torch_npu._C._npu_get_soc_version()`` (``c10_npu::SocVersion``), None where unknown."""
        if self._load() is None:
            return None
        try:
            return int(self._submodule("_C")._npu_get_soc_version())
        except Exception:  # noqa: BLE001 - an unknown chip has no declared fp8
            return None

    def fp8_dtypes(self) -> tuple[torch.dtype, ...]:
        """op-plugin's ``_scaled_mm`` (``op_plugin/ops/opapi/ScaledMmKernelNpuOpApi.cpp``, op-plugin
        master and 26.1.0; torch 2.7+): on Ascend950 and later only, operands float8_e4m3fn or
        float8_e5m2 (not both e5m2, which torchao's recipes never pair), float32 or e8m0 scales, no
        scale_result. Declared where the chip is an Ascend950 and a kernel for ``_scaled_mm`` is
        registered on the NPU (older op-plugin has none: torch_npu's CPU fallback would run it on the
        host). Read from op-plugin's source; not run on an Ascend NPU."""
        if not self.is_available() or (self._soc_version() or 0) < ASCEND950:
            return ()
        if not dispatch_has_kernel_for_dispatch_key("aten::_scaled_mm", "PrivateUse1"):
            return ()
        return (torch.float8_e4m3fn, torch.float8_e5m2)

    def fp8_recipes(self) -> tuple[str, ...]:
        """All three: op-plugin takes tensorwise (singleton) scales for e4m3fn and e5m2 operands, and
        recognises rowwise ([M, 1] x [1, N] float32) scales when both operands are e4m3fn, which is
        what torchao's rowwise recipes cast to (torchao repeats a tensorwise scale along the axis when
        the other operand is rowwise)."""
        from amp_backends.precision.fp8.engine import RECIPES

        return RECIPES if self.fp8_dtypes() else ()

    def fp8_unavailable_reason(self) -> str | None:
        if not self.is_available() or self.fp8_dtypes():
            return None
        soc = self._soc_version()
        if soc is None or soc < ASCEND950:
            return (f"has no fp8 matmul: this Ascend chip (SocVersion {soc}) is below Ascend950, the first op-plugin's "
                    "_scaled_mm runs on (ScaledMmKernelNpuOpApi.cpp)")
        return ("has no fp8 matmul through this torch_npu: its op-plugin registers no _scaled_mm for the NPU (added in "
                "op-plugin 26.1.0), so torch_npu's CPU fallback would run it on the host: upgrade torch_npu")

    _saturation: bool | None = None

    @property
    def global_overflow_status(self) -> bool:
        """True on chips in saturation mode (no inf/NaN mode): overflow is a device-wide status.
        Asked once (the chip's mode does not change in a process): every step reads it."""
        if self._saturation is None:
            if self._load() is None:
                return False
            self._saturation = not bool(self._submodule("npu.utils").is_support_inf_nan())
        return self._saturation

    @property
    def built_for_torch(self) -> str | None:
        """torch_npu's release number is the torch release it is built for (``2.1.0.post3``)."""
        version = getattr(self._extension_module, "__version__", None)
        return ".".join(str(version).split(".")[:3]) if version else None

    def _submodule(self, name: str) -> Any:
        return importlib.import_module(f"{self.extension}.{name}")

    def precision_mode(self) -> str | None:
        """``ACL_PRECISION_MODE`` as torch_npu decides it (``EnvVariables.cpp`` ``IsAllowFP32ToFP16``): what
        ``set_option`` set, else the chip's default (``allow_fp32_to_fp16`` below Ascend910B1, whatever its
        inf/NaN mode; where the chip is unknown, on the chips in saturation mode)."""
        if self._load() is None:
            return None
        raw = self._submodule("_C")._npu_getOption("ACL_PRECISION_MODE")
        if raw:
            return raw.decode() if isinstance(raw, bytes) else str(raw)
        soc = self._soc_version()
        below = self.global_overflow_status if soc is None else soc < ASCEND910B1
        return "allow_fp32_to_fp16" if below else "must_keep_origin_dtype"

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
def amp_backends_register_backends(register) -> None:
    register(NPUBackend())
