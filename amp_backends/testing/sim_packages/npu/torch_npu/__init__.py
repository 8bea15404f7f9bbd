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
- the release number is the torch release it is built for;
- ``ACL_PRECISION_MODE`` (``csrc/framework/interface/EnvVariables.cpp`` ``IsAllowFP32ToFP16``,
  ``csrc/framework/LazyInitAclops.cpp``): ``allow_fp32_to_fp16`` by default on chips below
  Ascend910B1 (the saturation-mode ones), ``must_keep_origin_dtype`` from it on; float32 matrix ops
  then run in float16 on the device (results float32); ``torch_npu.npu.set_option`` changes it
  (``npu/npu_config.py``'s check and message), ``torch_npu._C._npu_getOption`` reads what was set.

- op-plugin's fused optimizers (``op_plugin/config/op_plugin_functions.yaml``,
  ``op_plugin/ops/opapi/``): ``_fused_adamw_`` takes ``grad_scale`` and ``found_inf`` and reads
  neither (``FusedAdamWKernelNpuOpApi.cpp``: the update runs on the gradients as they are); no
  ``_fused_adam_`` and no ``_fused_adamw_.tensor_lr``; ``_fused_sgd_`` returns when found_inf is 1,
  and refuses momentum <= 0 (``FusedSgdKernelOpApi.cpp``).

- autocast: torch_npu's own lists (``csrc/aten/AutoCastOps.cpp``), not CUDA's: flash attention
  (``_scaled_dot_product_flash_attention``) in the low dtype, no ``linalg_vecdot``; no upsampling
  in float32; ``norm`` in float32 (fp32_append_dtype); no ``vdot``, ``cat`` or ``stack`` promoted;
  ``binary_cross_entropy`` banned.
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
    "_fused_adamw_.tensor_lr": simdevice.absent("_fused_adamw_.tensor_lr"),
    "_fused_adam_": simdevice.absent("_fused_adam_"),
    "_fused_adam_.tensor_lr": simdevice.absent("_fused_adam_.tensor_lr"),
    "_fused_sgd_": _fused_sgd("_fused_sgd_"),
    "_fused_sgd_.tensor_lr": _fused_sgd("_fused_sgd_.tensor_lr"),
}
npu_module = simdevice.install("npu", bf16=BF16, device_count=1, saturation=not INF_NAN, module_class=_NPUModule,
                               kernels=_KERNELS, autocast_lists=AUTOCAST_LISTS)

from . import _C  # noqa: E402  (torch_npu._C: the options)
from . import npu  # noqa: E402  (torch_npu.npu: the overflow-status functions, utils, set_option)

_C._apply_precision_mode()

__version__ = ".".join(torch.__version__.split("+")[0].split(".")[:3]) + ".post1"
