"""A device's autocast lists: which ops its autocast runs in the low dtype, in float32, in the widest
input dtype, or refuses, as the device's own source registers them.

torch's lists differ by device type (``aten/src/ATen/autocast_mode.cpp``, torch 2.13: one block each
for CUDA, MPS, CPU and XPU), and vendors bring their own (torch_npu's ``AutoCastOps.cpp``, the Intel
Gaudi bridge's ``hpu_ops/autocast_helpers.h``). A device declares its lists
(:attr:`amp_backends.devices.contract.Device.autocast_lists`); the precision policy, the inspector
and the conformance suite read them instead of assuming CUDA's. :meth:`AutocastLists.module_policy`
answers for a module: what its op does under that device's autocast.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from torch import nn

__all__ = [
    "CPU", "CUDA", "GAUDI", "GAUDI_FP32_VARIABLE", "GAUDI_LOWER_VARIABLE", "MODULE_OPS", "MPS", "POLICIES",
    "UPSAMPLE", "XPU", "AutocastLists", "gaudi",
]

#: What an autocast does with an op: run it in the autocast dtype, in float32, in the widest floating
#: dtype of its inputs, or raise.
POLICIES = ("lower", "fp32", "promote", "banned")


@dataclass(frozen=True)
class AutocastLists:
    """One device's autocast lists, by ATen op name (overloads share their op's policy). An op in no
    list falls through: it runs in its inputs' dtype. Where lists overlap (Gaudi's), the first of
    lower, float32, promote wins, as the Gaudi bridge orders them; a banned op raises first."""

    lower: frozenset[str]
    fp32: frozenset[str]
    promote: frozenset[str] = frozenset()
    banned: frozenset[str] = frozenset()
    #: Where the lists are read from.
    source: str = ""
    #: Ops of which only the first input is cast (Gaudi's norms); the op still runs in the low dtype.
    first_input_only: frozenset[str] = field(default=frozenset())

    def policy(self, op: str) -> str | None:
        """``"lower"``, ``"fp32"``, ``"promote"``, ``"banned"`` for ``op`` (an ATen name such as
        ``"layer_norm"``), or None where the op runs in its inputs' dtype."""
        if op in self.banned:
            return "banned"
        for name in ("lower", "fp32", "promote"):
            if op in getattr(self, name):
                return name
        return None

    def module_policy(self, module: nn.Module | type) -> str | None:
        """What ``module``'s op does under this autocast (:data:`MODULE_OPS`: the first of the ops it
        runs that a list names decides), or None where it runs in its inputs' dtype or is not known."""
        cls = module if isinstance(module, type) else type(module)
        for known in cls.__mro__:
            ops = MODULE_OPS.get(known)
            if ops is not None:
                return next((p for p in map(self.policy, ops) if p is not None), None)
        return None

    def modules(self, policy: str) -> tuple[type, ...]:
        """The module classes of :data:`MODULE_OPS` whose op has ``policy`` here."""
        if policy not in POLICIES:
            raise ValueError(f"AutocastLists.modules: {policy!r} is not a policy; use one of {', '.join(POLICIES)}")
        return tuple(cls for cls in MODULE_OPS if self.module_policy(cls) == policy)

    def changed(self, source: str, **lists: Iterable[str]) -> AutocastLists:
        """These lists with some replaced (each a whole list), citing ``source``."""
        unknown = sorted(set(lists) - {"lower", "fp32", "promote", "banned", "first_input_only"})
        if unknown:
            raise TypeError(f"AutocastLists.changed: no list named {', '.join(unknown)}")
        return replace(self, source=source, **{k: frozenset(v) for k, v in lists.items()})


def _ops(text: str) -> frozenset[str]:
    return frozenset(text.split())


#: ATen ops a module's forward runs, in the order they decide its policy (a module whose own op is in
#: no list runs the ops it decomposes into: CrossEntropyLoss's log_softmax on CUDA).
MODULE_OPS: dict[type, tuple[str, ...]] = {
    nn.Linear: ("linear",), nn.Bilinear: ("bilinear",), nn.PReLU: ("prelu",),
    nn.Conv1d: ("conv1d",), nn.Conv2d: ("conv2d",), nn.Conv3d: ("conv3d",),
    nn.ConvTranspose1d: ("conv_transpose1d",), nn.ConvTranspose2d: ("conv_transpose2d",),
    nn.ConvTranspose3d: ("conv_transpose3d",),
    nn.LayerNorm: ("layer_norm",), nn.GroupNorm: ("group_norm",),
    nn.BatchNorm1d: ("batch_norm",), nn.BatchNorm2d: ("batch_norm",), nn.BatchNorm3d: ("batch_norm",),
    nn.SyncBatchNorm: ("batch_norm",),
    nn.InstanceNorm1d: ("instance_norm", "batch_norm"), nn.InstanceNorm2d: ("instance_norm", "batch_norm"),
    nn.InstanceNorm3d: ("instance_norm", "batch_norm"),
    nn.Softmax: ("softmax",), nn.LogSoftmax: ("log_softmax",),
    nn.CrossEntropyLoss: ("cross_entropy_loss", "log_softmax"), nn.NLLLoss: ("nll_loss",),
    nn.MSELoss: ("mse_loss",), nn.L1Loss: ("l1_loss",), nn.SmoothL1Loss: ("smooth_l1_loss",),
    nn.HuberLoss: ("huber_loss",), nn.KLDivLoss: ("kl_div",), nn.BCELoss: ("binary_cross_entropy",),
    nn.BCEWithLogitsLoss: ("binary_cross_entropy_with_logits",), nn.Embedding: ("embedding",),
    nn.LeakyReLU: ("leaky_relu",), nn.Dropout: ("dropout",),
    **({nn.RMSNorm: ("rms_norm",)} if hasattr(nn, "RMSNorm") else {}),
}

#: torch's upsampling ops (float32 under CUDA's autocast, absent from the MPS and torch_npu lists).
UPSAMPLE = _ops("""
    upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d
    _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d
    upsample_bicubic2d _upsample_bicubic2d_aa
""")

#: torch 2.13's CUDA lists (``aten/src/ATen/autocast_mode.h``: ``AT_FORALL_LOWER_PRECISION_FP``,
#: ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``
#: (``norm``), ``AT_FORALL_PROMOTE``; the CUDA block of ``autocast_mode.cpp`` adds the cuDNN convolutions
#: and bans ``binary_cross_entropy``). torch_mlu and torch_musa register the same macros.
CUDA = AutocastLists(
    lower=_ops("""
        _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d convolution
        cudnn_convolution cudnn_convolution_transpose prelu addmm addmv addr matmul einsum mm mv linalg_vecdot
        linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell
        lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention
        scaled_dot_product_attention
    """),
    fp32=_ops("""
        acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus layer_norm
        native_layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity poisson_nll_loss
        cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss
        mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss
        binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp rms_norm
        prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum norm
    """) | UPSAMPLE,
    promote=_ops("addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"),
    banned=_ops("binary_cross_entropy"),
    source="torch 2.13 aten/src/ATen/autocast_mode.cpp, CUDA block (the macros of autocast_mode.h)",
)

#: torch 2.13's XPU lists: the same macros as CUDA's without the cuDNN convolutions, and the same ban on
#: ``binary_cross_entropy`` (``autocast_mode.cpp``, XPU block).
XPU = CUDA.changed(
    "torch 2.13 aten/src/ATen/autocast_mode.cpp, XPU block",
    lower=CUDA.lower - {"cudnn_convolution", "cudnn_convolution_transpose"},
)

#: torch 2.13's MPS lists, written out by hand in ``autocast_mode.cpp`` (MPS block): fewer lowered ops,
#: ``batch_norm`` and ``conv_transpose3d`` in float32 (MPS has no half-precision 3-d transposed convolution),
#: no upsampling, ``norm`` or ``rms_norm``; nothing banned (BCE falls through).
MPS = AutocastLists(
    lower=_ops("""
        _convolution _mps_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d
        convolution prelu addmm addmv addr matmul einsum mm mv linear addbmm baddbmm bmm
        chain_matmul linalg_multi_dot lstm_cell scaled_dot_product_attention
    """),
    fp32=(CUDA.fp32 - UPSAMPLE - {"norm", "rms_norm"}) | {"batch_norm", "conv_transpose3d"},
    promote=CUDA.promote - {"vdot"},
    source="torch 2.13 aten/src/ATen/autocast_mode.cpp, MPS block",
)

#: torch 2.13's CPU lists (``autocast_mode.cpp``, CPU block): norms and softmax are not listed (they run
#: in their input's dtype); losses, linear algebra, FFTs and 3-d pooling run in float32, including
#: ``binary_cross_entropy`` (not banned).
CPU = AutocastLists(
    lower=_ops("""
        conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm _addmm_activation addbmm linear _convolution matmul
        conv_tbc mkldnn_rnn_layer conv_transpose1d conv_transpose2d conv_transpose3d prelu
        scaled_dot_product_attention _native_multi_head_attention
    """),
    fp32=_ops("""
        avg_pool3d binary_cross_entropy grid_sampler polar prod quantile nanquantile stft cdist grid_sampler_2d
        _grid_sampler_2d_cpu_fallback grid_sampler_3d trace view_as_complex cholesky cholesky_inverse cholesky_solve
        inverse lu_solve orgqr ormqr pinverse max_pool3d max_unpool2d max_unpool3d adaptive_avg_pool3d
        reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d replication_pad3d mse_loss
        cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss poisson_nll_loss smooth_l1_loss
        cross_entropy_loss l1_loss huber_loss margin_ranking_loss soft_margin_loss triplet_margin_loss
        multi_margin_loss ctc_loss kl_div multilabel_margin_loss binary_cross_entropy_with_logits fft_fft fft_ifft
        fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn fft_hfft
        fft_ihfft linalg_cond linalg_matrix_rank linalg_solve linalg_cholesky linalg_svdvals linalg_eigvals
        linalg_eigvalsh linalg_inv linalg_householder_product linalg_tensorinv linalg_tensorsolve
        fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd triangular_solve fractional_max_pool2d
        fractional_max_pool3d adaptive_max_pool3d multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex
        linalg_svd linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex
    """),
    promote=_ops("stack cat index_copy"),
    source="torch 2.13 aten/src/ATen/autocast_mode.cpp, CPU block",
)

#: The Intel Gaudi bridge's default lists (HabanaAI/gaudi-pytorch-bridge v1.19.0,
#: ``hpu_ops/autocast_helpers.h``: ``default_lower_ops``, ``default_fp32_ops``, ``promote_list``,
#: ``lower_first_ops``): norms, softmax and dropout in bf16; losses, ``div``, ``exp`` and ``pow`` in
#: float32; ``binary_cross_entropy`` in float32, not banned.
GAUDI = AutocastLists(
    lower=_ops("""
        addmm addbmm batch_norm baddbmm bmm conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d
        dot dropout feature_dropout group_norm instance_norm layer_norm leaky_relu linear matmul mean mm mul mv
        softmax log_softmax scaled_dot_product_attention
    """),
    fp32=_ops("""
        acos addcdiv asin atan2 bilinear binary_cross_entropy binary_cross_entropy_with_logits cdist cosh
        cosine_embedding_loss cosine_similarity cross_entropy_loss dist div divide embedding embedding_bag erfinv
        exp expm1 hinge_embedding_loss huber_loss kl_div l1_loss log log10 log1p log2 logsumexp margin_ranking_loss
        mse_loss multi_margin_loss multilabel_margin_loss nll_loss pdist poisson_nll_loss pow reciprocal renorm
        rsqrt sinh smooth_l1_loss soft_margin_loss softplus tan topk triplet_margin_loss truediv true_divide
    """),
    promote=_ops("add addcmul addcdiv cat div exp mul pow sub iadd truediv stack"),
    first_input_only=_ops("layer_norm group_norm instance_norm batch_norm"),
    source="Intel Gaudi bridge v1.19.0 hpu_ops/autocast_helpers.h (default lists)",
)

#: The bridge's variables replacing its default lists: each names a text file with one op per line,
#: read once when the bridge loads (``hpu_ops/backend/autocast_helpers.cpp``, ``load_list``).
GAUDI_LOWER_VARIABLE = "PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST"
GAUDI_FP32_VARIABLE = "PT_HPU_AUTOCAST_FP32_OPS_LIST"


def gaudi(environ: Mapping[str, str] | None = None) -> AutocastLists:
    """Gaudi's lists as the bridge would load them under ``environ`` (default: ``os.environ``): the
    defaults, with the lower and float32 lists each replaced by the file its variable names (each line
    taken whole, as the bridge reads it; a file that cannot be read leaves the default, with a
    warning, as the bridge does). The promote list is fixed."""
    env = os.environ if environ is None else environ
    lists, sources = {}, []
    for variable, name in ((GAUDI_LOWER_VARIABLE, "lower"), (GAUDI_FP32_VARIABLE, "fp32")):
        path = env.get(variable)
        if not path:
            continue
        ops = _read_list(variable, path)
        if ops is not None:
            lists[name] = ops
            sources.append(f"{variable}={path}")
    if not lists:
        return GAUDI
    return GAUDI.changed(f"{GAUDI.source}, replaced by {', '.join(sources)}", **lists)


def _read_list(variable: str, path: str) -> frozenset[str] | None:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            lines = f.read().split("\n")
    except OSError as exc:
        warnings.warn(f"{variable}={path!r} cannot be read ({exc.strerror or exc}): the Gaudi bridge keeps its default "
                      "list, and so does amp_backends. Point the variable at a text file with one op name per line",
                      RuntimeWarning, stacklevel=3)
        return None
    ops = [line for line in lines if line]
    padded = [op for op in ops if op != op.strip()]
    if padded:
        warnings.warn(f"{variable}={path!r}: line(s) {', '.join(map(repr, padded[:3]))} carry spaces or a carriage "
                      "return; the Gaudi bridge takes each line whole, so they name no op. Write one bare op name "
                      "per line (Unix line endings)", RuntimeWarning, stacklevel=3)
    return frozenset(ops)
