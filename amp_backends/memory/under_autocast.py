"""A lean model's forward runs under autocast even where its caller opened none.

With low-precision weights (``memory_lean(weights=...)``) a model holds low-precision linears beside
norms kept in float32 (their weights, and so their outputs), and only autocast joins the two: training
runs under it, but evaluation, ``generate`` and a quick forward often do not. There Llama's, Mistral's
and T5's float32 RMSNorm output met a bfloat16 linear and raised a dtype error, ViT's float32 embeddings
likewise, and GPT-2 and BERT ran every op in bfloat16 (softmax and norms included), arithmetic other
than the training's. :func:`under_autocast` makes the model's forward open autocast in the weights'
dtype on the weights' device where none is open there (one check a call where one is: a training step
pays nothing else); a forward already under autocast runs as it is. A submodule called on its own is
not covered: its caller opens autocast, as in training.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from .. import patches

__all__ = ["UnderAutocast", "under_autocast"]


class _AutocastForward:
    """The forward of a lean model: its own, under autocast where its caller opened none (picklable)."""

    def __init__(self, module: nn.Module, previous: Any, dtype: torch.dtype, probe: torch.Tensor) -> None:
        self.module, self.previous, self.dtype, self.probe = module, previous, dtype, probe

    @property
    def __wrapped__(self) -> Any:  # (inspect.signature, and Transformers' generate, read the model's own)
        return self.previous if self.previous is not None else types.MethodType(type(self.module).forward, self.module)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)  # (called so: dynamo reads a bound
        # method of the class as the instance's attribute, which is this wrapper)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        device_type = self.probe.device.type
        if torch.is_autocast_enabled(device_type):
            return self._forward(*args, **kwargs)
        with torch.autocast(device_type, dtype=self.dtype):
            return self._forward(*args, **kwargs)


class UnderAutocast(patches.Wrapped):
    """The model :func:`under_autocast` changed; :meth:`remove` restores its forward."""

    kind = _AutocastForward


def under_autocast(model: nn.Module, dtype: torch.dtype, probe: torch.Tensor) -> UnderAutocast:
    """Make ``model``'s forward run under autocast in ``dtype`` on ``probe``'s device (a low-precision
    weight of it) where its caller opened none (see the module docstring)."""
    patches.wrap(model, "forward", _AutocastForward(model, vars(model).get("forward"), dtype, probe),
                 scope="until the lean mode's remove()", cause="the lean model's forward runs under autocast where "
                 "its caller opened none (its low-precision linears and float32 norms need it)")
    return UnderAutocast([model])
