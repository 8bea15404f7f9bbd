"""One low-precision copy of an activation kept for backward, however many layers autocast casts it for.

Autocast caches its casts of weights (leaves that require grad), not of activations: where several
linears read one float32 activation, each casts it and each saves its own copy for its weight's
gradient. BERT's query, key and value read the float32 output of a LayerNorm (on a GPU, whose autocast
runs layer_norm in float32): three bf16 copies of the same tensor saved per layer where one would do,
24 MiB a layer at 64 x 128 tokens, 288 MiB over BERT-base; Llama's q, k, v and its gate and up
projections read its norms' outputs the same way (three copies a layer more than needed).

:func:`share_casts` puts a forward pre-hook on each ``nn.Linear`` that has a sibling ``nn.Linear`` (the
projections that may read one input): where the device's autocast would cast the float32 input to its
dtype (asked of the device once: :func:`autocast_casts_linear`), the first linear to read it is handed
``x.to(dtype)``, as autocast would cast it, and each later one (the same ``x``, unchanged since, and its
copy unchanged) a view of that copy through an autograd node of its own whose backward is the cast's
(the gradient cast to float32): so each layer's gradient reaches ``x`` in float32 and the sum is formed
there, as under autocast, while every layer saves the one copy. The forward computes what it computed
(the same values, the same matmuls, fewer casts) and the gradients are bitwise those without the lever.
The views share the copy's version counter: the copy edited in place after a layer saved it is refused at
the backward, as autograd refuses any edited saved tensor. Python runs once per linear in the forward
(the hook) and once per shared view in the backward (its node); no saved-tensor hook is involved, so the
lever works on every supported torch and composes with any hooks in force (a checkpoint, ``save_on_cpu``,
the memory ledger): they are handed the view, which shares the copy's storage.

Where the input is already low precision (a bf16 residual stream, the CPU's LayerNorm under autocast)
nothing is cast and nothing changes; nor for inference tensors (no version counter) or nested ones. A
checkpoint's recomputation runs the lever as its forward did (torch's selective checkpointing hands
back saved casts in the forward's order). A linear that reads ``x`` again (the next micro-batch's
forward, an input refilled through a numpy view, which no version counter sees) casts it again; a write
through ``.data`` between two siblings of one forward is not seen (as autograd does not see it). The
node has the cast's tangent for forward-mode AD and owes no gradient to the copy (compiled autograd
takes it). Nor for a leaf that requires
grad (learned queries), whose cast autocast caches itself, nor on a linear with hooks of its user
(:func:`.substitutes.others_hooked`) or a forward of another's set on it (accelerate's hooks): they see
its float32 input and gradient, as without the lever, and the lever says it stood aside
(:func:`.substitutes.stand_aside`). Nothing is shared under ``torch.compile`` (the compiler decides what
to save) nor inside ``torch.func``'s transforms (each layer is handed its own cast there).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdRef

from .. import torch_private
from ..torch_private import DisableTorchDispatch, DisableTorchFunction
from . import substitutes

__all__ = ["SharedCasts", "autocast_casts_linear", "autocast_copy_dtype", "share_casts"]


@functools.lru_cache(maxsize=None)
def autocast_casts_linear(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``device_type``'s autocast in ``dtype`` runs ``F.linear`` of float32 tensors in ``dtype``
    (asked of torch on a small tensor, unseen by the function and dispatch modes around the call; never
    under ``torch.compile``: the hook that asks returns first there)."""
    with DisableTorchFunction(), DisableTorchDispatch():
        x = torch.ones(2, 4, device=device_type)
        with torch.autocast(device_type, dtype=dtype):
            return F.linear(x, torch.ones(3, 4, device=device_type)).dtype == dtype


class _Shared(torch.autograd.Function):
    """``copy`` (``x`` cast to a low precision) as a view, differentiable in ``x`` as the cast is: the
    backward casts the gradient to ``x``'s float32, as the cast's own backward does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.dtype = copy.dtype  # (copy: detached, so that no gradient is owed to it; it shares the version counter)
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(torch.float32), None

    @staticmethod
    def jvp(ctx: Any, x_tangent: torch.Tensor, copy_tangent: Any) -> torch.Tensor:
        return x_tangent.to(ctx.dtype)  # forward-mode AD: the cast's own tangent


class _First:
    """The first copy made of an activation, weakly, with the activation's version, the copy's dtype and
    version, and the linears it was handed to (one of them reading ``x`` again starts a new round: a new
    cast, so that a write the version counter cannot see, a numpy view's or ``.data``'s between two
    forwards, is read as plain autocast reads it)."""

    __slots__ = ("copy", "copy_version", "dtype", "taken", "version", "x")

    def __init__(self, x: torch.Tensor, copy: torch.Tensor, module: nn.Module) -> None:
        self.x = WeakIdRef(x, functools.partial(_forget, id(x)))
        self.copy, self.version, self.dtype, self.copy_version = WeakIdRef(copy), x._version, copy.dtype, copy._version
        self.taken = {id(module)}


#: id of a live float32 activation -> its first copy
_FIRST: dict[int, _First] = {}


def _forget(key: int, _ref: Any) -> None:
    _FIRST.pop(key, None)


def autocast_copy_dtype(x: Any) -> torch.dtype | None:
    """The dtype autocast would cast ``x``, a linear's input, to (None where it would not, or nothing
    is saved, or the forward is compiled, or ``x`` is an inference or nested tensor)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return None
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.is_nested or x.is_inference():
        return None  # (inference tensors keep no version counter; nested ones have no view_as)
    if x.is_leaf and x.requires_grad and torch.is_autocast_cache_enabled():
        return None  # autocast caches its cast of a leaf that requires grad: one copy, as without a lever
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    if dtype == torch.float32 or not autocast_casts_linear(device, dtype):
        return None
    return dtype


def _sharing() -> bool:
    """Whether a view through :class:`_Shared` may be handed on here: not inside ``torch.func``'s
    transforms (``vmap``, ``grad``: an autograd function needs rules of its own there), nor on a torch
    that cannot tell."""
    active = torch_private.functorch_transforms_active
    return active is not None and not active()


def _cast(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Forward pre-hook of a linear: cast its float32 input as autocast would, or hand it the first
    linear's copy of the same unchanged input, through a node of its own."""
    x = args[0] if args else None
    dtype = autocast_copy_dtype(x)
    if dtype is None:
        return None
    assert isinstance(x, torch.Tensor)
    if substitutes.leaves_alone(module, _cast, "shared_casts"):  # a forward set on it (a policy's float32 one,
        return None  # accelerate's) or others' hooks see its input and its gradient in float32, as without the lever
    first = _FIRST.get(id(x))
    if (first is not None and first.x() is x and first.version == x._version and first.dtype == dtype
            and id(module) not in first.taken):
        earlier = first.copy()
        if earlier is not None and earlier._version == first.copy_version and _sharing():
            first.taken.add(id(module))
            return (_Shared.apply(x, earlier.detach()), *args[1:])
    copy = x.to(dtype)
    _FIRST[id(x)] = _First(x, copy, module)
    return (copy, *args[1:])


class SharedCasts(substitutes.Hooked):
    """What :func:`share_casts` turned on (:attr:`modules`: the linears whose inputs are cast by the hook,
    each copy after the first handed on as a view of the first); :meth:`remove` turns it off."""

    @property
    def active(self) -> bool:
        """Whether the lever does anything (any linear with a sibling; it needs nothing of this torch)."""
        return bool(self.modules)

    def __repr__(self) -> str:
        return f"SharedCasts({len(self.modules)} linears)"


def share_casts(model: nn.Module) -> SharedCasts:
    """Keep one low-precision copy of each float32 activation autocast casts for several of ``model``'s
    sibling linears (see the module docstring)."""
    linears: dict[int, nn.Module] = {}
    for parent in model.modules():
        children = [c for c in parent.children() if type(c) is nn.Linear]
        if len(children) >= 2:
            linears.update((id(c), c) for c in children)
    handles = [linear.register_forward_pre_hook(_cast) for linear in linears.values()]
    return SharedCasts(list(linears.values()), handles)
