"""What a bench model is: how to build it and a batch for it at a size, and its loss (shared by
:mod:`.bench_models` and :mod:`.bench_thirdparty`); and the modes a step runs in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

@dataclass(frozen=True)
class Mode:
    """One way to run the training step."""

    name: str
    #: "full" (fp32, tf32), "amp" (through amp_backends), "torch" (raw torch.amp), "amp-fp8" or "torchao-fp8"
    via: str
    dtype: torch.dtype | None = None
    native: bool = True
    #: why the mode cannot run here (then it is listed, not measured)
    unavailable: str | None = None


__all__ = ["Mode", "ModelSpec", "SIZES", "classify", "image_batch", "token_batch"]

SIZES = ("full", "small")


@dataclass(frozen=True)
class ModelSpec:
    """How to build one bench model and a batch for it, at a size."""

    name: str
    #: What it is, one line.
    describe: str
    #: size -> the model (on the current default device; ``meta`` for counting).
    build: Callable[[str], nn.Module]
    #: (size, device, batch or None for the size's own) -> (inputs, targets)
    batch: Callable[[str, torch.device, int | None], tuple[torch.Tensor, torch.Tensor]]
    #: The batch size of each size (what "real batch size" means for the model).
    batch_sizes: dict[str, int]
    #: What one input is, per size, as shown in the output ("224x224 images", "128 tokens").
    shapes: dict[str, str]
    #: torch.nn.functional loss of (output, targets).
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    #: The reference implementation's parameter count at full size (None for the toys).
    reference_params: int | None = None
    #: (model, inputs, targets) -> loss, for a model that computes its own loss (Transformers'
    #: ``labels=``); None: ``loss(model(inputs), targets)``.
    forward_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    #: The LM head's module name, for the lean mode's lazy logits (None: no LM head lever).
    lm_head: str | None = None

    def loss_of(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss of ``model`` on one batch, as the model's users compute it."""
        if self.forward_loss is not None:
            return self.forward_loss(model, inputs, targets)
        return self.loss(model(inputs), targets)


def classify(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1))


def image_batch(sides: dict[str, int], classes: int, sizes: dict[str, int]) -> Callable[..., Any]:
    def make(size: str, device: torch.device, batch: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        n = batch or sizes[size]
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, 3, sides[size], sides[size], generator=g)
        return x.to(device), torch.randint(0, classes, (n,), generator=g).to(device)
    return make


def token_batch(lengths: dict[str, int], vocab: dict[str, int], sizes: dict[str, int], targets: str) -> Callable[..., Any]:
    def make(size: str, device: torch.device, batch: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        n = batch or sizes[size]
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab[size], (n, lengths[size]), generator=g)
        y = torch.randint(0, 2, (n,), generator=g) if targets == "class" else torch.roll(ids, -1, dims=1)
        return ids.to(device), y.to(device)
    return make


