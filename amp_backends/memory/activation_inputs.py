"""An activation's input, recomputed in backward from the input of the layer that made it.

In a transformer's MLP the activation reads the up-projection's output (BERT's intermediate dense,
GPT-2's ``c_fc``, Llama's ``gate_proj``) and saves it for its backward: a tensor of the MLP's inner width,
while the up-projection keeps its own input, of the model's width (four times narrower in BERT and GPT-2),
for its weight's gradient. :func:`recompute_activation_inputs` saves the activation's input as the
up-projection's input instead (kept anyway where the up-projection's weight is trained; the narrower
tensor where it is frozen), and the backward runs the up-projection again from it: one matmul a layer
more (a tenth of the layer's matmul work in BERT and GPT-2), for 48 MiB a layer of BERT-base or GPT-2 small
at 8,192 tokens in bfloat16 (576 MiB over twelve layers). With :mod:`.activation_outputs` also on, the
activation's output (the down-projection's saved input) is remade from the same recomputation, made
once a backward and shared (:mod:`.substitutes`): the MLP then keeps nothing of its inner width. In a
stack of MLPs (``Linear, GELU, Linear, GELU, ...``) an up-projection's input is then itself remade: the
narrower of it and the output is kept, so that remakings chain within one MLP (chained back through the
stack, the first backward node would remake all of it at once, each remade tensor alive until its unpack).

Exact: the recomputation is the layer's own op (``F.linear``, or ``addmm`` for Transformers' ``Conv1D``)
on the same input, with the weight and bias autocast used (cast again from the parameters where autocast
cast them: the same rounding), with autocast off; the gradients are bitwise those without the lever. A
weight or bias edited in place between the forward and the backward is refused at the backward
(:class:`UpProjectionEdited`), as autograd refuses an edited saved tensor. Where the layer's input is
float32 and autocast casts it (a GPU's LayerNorm output), a forward pre-hook makes that cast itself
(``x.to(dtype)``, as autocast does, as :mod:`.shared_casts` does), so that the copy the layer saves is the one
the recomputation starts from: nothing more is kept.

Which layers: an ``nn.Linear`` or Transformers' ``Conv1D`` beside a known activation module
(:func:`.activation_outputs.pure_function`) under one parent, whose output that activation reads next,
with neither it nor the layer's input edited in between; not a layer with a forward set on it (a
precision policy's float32 one: its input is left as it came) or weights that are not its parameters
(``torch.func.functional_call``, FSDP1's flat-parameter views).
Off by default in :func:`~amp_backends.memory.memory_lean` (``activation_inputs=True``): it trades a
matmul a layer for the memory. It stands aside where others' hooks run around either layer (they see
what they would without it), and does nothing under ``torch.compile`` or without grad.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdRef

from .. import torch_private
from . import substitutes
from .activation_outputs import _may_become_pure, pure_function
from .shared_casts import autocast_copy_dtype
from .substitutes import SubstituteSourceEdited

__all__ = ["ActivationInputs", "UpProjectionEdited", "recompute_activation_inputs"]

#: Transformers' GPT-2 layer (``addmm(bias, x, weight)``, the weight stored transposed), by qualified name
_CONV1D = "transformers.pytorch_utils.Conv1D"


class UpProjectionEdited(SubstituteSourceEdited):
    """An up-projection's weight or bias edited in place between the forward and the backward that runs it again."""


def _kind(module: nn.Module) -> str | None:
    """"linear" or "conv1d" for a layer whose forward this lever knows (its class's own), else None."""
    cls = type(module)
    if cls is nn.Linear:
        return "linear"
    if f"{cls.__module__}.{cls.__qualname__}" == _CONV1D and cls.forward.__qualname__ == "Conv1D.forward":
        return "conv1d"
    return None


class _UpProjection:
    """The layer's op again, on its input, with the weights autocast used: what the backward calls."""

    __slots__ = ("bias", "dtype", "kind", "versions", "weight")

    def __init__(self, module: nn.Module, kind: str, dtype: torch.dtype) -> None:
        self.kind, self.dtype = kind, dtype
        self.weight: torch.Tensor = module.get_parameter("weight")  # (a Parameter: checked by _made)
        self.bias: torch.Tensor | None = module.bias if isinstance(module.bias, torch.Tensor) else None
        self.versions = (self.weight._version, None if self.bias is None else self.bias._version)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if (weight._version, None if bias is None else bias._version) != self.versions:
            raise UpProjectionEdited(
                f"an up-projection's weight ({tuple(weight.shape)}, {weight.dtype}) or bias was edited in place "
                "between the forward and the backward, which runs the layer again from its input and would be "
                "wrong: step the optimizer after the backward, or turn the memory_lean lever off "
                "(activation_inputs=False)")
        weight = weight.to(self.dtype)  # autocast's cast of the parameters (a no-op where they are this dtype)
        bias = None if bias is None else bias.to(self.dtype)
        if self.kind == "conv1d":
            assert bias is not None
            out = torch.addmm(bias, x.view(-1, x.size(-1)), weight)
        else:
            out = F.linear(x, weight, bias)
        return out if out._base is None else out._base  # the tagged tensor is the op's own, not a view of it


class _Made:
    """An up-projection's output, weakly, with the layer, its input and both versions. The input is held
    (:attr:`held`) from the layer's forward until an activation reads the output, the output dies or the
    running owner block's forward ends, whichever comes first. Held whether or not anything else keeps it:
    what lives must not depend on the hooks beneath, nor on whether the owner's hooks run (a checkpoint
    keeps the layer's save of it in its recomputation, not in the forward; torch's selective checkpoint
    of a block's forward recomputes it without the block's hooks), else the two would differ: another
    tensor substituted, or another lever's copy shared in one and made again in the other."""

    __slots__ = ("held", "kind", "module", "out", "version", "x", "x_version")

    def __init__(self, out: torch.Tensor, module: nn.Module, kind: str, x: torch.Tensor) -> None:
        self.out = WeakIdRef(out, functools.partial(_forget, id(out)))
        self.x = WeakIdRef(x)
        self.held: torch.Tensor | None = x
        substitutes.at_block_end(self.release)
        self.module, self.kind, self.version, self.x_version = module, kind, out._version, x._version

    def release(self) -> None:
        """Hold the input no longer (the owner block's forward ended, the output was read or died)."""
        self.held = None


#: id of a live up-projection output -> how it was made
_MADE: dict[int, _Made] = {}


def _forget(key: int, _ref: Any) -> None:
    made = _MADE.pop(key, None)
    if made is not None:
        made.release()


def _cast(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Forward pre-hook of an up-projection: its float32 input cast as autocast would cast it, so that
    the copy it saves is the one the backward runs it again from."""
    x = args[0] if args else None
    dtype = autocast_copy_dtype(x)
    if dtype is None or substitutes.leaves_alone(module, _cast, "activation_inputs"):
        return None  # (a forward set on the layer, a precision policy's float32 one, is given its input as it came)
    assert isinstance(x, torch.Tensor)
    return (x.to(dtype), *args[1:])


def _made(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
    """Forward hook of an up-projection: note its output and input, for the activation that reads it."""
    if (torch.compiler.is_compiling() or not torch.is_grad_enabled() or len(args) != 1
            or not isinstance(out, torch.Tensor) or not isinstance(args[0], torch.Tensor)
            or not out.requires_grad or args[0].dtype != out.dtype or torch_private.function_modes_on()):
        return  # (a function mode may have changed the output: its recomputation would run outside it)
    kind = _kind(module)
    if kind is None or not isinstance(module.weight, nn.Parameter):
        return  # weights that are not its parameters (functional_call, FSDP1's views)
    if not substitutes.leaves_alone(module, _made, "activation_inputs"):
        _MADE[id(out)] = _Made(out, module, kind, args[0])


def _tag(module: nn.Module, args: tuple[Any, ...]) -> None:
    """Forward pre-hook of an activation: where its input is an up-projection's output just made, that
    output is saved as the up-projection's input (until the activation saves it) and remade from it."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or len(args) != 1:
        return
    h = args[0]
    made = _MADE.get(id(h)) if isinstance(h, torch.Tensor) else None
    x = made.x() if made is not None else None
    if made is None or x is None or made.out() is not h or h._version != made.version or x._version != made.x_version:
        return  # not an up-projection's output just made, or it or the layer's input edited since
    if pure_function(module) is None:  # (its forward checked there: GPT-2's GELU run fused is known)
        return
    if substitutes.others_hooked(module, _tag):
        substitutes.stand_aside(module, _tag, "activation_inputs")
        return
    base = h if h._base is None else h._base
    _MADE.pop(id(h), None)
    made.release()  # read: what the tag needs, the tag holds
    chain = True
    if substitutes.tagged(x):  # the layer's input is itself remade (an activation's output, in a stack of MLPs)
        # Chained through it, the tags would reach back to the stack's input, and the first backward node
        # would remake the whole stack, each remade tensor alive until its own unpack. Kept instead: the
        # input itself, not its source, where it is the narrower; else the output, as it is.
        x_base = x if x._base is None else x._base
        if x_base.numel() >= base.numel():
            return
        chain = False
    substitutes.substitute(base, x, _UpProjection(made.module, made.kind, h.dtype), "an up-projection's input", chain)
    substitutes.open_scope(base)  # until the activation saves it


class ActivationInputs(substitutes.Hooked):
    """What :func:`recompute_activation_inputs` turned on (:attr:`modules`: the layers hooked, of which
    :attr:`activations` the activations, the others the linears beside them; :attr:`scopes`: the blocks
    inside which it is done); :meth:`remove` turns it off."""

    def __init__(self, modules: list[nn.Module], activations: list[nn.Module], scopes: list[nn.Module],
                 handles: list[Any]) -> None:
        super().__init__(modules, handles)
        self.activations, self.scopes = activations, scopes

    def remove(self) -> None:
        super().remove()
        self.activations, self.scopes = [], []

    def __repr__(self) -> str:
        return f"ActivationInputs({len(self.activations)} activations in {len(self.scopes)} scopes)"


def recompute_activation_inputs(model: nn.Module) -> ActivationInputs:
    """Save the inputs of ``model``'s activation modules as the inputs of the up-projections that made
    them, and run those again in backward (see the module docstring)."""
    hooked: dict[int, nn.Module] = {}
    activations: list[nn.Module] = []
    handles: list[Any] = []
    blocks: list[str] = []
    named = dict(model.named_modules(remove_duplicate=False))
    for parent_name, parent in named.items():
        children = list(parent.named_children())
        acts = [(n, c) for n, c in children if pure_function(c) is not None or _may_become_pure(c)]
        ups = [c for _, c in children if _kind(c) is not None]
        if not acts or not ups:
            continue
        for up in ups:
            if id(up) not in hooked:
                hooked[id(up)] = up
                handles += [up.register_forward_pre_hook(_cast), up.register_forward_hook(_made)]
        for _, act in acts:
            if id(act) not in hooked:
                hooked[id(act)] = act
                activations.append(act)
                handles.append(act.register_forward_pre_hook(_tag))
        blocks.append(substitutes.owner_name(named, f"{parent_name}.{acts[0][0]}" if parent_name else acts[0][0]))
    scopes = substitutes.outermost(model, blocks) if hooked else []
    return ActivationInputs(list(hooked.values()), activations, scopes, handles + substitutes.owners(scopes))
