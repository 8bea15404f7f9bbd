"""The bench models users train, built from their libraries where those are installed:

- ``hf-gpt2``: Transformers' ``GPT2LMHeadModel(GPT2Config())``, its own next-token loss through
  ``labels=`` (which upcasts the logits to float32 and calls ``F.cross_entropy`` on them reshaped),
  124,439,808 parameters; its LM head is ``lm_head`` (the lean mode's lazy logits apply);
- ``hf-bert``: Transformers' ``BertForSequenceClassification(BertConfig())`` (2 labels, its loss
  through ``labels=``), 109,483,778 parameters; no LM head lever;
- ``tv-resnet50``: torchvision's ``resnet50(weights=None)``, 25,557,032 parameters.

Each at its library's default configuration (dropout 0.1 in both Transformers models, their GELU
and attention implementation), from the config classes: nothing is downloaded. The small size for
CPUs shrinks the configuration (fewer, narrower layers; GPT-2's vocabulary 8192; ResNet-50's stages
one bottleneck each) and says so in the model's input description.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .bench_spec import ModelSpec, classify, image_batch, token_batch

__all__ = ["THIRD_PARTY_MODELS", "THIRD_PARTY_NAMES", "third_party_unavailable"]

#: model -> (the module it needs, the pip package)
_NEEDS = {"hf-gpt2": ("transformers", "transformers"), "hf-bert": ("transformers", "transformers"),
          "tv-resnet50": ("torchvision", "torchvision")}
THIRD_PARTY_NAMES = tuple(_NEEDS)

_GPT2_SMALL = dict(n_embd=128, n_layer=2, n_head=2, vocab_size=8192, n_positions=256, bos_token_id=0, eos_token_id=0)
_BERT_SMALL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512)


def third_party_unavailable(name: str) -> str | None:
    """Why ``name`` cannot be built here (its library is not installed), or None."""
    if name not in _NEEDS:
        return None
    module, package = _NEEDS[name]
    if importlib.util.find_spec(module) is None:
        return f"{name} needs {module}, which is not installed (pip install {package})"
    return None


def _gpt2(size: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config() if size == "full" else GPT2Config(**_GPT2_SMALL)
    config.loss_type = "ForCausalLM"  # its default loss, named (else Transformers warns that none is set)
    return GPT2LMHeadModel(config)


def _bert(size: str) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig() if size == "full" else BertConfig(**_BERT_SMALL))


def _resnet50(size: str) -> nn.Module:
    from torchvision.models import resnet50
    from torchvision.models.resnet import Bottleneck, ResNet

    return resnet50(weights=None) if size == "full" else ResNet(Bottleneck, [1, 1, 1, 1], num_classes=100)


def _labels(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A Transformers model's own loss: ``model(input_ids=..., labels=...).loss``."""
    return model(input_ids=inputs, labels=targets).loss


def _next_token(out: Any, ids: torch.Tensor) -> torch.Tensor:
    """GPT-2's loss from its output (``amp-backends check`` calls the model without labels)."""
    logits = out.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def _classify_logits(out: Any, target: torch.Tensor) -> torch.Tensor:
    return classify(out.logits, target)


def _labels_are_inputs(make: Callable[..., Any]) -> Callable[..., Any]:
    """A batch whose targets are its token ids (Transformers' causal LM shifts ``labels`` itself)."""
    def batch(size: str, device: torch.device, n: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        ids, _ = make(size, device, n)
        return ids, ids
    return batch


_ALL: dict[str, ModelSpec] = {
    "hf-gpt2": ModelSpec(
        "hf-gpt2", "Transformers' GPT2LMHeadModel (GPT2Config(), dropout 0.1), its own loss (labels=)",
        _gpt2,
        _labels_are_inputs(token_batch({"full": 512, "small": 64}, {"full": 50257, "small": 8192},
                                        {"full": 16, "small": 4}, "next")),
        {"full": 16, "small": 4},
        {"full": "512 tokens", "small": "64 tokens; config shrunk: width 128, 2 layers, vocabulary 8192"},
        _next_token, reference_params=124_439_808, forward_loss=_labels, lm_head="lm_head",
    ),
    "hf-bert": ModelSpec(
        "hf-bert", "Transformers' BertForSequenceClassification (BertConfig(), dropout 0.1), its own loss (labels=)",
        _bert,
        token_batch({"full": 128, "small": 64}, {"full": 30522, "small": 30522}, {"full": 64, "small": 8}, "class"),
        {"full": 64, "small": 8},
        {"full": "128 tokens", "small": "64 tokens; config shrunk: width 128, 2 layers, feed-forward 512"},
        _classify_logits, reference_params=109_483_778, forward_loss=_labels,
    ),
    "tv-resnet50": ModelSpec(
        "tv-resnet50", "torchvision's resnet50(weights=None)",
        _resnet50,
        image_batch({"full": 224, "small": 64}, 100, {"full": 128, "small": 8}),
        {"full": 128, "small": 8},
        {"full": "224x224 images", "small": "64x64 images; one bottleneck per stage, 100 classes"},
        classify, reference_params=25_557_032,
    ),
}

#: The libraries' models this installation can build.
THIRD_PARTY_MODELS: dict[str, ModelSpec] = {k: v for k, v in _ALL.items() if third_party_unavailable(k) is None}
