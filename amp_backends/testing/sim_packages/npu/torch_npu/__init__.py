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
- ``is_bf16_supported()``: the chip is Ascend910B1 or later (``NpuVariables.cpp`` ``IsBF16Supported``;
  ``AMP_SIM_NPU_BF16=0`` takes it away from any chip);
- the release number is the torch release it is built for;
- ``ACL_PRECISION_MODE`` (``csrc/framework/interface/EnvVariables.cpp`` ``IsAllowFP32ToFP16``,
  ``csrc/framework/LazyInitAclops.cpp``): ``allow_fp32_to_fp16`` by default on chips below
  Ascend910B1 (the saturation-mode ones), ``must_keep_origin_dtype`` from it on; float32 matrix ops
  then run in float16 on the device (results float32); ``torch_npu.npu.set_option`` changes it
  (``npu/npu_config.py``'s check and message), ``torch_npu._C._npu_getOption`` reads what was set.

- op-plugin's fused optimizers (``op_plugin/config/op_plugin_functions.yaml``,
  ``op_plugin/ops/opapi/``): ``_fused_adamw_`` takes ``grad_scale`` and ``found_inf`` and reads
  neither (``FusedAdamWKernelNpuOpApi.cpp``: the update runs on the gradients as they are);
  ``_fused_sgd_`` returns when found_inf is 1, and refuses momentum <= 0 (``FusedSgdKernelOpApi.cpp``),
  then hands grad_scale to CANN's ``aclnnFusedSgd``, whose use of it op-plugin does not show: the
  simulation takes the harsher reading and never divides by it;
- no ``_fused_adam_``, ``_fused_adamw_.tensor_lr`` or ``_fused_adagrad_``: torch_npu's CPU fallback
  (``csrc/aten/VariableFallbackKernel.cpp`` ``npu_cpu_fallback``) runs torch's CPU kernels, after its
  warning; ``TORCH_NPU_FALLBACK_CPU_DISABLE=1`` turns it off and the op raises torch_npu's error
  (``csrc/framework/utils/CpuFallbackUtils.h``, torch_npu master);
- the chip (``AMP_SIM_NPU_SOC``, ``csrc/core/npu/NpuVariables.h`` names; default ``Ascend910B1``, or
  ``Ascend910A`` with ``AMP_SIM_NPU_INF_NAN=0``): ``torch_npu._C._npu_get_soc_version()``; inf/NaN mode
  by chip unless ``AMP_SIM_NPU_INF_NAN`` says otherwise, always on Ascend950 (``NpuVariables.cpp``
  ``IsSupportInfNan``); op-plugin's ``_scaled_mm`` (``ScaledMmKernelNpuOpApi.cpp``, master and 26.1.0)
  with its checks: Ascend950 and later only, float8_e4m3fn/e5m2 operands but not both e5m2,
  float32 scales (one element, or rowwise [M, 1] x [1, N] with both operands e4m3fn; other scale
  shapes go to CANN unchecked by op-plugin, and the simulation refuses them), no scale_result,
  out_dtype float32/bfloat16/float16, op-plugin's bias rules.

- autocast: torch_npu's own lists (``csrc/aten/AutoCastOps.cpp``), not CUDA's: flash attention
  (``_scaled_dot_product_flash_attention``) in the low dtype, no ``linalg_vecdot``; no upsampling
  in float32; ``norm`` in float32 (fp32_append_dtype); no ``vdot``, ``cat`` or ``stack`` promoted;
  ``binary_cross_entropy`` banned.
"""

from __future__ import annotations

import os
import re

import torch

from amp_backends.testing import simdevice

#: ``c10_npu::SocVersion`` values of the chips the simulation knows (``csrc/core/npu/NpuVariables.h``).
SOCS = {"Ascend910A": 102, "Ascend910B1": 220, "Ascend910B2": 221, "Ascend910B3": 223, "Ascend910B4": 224,
        "Ascend910_9391": 250, "Ascend950": 260}
_INF_NAN_SET = os.environ.get("AMP_SIM_NPU_INF_NAN")
SOC_NAME = os.environ.get("AMP_SIM_NPU_SOC") or ("Ascend910A" if _INF_NAN_SET == "0" else "Ascend910B1")
if SOC_NAME.startswith("Ascend950"):  # SetSocVersion: any "Ascend950..." name is Ascend950
    SOC = SOCS["Ascend950"]
elif SOC_NAME in SOCS:
    SOC = SOCS[SOC_NAME]
else:
    raise ImportError(f"Unsupported soc version: {SOC_NAME.replace('_', ' ')} (AMP_SIM_NPU_SOC: the simulation "
                      f"knows {', '.join(SOCS)})")
ASCEND950 = SOCS["Ascend950"]
#: IsSupportInfNan: always on Ascend950; else by chip (Ascend910B1 up to Ascend310B1, and Ascend910_93xx)
#: unless AMP_SIM_NPU_INF_NAN says otherwise (INF_NAN_MODE_FORCE_DISABLE on a real one).
INF_NAN = SOC >= ASCEND950 or (_INF_NAN_SET != "0" if _INF_NAN_SET is not None else 220 <= SOC < 240 or SOC >= 250)
#: ``c10_npu::IsBF16Supported()`` (``NpuVariables.cpp``): Ascend910B1 and later; AMP_SIM_NPU_BF16=0 takes it away.
BF16 = SOC >= SOCS["Ascend910B1"] and os.environ.get("AMP_SIM_NPU_BF16", "1") != "0"
#: OptionsManager::IsCpuFallbackEnable: TORCH_NPU_FALLBACK_CPU_DISABLE, read as strtol, non-zero turns it off.
_DISABLE = re.match(r"\s*[+-]?\d+", os.environ.get("TORCH_NPU_FALLBACK_CPU_DISABLE", ""))
CPU_FALLBACK = _DISABLE is None or int(_DISABLE.group()) == 0


class _NPUModule(simdevice._DeviceModule):
    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        if self.is_bf16_supported():
            return [torch.float16, torch.bfloat16, torch.float32]
        return [torch.float16, torch.float32]


def _momentum_positive(kwargs):  # type: ignore[no-untyped-def]
    """op-plugin's ``_fused_sgd_`` after its found_inf return: momentum must be positive."""
    if not kwargs["momentum"] > 0:
        raise RuntimeError(f"momentum must be positive, but got {float(kwargs['momentum'])}")


def _no_kernel(qualified: str):  # type: ignore[no-untyped-def]
    """An op op-plugin registers no NPU kernel for: torch_npu's CPU fallback, or its refusal."""
    disabled = None if CPU_FALLBACK else RuntimeError(
        f"The operator 'aten::{qualified}' would execute its main computation on CPU through dispatcher backend "
        "fallback because no kernel is registered for the NPU PrivateUse1 backend, but CPU fallback is disabled by "
        "TORCH_NPU_FALLBACK_CPU_DISABLE=1.")
    return simdevice.host_fallback(qualified, "CAUTION: The operator '{op}' is not currently supported on the NPU "
                                              "backend and will fall back to run on the CPU. This may have "
                                              "performance implications.", disabled)


_F32, _BF16, _F16 = torch.float32, torch.bfloat16, torch.float16
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _scaled_mm(mat_a, mat_b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,  # type: ignore[no-untyped-def]
               use_fast_accum=False):
    """op-plugin's ``_scaled_mm`` (``op_plugin/ops/opapi/ScaledMmKernelNpuOpApi.cpp``), its checks in its
    order and words; the product computed on the CPU data."""
    if SOC < ASCEND950:
        raise RuntimeError("_scaled_mm is supported only on the Ascend950 platform and after.")
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        if mat.dtype not in _FP8:
            raise RuntimeError(f"{name} must be float8 type (Float8_e4m3fn or Float8_e5m2), but got {mat.dtype}")
    if mat_a.dtype == mat_b.dtype == torch.float8_e5m2:
        raise RuntimeError("Multiplication of two Float8_e5m2 matrices is not supported")
    for name, scale in (("scale_a", scale_a), ("scale_b", scale_b)):
        if scale.dtype not in (_F32, torch.float8_e8m0fnu):
            raise RuntimeError(f"{name} must be float32 or float8_e8m0 type, but got {scale.dtype}")
    if bias is not None:
        out = out_dtype or _BF16
        if bias.numel() != mat_b.shape[1]:
            raise RuntimeError(f"Bias must be size {mat_b.shape[1]} but got {bias.numel()}")
        if out == _F32:
            raise RuntimeError("Bias is not supported when out_dtype is set to Float32")
        if bias.dtype not in (_BF16, _F16):
            raise RuntimeError(f"Bias must be BFloat16 or Half, but got {bias.dtype}")
        if out == _BF16 and bias.dtype != _BF16 or out == _F16 and bias.dtype != _F16:
            raise RuntimeError(f"Bias must be {'BFloat16' if out == _BF16 else 'Float16'} to compute {out} output, "
                               f"but got {bias.dtype}")
    if scale_result is not None:
        raise RuntimeError("scale_result is not supported currently, as output float8 type is not enabled. "
                           "scale_result is only utilized when output is float8 type.")
    if out_dtype is not None and out_dtype not in (_F32, _BF16, _F16):
        raise RuntimeError(f"out_dtype must be Float32, BFloat16, or Float16, but got {out_dtype}")
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        if mat.dim() != 2:
            raise RuntimeError(f"{name} must be a matrix, please check {name} dim num.")
    if mat_a.shape[1] != mat_b.shape[0]:
        raise RuntimeError(f"mat_a and mat_b shapes cannot be multiplied ({mat_a.shape[0]}x{mat_a.shape[1]} and "
                           f"{mat_b.shape[0]}x{mat_b.shape[1]})")
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    rowwise = (mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn and scale_a.dtype == scale_b.dtype == _F32
               and tuple(scale_a.shape) == (mat_a.shape[0], 1) and tuple(scale_b.shape) == (1, mat_b.shape[1]))
    if not (tensorwise or rowwise) or scale_a.dtype != _F32 or scale_b.dtype != _F32:
        raise RuntimeError(
            "the simulated op-plugin takes one-element float32 scales, or rowwise [M, 1] x [1, N] float32 scales with "
            "both operands float8_e4m3fn (ScaledMmKernelNpuOpApi.cpp); other scales go to CANN's aclnnQuantMatmulV5 "
            "unchecked by op-plugin, and what CANN does with them is not known here")
    if out_dtype is None:
        raise RuntimeError("the simulated op-plugin needs out_dtype (None asks torch for a float8 output, which "
                           "op-plugin does not enable)")
    return simdevice.scaled_matmul(mat_a, mat_b, scale_a, scale_b, bias, out_dtype)


#: torch_npu's autocast lists (csrc/aten/AutoCastOps.cpp): lower_precision_fp; fp32, fp32_set_opt_dtype
#: and fp32_append_dtype (norm); promote.
AUTOCAST_LISTS = {
    "lower": ("_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
              "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
              "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
              "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
              "_scaled_dot_product_flash_attention", "scaled_dot_product_attention"),
    "fp32": ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
             "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm",
             "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
             "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
             "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
             "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
             "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum",
             "norm"),
    "promote": ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put", "tensordot",
                "scatter_add"),
}
_KERNELS = {
    "_fused_adamw_": simdevice.ignoring_found_inf("_fused_adamw_"),
    **{q: _no_kernel(q) for q in ("_fused_adamw_.tensor_lr", "_fused_adam_", "_fused_adam_.tensor_lr",
                                  "_fused_adagrad_", "_fused_adagrad_.tensor_lr", "_scaled_mm.out")},
    "_fused_sgd_": simdevice.scale_blind("_fused_sgd_", _momentum_positive),
    "_fused_sgd_.tensor_lr": simdevice.scale_blind("_fused_sgd_.tensor_lr", _momentum_positive),
    "_scaled_mm": _scaled_mm,
}
npu_module = simdevice.install("npu", bf16=BF16, device_count=1, saturation=not INF_NAN, module_class=_NPUModule,
                               kernels=_KERNELS, autocast_lists=AUTOCAST_LISTS)

from . import _C  # noqa: E402  (torch_npu._C: the options)
from . import npu  # noqa: E402  (torch_npu.npu: the overflow-status functions, utils, set_option)

_C._apply_precision_mode()

__version__ = ".".join(torch.__version__.split("+")[0].split(".")[:3]) + ".post1"
