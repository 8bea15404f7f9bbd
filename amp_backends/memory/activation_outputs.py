"""An activation's output, recomputed from its input for the ops that save it.

In a transformer's MLP the activation's output is the next linear's input, and that linear saves it for
its weight's gradient, while the activation itself saves its input: two tensors of the MLP's widest
shape per layer, where one determines the other. GPT-2 small and BERT-base at the bench's batches
(8,192 tokens, inner width 3,072, bfloat16) keep 48 MiB a layer of such outputs, 576 MiB over twelve layers;
Llama's MLP saves ``act(gate)`` for its product with ``up`` the same way.

:func:`recompute_activation_outputs` tags the output of each activation module it knows the pure
function of (:func:`pure_function`: ``nn.GELU``, ``nn.SiLU``, ``nn.Mish`` and Transformers' modules
running ``F.gelu``, ``F.silu`` or ``F.mish``, GPT-2's written-out GELU once :mod:`.activations` runs it
fused), and, while the activation's grandparent module runs (the block holding its consumer: GPT-2's
``GPT2Block``, BERT's ``BertLayer``), a ``saved_tensors_hooks`` pair stores, in place of a tagged output
(or a view of it) some op saves, the activation's input, which autograd keeps anyway, and recomputes the
output from it when the backward asks. The recomputation is the same kernel on the same input with
autocast off (the output's dtype is the input's, checked at the forward), so the gradients are bitwise
those without the lever; it costs one elementwise op per layer in backward.

Composes with the hooks already in force (torch's checkpoint, ``save_on_cpu``, the memory ledger): what
it does not replace goes to them as before, and for a tagged output they are handed the input instead.
It asks torch which hooks are in force (``torch._C._autograd._top_saved_tensors_default_hooks``, from
torch 2.4 has none); on a torch without that the outputs are saved as before (nothing is recomputed). It does
nothing under ``torch.compile`` (the compiler decides what to save) nor where saved-tensor hooks are
disabled. An input edited in place after the forward is refused at the backward, as autograd refuses it.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import torch_private
from ..errors import AmpBackendsError
from .activations import _approximate, _FusedGelu

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


class RecomputedInputEdited(AmpBackendsError, RuntimeError):
    """An activation's input was edited in place between the forward and the backward that recomputes its output."""


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
        return _TORCH[kind](module)
    if kind.__module__ != "transformers.activations" or kind.__qualname__ not in _TRANSFORMERS:
        return None
    if kind.forward.__qualname__ != f"{kind.__qualname__}.forward":  # a kernel put in its place
        return None
    if kind.__qualname__ == "SiLUActivation":
        return F.silu
    act = getattr(module, "act", None)
    return act if _plain_function(act) else None


class _Made:
    """A tagged output's input, function and version at the forward."""

    __slots__ = ("fn", "output", "version", "x")

    def __init__(self, output: torch.Tensor, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.output = weakref.ref(output, functools.partial(_forget, id(output)))
        self.x, self.fn, self.version = x, fn, output._version


#: id of a live tagged output -> what made it
_MADE: dict[int, _Made] = {}


def _forget(key: int, _ref: Any) -> None:
    _MADE.pop(key, None)


def _tag(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    """Forward hook of an activation: tag its output as recomputable from its input."""
    if (torch.compiler.is_compiling() or not torch.is_grad_enabled() or len(args) != 1 or not isinstance(output, torch.Tensor)
            or not isinstance(args[0], torch.Tensor) or not output.requires_grad or output is args[0]
            or output._base is not None or output.dtype != args[0].dtype):
        return
    fn = pure_function(module)
    if fn is not None:
        _MADE[id(output)] = _Made(output, args[0], fn)


class _Recompute:
    """What is stored in place of a tagged output (or a view of it): the input, packed by the hooks in
    force before, and where the view lies in the output."""

    __slots__ = ("fn", "packed", "scope", "size", "storage_offset", "stride", "version", "x")

    def __init__(self, scope: _Scope, packed: Any, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor],
                 view: torch.Tensor) -> None:
        self.scope, self.packed, self.fn = scope, packed, fn
        self.x, self.version = weakref.ref(x), x._version
        self.size, self.stride, self.storage_offset = view.size(), view.stride(), view.storage_offset()


class _Scope:
    """The pack and unpack hooks of one scope, over the hooks in force when it began (or none)."""

    def __init__(self, outer: tuple[Callable[..., Any], Callable[..., Any]] | None) -> None:
        self.outer_pack: Callable[[torch.Tensor], Any] | None = outer[0] if outer is not None else None
        self.outer_unpack: Callable[[Any], torch.Tensor] | None = outer[1] if outer is not None else None
        self.context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        base = t if t._base is None else t._base
        made = _MADE.get(id(base))
        if made is None or made.output() is not base or base._version != made.version or t.dtype != base.dtype:
            return t if self.outer_pack is None else self.outer_pack(t)
        x = made.x
        return _Recompute(self, x if self.outer_pack is None else self.outer_pack(x), x, made.fn, t)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Recompute) or packed.scope is not self:
            return packed if self.outer_unpack is None else self.outer_unpack(packed)
        x: torch.Tensor = packed.packed if self.outer_unpack is None else self.outer_unpack(packed.packed)
        if x is packed.x() and x._version != packed.version:
            raise RecomputedInputEdited(
                f"an activation's input ({tuple(x.shape)}, {x.dtype}) was edited in place after the forward "
                f"(version {packed.version} -> {x._version}); its output, recomputed from it for the backward, "
                "would be wrong: edit a copy (x = x.clone()) or turn the lever off "
                "(memory_lean(..., activations=False))")
        with torch.autocast(x.device.type, enabled=False):
            y = packed.fn(x)  # under create_graph grad mode is on: differentiable, as the output was
        if y.size() == packed.size and y.stride() == packed.stride and packed.storage_offset == 0:
            return y
        return y.as_strided(packed.size, packed.stride, packed.storage_offset)


_LOCAL = threading.local()


def _scopes() -> list[tuple[int, _Scope | None]]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def _enter(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of a scope: push the hooks (where they can work here)."""
    if torch.compiler.is_compiling():
        return  # the compiler decides what to save; _leave does nothing either
    top, enabled = torch_private.top_saved_tensors_hooks, torch_private.saved_tensors_hooks_are_enabled
    if top is None or enabled is None or not enabled() or not torch.is_grad_enabled():
        _scopes().append((id(module), None))
        return
    scope = _Scope(top(False))
    scope.context.__enter__()
    _scopes().append((id(module), scope))


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook of a scope (also run when the forward raised): pop its hooks."""
    if torch.compiler.is_compiling():
        return
    stack = _scopes()
    if not stack or stack[-1][0] != id(module):
        return  # its pre-hook never ran (an earlier pre-hook raised)
    scope = stack.pop()[1]
    if scope is not None:
        scope.context.__exit__(None, None, None)


class ActivationOutputs:
    """What :func:`recompute_activation_outputs` turned on; :meth:`remove` turns it off."""

    def __init__(self, activations: list[nn.Module], scopes: list[nn.Module], handles: list[Any]) -> None:
        #: the activation modules whose outputs are recomputed; the modules inside which that is done
        self.modules, self.scopes = activations, scopes
        self._handles = handles

    @property
    def active(self) -> bool:
        """Whether outputs are recomputed on this torch (False where it cannot tell which hooks are in force)."""
        return bool(self.modules) and torch_private.top_saved_tensors_hooks is not None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self.modules, self.scopes = [], [], []

    def __repr__(self) -> str:
        return f"ActivationOutputs({len(self.modules)} activations in {len(self.scopes)} scopes)"


def recompute_activation_outputs(model: nn.Module) -> ActivationOutputs:
    """Recompute the outputs of ``model``'s activation modules (:func:`pure_function`) from their inputs
    for the ops that save them, instead of keeping both (see the module docstring)."""
    names = dict(model.named_modules(remove_duplicate=False))
    activations: dict[int, nn.Module] = {}
    scope_names: set[str] = set()
    for name, module in names.items():
        if pure_function(module) is None and not _may_become_pure(module):
            continue
        activations[id(module)] = module
        parts = name.split(".") if name else []
        scope_names.add(".".join(parts[:-2]))  # the grandparent: the block holding the activation's consumer
    # the outermost scopes only: one inside another would add nothing
    top = sorted(scope_names, key=lambda n: n.count(".") if n else -1)
    kept: list[str] = []
    for name in top:
        if not any(name == k or name.startswith(k + ".") or k == "" for k in kept):
            kept.append(name)
    handles: list[Any] = []
    for module in activations.values():
        handles.append(module.register_forward_hook(_tag))
    scopes = list({id(names[n]): names[n] for n in kept}.values())
    for scope in scopes:
        handles.append(scope.register_forward_pre_hook(_enter))
        handles.append(scope.register_forward_hook(_leave, always_call=True))
    return ActivationOutputs(list(activations.values()), scopes, handles)


def _may_become_pure(module: nn.Module) -> bool:
    """A written-out GELU :mod:`.activations` can run fused (it may be fused after this lever is on)."""
    return _approximate(module) is not None and "forward" not in vars(module)
