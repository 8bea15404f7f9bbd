"""An activation's output, recomputed from its input for the ops that save it.

In a transformer's MLP the activation's output is the next linear's input, and that linear saves it for
its weight's gradient, while the activation itself saves its input: two tensors of the MLP's widest
shape per layer, where one determines the other. GPT-2 small and BERT-base at the bench's batches
(8,192 tokens, inner width 3,072, bfloat16) keep 48 MiB a layer of such outputs, 576 MiB over twelve layers;
Llama's MLP saves ``act(gate)`` for its product with ``up`` the same way.

:func:`recompute_activation_outputs` tags the output of each activation module it knows the pure
function of (:func:`pure_function`: ``nn.GELU``, ``nn.SiLU``, ``nn.Mish`` and Transformers' modules
running ``F.gelu``, ``F.silu`` or ``F.mish``, GPT-2's written-out GELU once :mod:`.activations` runs it
fused), and from then to the end of the activation's grandparent's forward (the block holding its
consumer: GPT-2's ``GPT2Block``, BERT's ``BertLayer``), an op that saves that output (or a view of it) is
handed the activation's input instead, which autograd keeps anyway; the backward recomputes the output from it
(:mod:`.substitutes`: how, what it composes with, where it does nothing). The recomputation is the same
kernel on the same input with autocast off (the output's dtype is the input's, checked at the forward),
so the gradients are bitwise those without the lever; it costs one elementwise op per layer in backward.
An input edited in place after the forward is refused at the backward, as autograd refuses it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import torch_private
from . import substitutes
from .activations import _approximate, _FusedGelu, class_forward_is_its_own
from .substitutes import SubstituteSourceEdited

__all__ = ["ActivationOutputs", "RecomputedInputEdited", "pure_function", "recompute_activation_outputs"]

_TRANSFORMERS_FUNCTIONS = (F.gelu, F.silu, F.mish)
#: torch's activation modules whose forward is ``F.<name>(input, ...)`` of their input alone
_TORCH: dict[type[nn.Module], Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor] | None]] = {
    nn.GELU: lambda m: functools.partial(F.gelu, approximate=str(m.approximate)),
    nn.SiLU: lambda m: None if m.inplace else F.silu,
    nn.Mish: lambda m: None if m.inplace else F.mish,
}
#: Transformers' activation modules whose forward is ``self.act(input)`` (or ``F.silu(input)``)
_TRANSFORMERS = {"GELUActivation", "GELUTanh", "MishActivation", "SiLUActivation"}


#: An activation's input edited in place between the forward and the backward that recomputes its output.
RecomputedInputEdited = SubstituteSourceEdited


def _plain_function(fn: Any) -> bool:
    """``F.gelu``/``F.silu``/``F.mish``, or a ``functools.partial`` of one with keywords only."""
    if isinstance(fn, functools.partial):
        return not fn.args and fn.func in _TRANSFORMERS_FUNCTIONS
    return fn in _TRANSFORMERS_FUNCTIONS


def pure_function(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The function of its input alone that ``module``'s forward computes, where it is one this module
    knows (see the module docstring); None for anything else (a forward replaced by something unknown,
    an in-place activation, a subclass)."""
    own = vars(module).get("forward")
    if own is not None:  # a forward installed on the instance: only GPT-2's GELU run fused is known
        return functools.partial(F.gelu, approximate=own.approximate) if isinstance(own, _FusedGelu) else None
    kind = type(module)
    if kind in _TORCH:
        return _TORCH[kind](module) if class_forward_is_its_own(kind) else None
    if kind.__module__ != "transformers.activations" or kind.__qualname__ not in _TRANSFORMERS:
        return None
    if not class_forward_is_its_own(kind):  # a kernel put in its place, or a wrapper around it
        return None
    if kind.__qualname__ == "SiLUActivation":
        return F.silu
    act = getattr(module, "act", None)
    return act if _plain_function(act) else None


def _tag(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    """Forward hook of an activation: its output may be saved as its input and recomputed."""
    if (torch.compiler.is_compiling() or not torch.is_grad_enabled() or len(args) != 1
            or not isinstance(output, torch.Tensor) or not isinstance(args[0], torch.Tensor)
            or not output.requires_grad or output is args[0] or output._base is not None
            or output.dtype != args[0].dtype or torch_private.function_modes_on()):
        return  # (a function mode may have changed the output: its recomputation would run outside it)
    if substitutes.others_hooked(module, _tag):  # they may have replaced or edited the output: not the function's
        substitutes.stand_aside(module, _tag, "activation_outputs")
        return
    fn = pure_function(module)
    if fn is not None:
        substitutes.substitute(output, args[0], fn, "an activation's input")
        substitutes.open_scope(output)  # until its consumer, later in the block, saves it
    elif (foreign := substitutes.foreign_forward(module)) is not None:
        substitutes.stand_aside(module, _tag, "activation_outputs", foreign)


class ActivationOutputs(substitutes.Hooked):
    """What :func:`recompute_activation_outputs` turned on (:attr:`modules`: the activations whose outputs
    are recomputed; :attr:`scopes`: the blocks inside which that is done); :meth:`remove` turns it off."""

    def __init__(self, activations: list[nn.Module], scopes: list[nn.Module], handles: list[Any]) -> None:
        super().__init__(activations, handles)
        self.scopes = scopes

    def remove(self) -> None:
        super().remove()
        self.scopes = []

    def __repr__(self) -> str:
        return f"ActivationOutputs({len(self.modules)} activations in {len(self.scopes)} scopes)"


def recompute_activation_outputs(model: nn.Module) -> ActivationOutputs:
    """Recompute the outputs of ``model``'s activation modules (:func:`pure_function`) from their inputs
    for the ops that save them, instead of keeping both (see the module docstring)."""
    activations: dict[int, nn.Module] = {}
    blocks: list[str] = []
    named = dict(model.named_modules(remove_duplicate=False))
    for name, module in named.items():
        if pure_function(module) is None and not _may_become_pure(module):
            continue
        activations[id(module)] = module
        blocks.append(substitutes.owner_name(named, name))  # the block holding its consumer
    handles = [module.register_forward_hook(_tag) for module in activations.values()]
    scopes = substitutes.outermost(model, blocks) if activations else []
    return ActivationOutputs(list(activations.values()), scopes, handles + substitutes.owners(scopes))


def _may_become_pure(module: nn.Module) -> bool:
    """A written-out GELU :mod:`.activations` can run fused (it may be fused after this lever is on)."""
    return _approximate(module) is not None and "forward" not in vars(module)
