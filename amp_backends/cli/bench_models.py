"""The models ``amp-backends bench`` trains: the AMP recipes' real ones, from ``torch.nn`` alone.

- ``resnet50``: torchvision's ResNet-50 (bottlenecks [3, 4, 6, 3], stride on the 3x3 conv,
  batch norm, 1000 classes), 25,557,032 parameters;
- ``bert-base``: BERT-base (vocabulary 30522, 12 post-norm layers of width 768, 12 heads, GELU
  feed-forward 3072, 512 positions, 2 token types, pooler) with a 2-class head on the pooler,
  109,483,778 parameters (BertModel: 109,482,240);
- ``gpt2-small``: GPT-2 small (vocabulary 50257, 1024 positions, 12 pre-norm causal layers of
  width 768, LM head tied to the token embedding), 124,439,808 parameters;

- ``llama-block``: two Llama-style decoder blocks (RMSNorm, rotary-free causal attention through
  ``F.scaled_dot_product_attention``, SwiGLU MLP 11008) of width 4096 on 1024 tokens, the width at
  which fp8 matmuls pay (the fp8 rows' model; not in the default set), 404,770,816 parameters;

the models users train, where their libraries are installed (:mod:`.bench_thirdparty`: Transformers'
``hf-gpt2`` and ``hf-bert``, torchvision's ``tv-resnet50``, at their default configurations, dropout
included, but for GPT-2's ``use_cache=False``: below); and three toys kept from earlier releases (``mlp``, ``cnn``, ``transformer``). Each model has a
full size, the one its parameter count is given for, and a small size for CPUs (the same
architecture, narrower and shallower, on a smaller batch; GPT-2's vocabulary cut to 8192) so that
the bench finishes in about a minute on 2 cores. Nothing is downloaded: weights are random, batches synthetic.

How the built-in definitions differ from the libraries' (what ``hf-*`` and ``tv-*`` measure): no
dropout (``dropout=0.0``: no masks saved for backward), ``F.gelu`` (one fused op, where Transformers'
GPT-2 decomposes the tanh GELU into elementwise ops whose intermediates are saved), and torch's fused
attention inside ``nn.TransformerEncoderLayer`` (no attention probabilities kept where the fused kernel
runs); the loss is ``F.cross_entropy`` of the model's output, where Transformers' models compute their
own through ``labels=``. The layer shapes and parameter counts are the same.

``hf-gpt2`` trains with ``use_cache=False`` in every mode: by default the model returns a key-value cache
in training too, which the recompute lever drops (and says so, advising ``use_cache=False``) and the
other modes would keep, so their figures would not compare.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .bench_spec import SIZES, Mode, ModelSpec
from .bench_spec import classify as _classify
from .bench_spec import image_batch as _image_batch
from .bench_spec import token_batch as _token_batch
from .bench_thirdparty import THIRD_PARTY_MODELS, third_party_unavailable

__all__ = ["DEFAULT_MODELS", "LLAMA_BLOCK", "Mode", "ModelSpec", "SIZES", "REAL_MODELS", "TOY_MODELS", "MODELS",
           "format_params", "model_unavailable", "param_count"]


# -- ResNet-50 ---------------------------------------------------------------------------------
class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + identity)


class ResNet(nn.Module):
    """torchvision's ResNet with bottleneck blocks (v1.5: the stride on the 3x3 convolution)."""

    def __init__(self, layers: tuple[int, ...] = (3, 4, 6, 3), width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        blocks: list[nn.Module] = []
        inplanes = width
        for i, count in enumerate(layers):
            planes = width * 2**i
            for j in range(count):
                blocks.append(_Bottleneck(inplanes, planes, 2 if j == 0 and i > 0 else 1))
                inplanes = planes * _Bottleneck.expansion
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2, padding=1)
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# -- BERT-base -----------------------------------------------------------------------------------
class Bert(nn.Module):
    """BERT (post-norm encoder, GELU) with its pooler and a classification head on the pooler."""

    def __init__(self, vocab: int = 30522, width: int = 768, layers: int = 12, heads: int = 12,
                 positions: int = 512, classes: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(positions, width)
        self.token_types = nn.Embedding(2, width)
        self.norm = nn.LayerNorm(width, eps=1e-12)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=False, layer_norm_eps=1e-12)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.pooler = nn.Linear(width, width)
        self.classifier = nn.Linear(width, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.norm(self.tokens(ids) + self.positions(pos) + self.token_types(torch.zeros_like(ids)))
        h = self.encoder(h)
        return self.classifier(torch.tanh(self.pooler(h[:, 0])))


# -- GPT-2 small ---------------------------------------------------------------------------------
class GPT2(nn.Module):
    """GPT-2 (pre-norm causal decoder, GELU, final norm) with the LM head tied to the embedding."""

    def __init__(self, vocab: int = 50257, width: int = 768, layers: int = 12, heads: int = 12,
                 positions: int = 1024) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(positions, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           activation=lambda x: F.gelu(x, approximate="tanh"),
                                           batch_first=True, norm_first=True, layer_norm_eps=1e-5)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width, eps=1e-5)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as GPT-2's

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        pos = torch.arange(n, device=ids.device)
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=ids.device)
        h = self.blocks(self.tokens(ids) + self.positions(pos), mask=mask, is_causal=True)
        return self.head(self.norm(h))


# -- a Llama-style decoder block --------------------------------------------------------------------
class _RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class LlamaBlock(nn.Module):
    """A Llama-style decoder block: pre-norm RMSNorm, causal multi-head attention (no bias) through
    ``F.scaled_dot_product_attention``, and a SwiGLU MLP (``down(silu(gate(x)) * up(x))``)."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = _RMSNorm(width)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.mlp_norm = _RMSNorm(width)
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (p(h).view(b, n, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, d)
        x = x + self.o_proj(a)
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class LlamaBlocks(nn.Module):
    """``layers`` Llama-style decoder blocks on hidden states (no embedding, no LM head: every matmul
    is one a fp8 recipe converts)."""

    def __init__(self, width: int = 4096, heads: int = 32, hidden: int = 11008, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(LlamaBlock(width, heads, hidden) for _ in range(layers)))
        self.norm = _RMSNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks(x))


def _regress(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target)


def _hidden_batch(lengths: dict[str, int], widths: dict[str, int], sizes: dict[str, int]) -> Callable[..., Any]:
    def make(size: str, device: torch.device, batch: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        n = batch or sizes[size]
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, lengths[size], widths[size], generator=g)
        return x.to(device), torch.randn(n, lengths[size], widths[size], generator=g).to(device)
    return make


# -- the toys ------------------------------------------------------------------------------------
class _Encoder(nn.Module):
    def __init__(self, d: int, layers: int, vocab: int = 1000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


_RESNET = {"full": dict(width=64), "small": dict(width=8, classes=100)}
_BERT = {"full": dict(), "small": dict(width=128, layers=2, heads=2)}
_GPT2 = {"full": dict(), "small": dict(vocab=8192, width=128, layers=2, heads=2, positions=256)}

REAL_MODELS: dict[str, ModelSpec] = {
    "resnet50": ModelSpec(
        "resnet50", "ResNet-50 (torchvision's layout), ImageNet-shaped classification",
        lambda size: ResNet(**_RESNET[size]),
        _image_batch({"full": 224, "small": 64}, 100, {"full": 128, "small": 8}),
        {"full": 128, "small": 8}, {"full": "224x224 images", "small": "64x64 images, width 1/8"},
        _classify, reference_params=25_557_032,
    ),
    "bert-base": ModelSpec(
        "bert-base", "BERT-base with pooler, sequence classification",
        lambda size: Bert(**_BERT[size]),
        _token_batch({"full": 128, "small": 64}, {"full": 30522, "small": 30522}, {"full": 64, "small": 8}, "class"),
        {"full": 64, "small": 8}, {"full": "128 tokens", "small": "64 tokens, width 128, 2 layers"},
        _classify, reference_params=109_482_240,  # BertModel; the 2-class head adds 1,538
    ),
    "gpt2-small": ModelSpec(
        "gpt2-small", "GPT-2 small, tied LM head, next-token loss",
        lambda size: GPT2(**_GPT2[size]),
        _token_batch({"full": 512, "small": 64}, {"full": 50257, "small": 8192}, {"full": 16, "small": 4}, "next"),
        {"full": 16, "small": 4}, {"full": "512 tokens", "small": "64 tokens, width 128, 2 layers, vocabulary 8192"},
        _classify, reference_params=124_439_808, lm_head="head",
    ),
}

_LLAMA = {"full": dict(), "small": dict(width=256, heads=4, hidden=688)}

#: The fp8 rows' model (not in the default set: ``--models llama-block``).
LLAMA_BLOCK = ModelSpec(
    "llama-block", "2 Llama-style decoder blocks of width 4096 (RMSNorm, attention, SwiGLU): where fp8 pays",
    lambda size: LlamaBlocks(**_LLAMA[size]),
    _hidden_batch({"full": 1024, "small": 64}, {"full": 4096, "small": 256}, {"full": 8, "small": 2}),
    {"full": 8, "small": 2}, {"full": "1024 tokens of width 4096", "small": "64 tokens, width 256, SwiGLU 688"},
    _regress,
)

_TOY = {"full": 1.0, "small": 0.25}


def _toy_dims(size: str) -> tuple[int, int, int, int, int]:
    scale = _TOY[size]
    return (max(8, int(1024 * scale)), max(4, int(128 * scale)), max(4, int(64 * scale)),
            max(16, int(256 * scale) // 4 * 4), max(8, int(128 * scale)))


def _mlp(size: str) -> nn.Module:
    w = _toy_dims(size)[0]
    return nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w), nn.GELU(), nn.Linear(w, 10))


def _cnn(size: str) -> nn.Module:
    c = _toy_dims(size)[2]
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * c, 10),
    )


def _toy_batch(kind: str) -> Callable[..., Any]:
    def make(size: str, device: torch.device, batch: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        w, b, _, _, seq = _toy_dims(size)
        g = torch.Generator().manual_seed(0)
        if kind == "mlp":
            n = batch or b
            return torch.randn(n, w, generator=g).to(device), torch.randint(0, 10, (n,), generator=g).to(device)
        if kind == "cnn":
            n = batch or b // 2
            return torch.randn(n, 3, 32, 32, generator=g).to(device), torch.randint(0, 10, (n,), generator=g).to(device)
        n = batch or max(1, b // 8)
        return (torch.randint(0, 1000, (n, seq), generator=g).to(device),
                torch.randint(0, 1000, (n, seq), generator=g).to(device))
    return make


TOY_MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec("mlp", "toy: 3-layer MLP", _mlp, _toy_batch("mlp"), {"full": 128, "small": 32},
                     {"full": "1024 features", "small": "256 features"}, _classify),
    "cnn": ModelSpec("cnn", "toy: 3-conv CNN", _cnn, _toy_batch("cnn"), {"full": 64, "small": 16},
                     {"full": "32x32 images", "small": "32x32 images"}, _classify),
    "transformer": ModelSpec("transformer", "toy: 2-layer encoder", lambda size: _Encoder(_toy_dims(size)[3], 2),
                             _toy_batch("transformer"), {"full": 16, "small": 4},
                             {"full": "128 tokens", "small": "32 tokens"}, _classify),
}


def _without_cache(spec: ModelSpec) -> ModelSpec:
    """``spec`` with its Transformers model built with ``use_cache=False`` (see the module docstring)."""
    def build(size: str) -> nn.Module:
        model = spec.build(size)
        model.config.use_cache = False  # type: ignore[union-attr]  # a Transformers model's config; the forward reads it when not passed one
        return model

    return dataclasses.replace(spec, build=build, describe=f"{spec.describe}, use_cache=False")


_LIBRARIES = {name: _without_cache(spec) if name == "hf-gpt2" else spec for name, spec in THIRD_PARTY_MODELS.items()}

#: Every bench model this installation can build.
MODELS: dict[str, ModelSpec] = {**REAL_MODELS, **_LIBRARIES, "llama-block": LLAMA_BLOCK, **TOY_MODELS}
#: What ``amp-backends bench`` runs without ``--models``: the real models, and the libraries' where installed.
DEFAULT_MODELS: tuple[str, ...] = (*REAL_MODELS, *THIRD_PARTY_MODELS)


def model_unavailable(name: str) -> str | None:
    """Why bench model ``name`` cannot be built here (a library missing), or None."""
    return None if name in MODELS else third_party_unavailable(name)


def param_count(name: str, size: str = "full") -> int:
    """Parameters of a bench model, counted on the meta device (nothing allocated); tied
    weights once."""
    with torch.device("meta"):
        model = MODELS[name].build(size)
    return sum(p.numel() for p in model.parameters())


def format_params(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"
