"""The simulated device's autocast policy, on the ``AutocastPrivateUse1`` key: the op lists a device's
autocast runs in the low dtype, in float32, in the widest input dtype, or refuses (CUDA's lists by
default, as torch_mlu, torch_npu and torch_musa reuse them; a simulation may give its device's own)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["FP32_OPS", "LOWER_PRECISION_OPS", "PROMOTE_OPS", "register_autocast"]

#: Ops that run in the autocast dtype (CUDA's lower_precision_fp list, at ATen level: torch's
#: ``aten/src/ATen/autocast_mode.h`` ``AT_FORALL_LOWER_PRECISION_FP``, which the vendors'
#: ``autocast_mode.cpp`` files reuse; RNN cells included).
LOWER_PRECISION_OPS = (
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "scaled_dot_product_attention",
)
#: Ops that run in float32 under autocast (``AT_FORALL_FP32`` and ``AT_FORALL_FP32_SET_OPT_DTYPE``;
#: ``rms_norm``, in current torch's list, is not simulated).
FP32_OPS = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm",
    "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "softmax", "log_softmax", "cumsum", "cumprod", "prod", "sum", "cross_entropy_loss",
    "linalg_vector_norm", "linalg_matrix_norm", "upsample_nearest1d", "_upsample_nearest_exact1d",
    "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
    "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
#: Ops that run in the widest floating dtype among their inputs (``AT_FORALL_PROMOTE``, plus the
#: ``cat``/``stack`` that torch's lists handle the same way).
PROMOTE_OPS = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
               "scatter_add", "tensordot", "cat", "stack")

def _autocast_kernel(cast: str, op_name: str) -> Any:
    key = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        device = torch._C._get_privateuse1_backend_name()
        low = torch.get_autocast_dtype(device)
        floats = [
            x.dtype for x in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == device
        ]
        if cast == "banned":
            raise RuntimeError(
                f"torch.nn.functional.{op_name.split('.')[0]} and torch.nn.BCELoss are unsafe to autocast "
                f"({device}). Use binary_cross_entropy_with_logits or BCEWithLogitsLoss, which are safe."
            )
        if cast == "lower":
            target = low
        elif cast == "fp32":
            target = torch.float32
        else:
            target = torch.float32 if torch.float32 in floats else (floats[0] if floats else None)

        def convert(x: Any) -> Any:
            if (
                target is not None
                and isinstance(x, torch.Tensor)
                and x.is_floating_point()
                and x.device.type == device
                and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
                and x.dtype != target
            ):
                return x.to(target)
            return x

        args, kwargs = tree_map(convert, (args, kwargs))
        with torch._C._ExcludeDispatchKeyGuard(key):
            return _OVERLOADS[op_name](*args, **kwargs)

    return kernel


_OVERLOADS: dict[str, Any] = {}


def register_autocast(lib: torch.library.Library, fp32_extra: tuple[str, ...], banned: tuple[str, ...],
                       lists: dict[str, tuple[str, ...]]) -> None:
    fp32 = tuple(n for n in dict.fromkeys(lists.get("fp32", FP32_OPS) + fp32_extra) if n not in banned)
    lower, promote = lists.get("lower", LOWER_PRECISION_OPS), lists.get("promote", PROMOTE_OPS)
    for cast, names in (("lower", lower), ("fp32", fp32), ("promote", promote), ("banned", banned)):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                qualified = f"{name}.{overload}" if overload != "default" else name
                op = getattr(packet, overload)
                if op._schema.returns and all(r.alias_info is None for r in op._schema.returns):
                    _OVERLOADS[qualified] = op
                    lib.impl(qualified, _autocast_kernel(cast, qualified), "AutocastPrivateUse1")


