"""Selective recomputation of a transformer's blocks: the matmuls', attention's and norms' outputs kept
for backward, the cheap ops between them run again in backward instead of keeping what they save.

    handle = amp_backends.memory.selective_recompute(model)   # blocks found: GPT2Block, BertLayer, ...
    ...                                                       # train as before
    handle.remove()

What AMP alone still keeps on the transformers users train, beside the norms :mod:`.saves` handles:
dropout's masks and its masked outputs, the decomposed GELU's intermediates (transformers'
``NewGELUActivation``: ``pow``, ``mul``, ``add``, ``tanh``, each saved), and, where attention is not
fused (the eager path), the attention probabilities, before and after dropout. Each block's forward
runs under torch's selective activation checkpoint (``torch.utils.checkpoint.checkpoint`` with
``context_fn=partial(create_selective_checkpoint_contexts, policy)``, torch >= 2.5, non-reentrant):
the outputs of the ops in ``save`` (:data:`SAVE`: matmuls, convolutions, fused attention, norms) are
kept; every other op of the block is run again in backward from those and the block's input.

Exact: the recomputation runs the same ops on the same inputs, and torch's checkpoint restores the
CPU's and the inputs' device's random state before it (``preserve_rng_state``), so dropout draws the
same mask; the loss and every gradient are bitwise the plain model's (``tests/memory/test_lean_recompute.py``).
What it costs is the forward of the recomputed ops once more in backward, and the checkpoint's own
work per block (docs/memory.md states both as measured).

The block's ``forward`` is wrapped, not its ``__call__``: the block's own hooks stay outside the
checkpoint and run once (hooks on modules inside it run again in backward, with the recomputation).
The block's buffers are put back after the recomputation as it found them, so that an op writing one
in place (BatchNorm's ``num_batches_tracked``, a counter of the user's) moves it once per forward. Like
transformers' own gradient checkpointing, a block in training called with a key-value cache while
recomputing gets ``use_cache=False`` and no cache (the recomputation would write it twice), said once
with a warning; a block in eval mode (decoding with grad enabled) runs its plain forward and fills the
cache.
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .. import patches
from ..errors import AmpBackendsError
from ..torch_private import OpOverload, OpOverloadPacket
from .ledger import counting, kept_for_backward

__all__ = ["SAVE", "Recompute", "RecomputeError", "find_blocks", "selective_recompute", "unavailable_reason"]

_ATEN = torch.ops.aten

#: The ops whose outputs are kept for backward (aten names; those this torch lacks are skipped):
#: matmuls, convolution, fused attention, and norms. Every other op of a block is recomputed.
SAVE_NAMES: tuple[str, ...] = (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "_convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward",
    "native_layer_norm", "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "_fused_rms_norm",
)
SAVE: frozenset[Any] = frozenset(getattr(_ATEN, n) for n in SAVE_NAMES if hasattr(_ATEN, n))

#: keyword arguments through which transformers' blocks take a key-value cache
_CACHE_KWARGS = ("past_key_value", "past_key_values", "layer_past", "cache")


class RecomputeError(AmpBackendsError, ValueError):
    """Selective recomputation cannot be set up as asked (nothing was changed)."""


def unavailable_reason() -> str | None:
    """None where this torch has the selective checkpoint API, else why not and what to install."""
    import torch.utils.checkpoint as ckpt

    if not all(hasattr(ckpt, n) for n in ("create_selective_checkpoint_contexts", "CheckpointPolicy")):
        return (f"selective recomputation needs torch's selective activation checkpoint "
                f"(torch.utils.checkpoint.create_selective_checkpoint_contexts and CheckpointPolicy, torch >= 2.5), "
                f"which torch {torch.__version__} lacks: pip install 'torch>=2.5', or leave recompute off")
    return None


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """A model's transformer blocks: the children of every ``nn.ModuleList`` holding two or more modules
    of one class (GPT-2's ``transformer.h``, BERT's ``encoder.layer``, ``nn.TransformerEncoder.layers``),
    outermost lists only (a block's own lists are part of the block)."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        for block in module:
            found.append(block)
            inside.update(id(m) for m in block.modules())
    return found


def _packets(save: Iterable[Any]) -> frozenset[Any]:
    """The ops of ``save`` as both overload packets and overloads (a policy sees overloads)."""
    out: set[Any] = set()
    for op in save:
        if isinstance(op, OpOverloadPacket):
            out.add(op)
        elif isinstance(op, OpOverload):
            out.add(op)
        else:
            raise RecomputeError(f"save= takes torch ops (e.g. torch.ops.aten.mm), got {op!r}")
    return frozenset(out)


def _op_named(name: str) -> Any:
    """``torch.ops.<name>`` ("aten.mm" a packet, "aten.mm.default" an overload)."""
    found: Any = torch.ops
    for part in name.split("."):
        found = getattr(found, part)
    return found


class _Policy:
    """The checkpoint's policy: the outputs of the ops in ``save`` kept, every other op recomputed.
    Picklable (``torch.save(model)``): the ops travel by name."""

    def __init__(self, save: frozenset[Any]) -> None:
        from torch.utils.checkpoint import CheckpointPolicy

        self.save = save
        self._keep, self._again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE

    def __getstate__(self) -> dict[str, Any]:
        return {"save": sorted(str(op) for op in self.save)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(frozenset(_op_named(name) for name in state["save"]))  # type: ignore[misc]

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op in self.save or getattr(op, "overloadpacket", None) in self.save:
            if counting() and not ctx.is_recompute:  # kept: the ledger counts its outputs as activations
                kept_for_backward(op)
            return self._keep
        return self._again


class _KeepingState:
    """The recomputation's context (torch's, around it): the block's buffers put back as they were
    before it, so that an op writing one in place (BatchNorm's ``num_batches_tracked``, which torch's
    selective checkpoint cannot keep: the version counter moves after its cache is taken) moves it
    once per forward, not once more in backward."""

    def __init__(self, block: nn.Module, inner: Any) -> None:
        self.block, self.inner = block, inner
        self.before: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> Any:
        # the buffers of the modules in training (a module in eval mode, a frozen BatchNorm, writes none)
        self.before = [(b, b.detach().clone()) for m in self.block.modules() if m.training
                       for b in m.buffers(recurse=False)]
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.inner.__exit__(*exc)
        finally:
            with torch.no_grad():
                for buffer, value in self.before:  # through .data: no version counter moves mid-backward
                    buffer.data.copy_(value)
            self.before = []


def _contexts(policy: _Policy, block: nn.Module) -> tuple[Any, Any]:
    """torch's selective-checkpoint contexts for one call of ``block``, the recomputation's keeping its state."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    forward, recompute = create_selective_checkpoint_contexts(policy)
    return forward, _KeepingState(block, recompute)


def _without_cache(signature: inspect.Signature, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The call with no key-value cache and ``use_cache=False``, however they were passed; None where it
    asks for none."""
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return None  # let the forward itself say what is wrong with the call
    changed = False
    for name in (*_CACHE_KWARGS, "use_cache"):
        if bound.arguments.get(name):
            bound.arguments[name] = False if name == "use_cache" else None
            changed = True
    return (bound.args, bound.kwargs) if changed else None


class _Recomputed:
    """A block's forward run under the selective checkpoint (installed as the block's ``forward``). An
    object holding its block, not a closure over the block's bound method: a copy of the model
    (``copy.deepcopy``, an EMA of it) gets a wrapper of its own that runs the copy's forward on the
    copy's parameters."""

    def __init__(self, block: nn.Module, previous: Any, policy: _Policy) -> None:
        #: the block; ``previous``: its instance's own ``forward`` before (None: its class's)
        self.block, self.previous, self.policy = block, previous, policy
        self._signature: inspect.Signature | None = None
        self._cache_named: bool | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_signature": None, "_cache_named": None}  # asked again of the copy's forward

    def _forward(self) -> Callable[..., Any]:
        return self.previous if self.previous is not None else types.MethodType(type(self.block).forward, self.block)

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        """The forward it runs: ``inspect.signature(block.forward)`` reads that forward's own signature."""
        return self._forward()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        forward = self._forward()
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if self._cache_named is None:
            try:
                self._signature = inspect.signature(forward)
            except (TypeError, ValueError):
                self._signature = None
            self._cache_named = self._signature is not None and any(
                n in self._signature.parameters for n in (*_CACHE_KWARGS, "use_cache"))
        if self._cache_named:
            uncached = _without_cache(self._signature, args, kwargs)  # type: ignore[arg-type]
            if uncached is not None:
                if not self.block.training:  # decoding with grad enabled: the cache is filled, nothing recomputed
                    return forward(*args, **kwargs)
                _say_cache_dropped(self.block)
                args, kwargs = uncached
        context = functools.partial(_contexts, self.policy, self.block)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)


_CACHE_WARNED: list[bool] = []


def _say_cache_dropped(block: nn.Module) -> None:
    """Once: a block in training was handed a key-value cache, which it does not fill under the lever."""
    if not _CACHE_WARNED:
        _CACHE_WARNED.append(True)
        warnings.warn(f"selective_recompute: {type(block).__name__} in training was called with a key-value cache "
                      "(use_cache=True); recomputed blocks get use_cache=False and no cache, as under transformers' "
                      "gradient checkpointing, so the cache the model returns stays empty: pass use_cache=False in "
                      "training, or call model.eval() to decode", RuntimeWarning, stacklevel=3)


class Recompute:
    """Selective recomputation on some blocks (:func:`selective_recompute`); :meth:`remove` undoes it."""

    def __init__(self, blocks: Sequence[nn.Module], save: frozenset[Any]) -> None:
        #: the blocks whose forward is recomputed selectively
        self.blocks: tuple[nn.Module, ...] = tuple(blocks)
        #: the ops whose outputs are kept
        self.save = save
        policy = _Policy(save)
        self._wrappers: list[_Recomputed] = []
        for block in self.blocks:
            wrapper = _Recomputed(block, block.__dict__.get("forward"), policy)
            patches.wrap(block, "forward", wrapper, scope="until Recompute.remove()",
                         cause="the block's forward runs under selective checkpointing, its cheap ops recomputed "
                               "in backward")
            self._wrappers.append(wrapper)
            _ON[block] = weakref.ref(self)

    def remove(self) -> None:
        """Each block's forward as it was (idempotent)."""
        for block, wrapper in zip(self.blocks, self._wrappers):
            mark = _ON.get(block)
            if mark is None or mark() is not self:
                continue
            patches.unwrap(block, "forward", wrapper)
            del _ON[block]

    def __repr__(self) -> str:
        kinds = sorted({type(b).__name__ for b in self.blocks})
        return f"Recompute({len(self.blocks)} blocks: {', '.join(kinds)})"


#: block -> a weak reference to the Recompute wrapping it (twice on one block is refused). Weak both ways:
#: a Recompute holds its blocks, and a value holding its own key would keep the block, its model and
#: whatever hooks on the model hold (an optimizer, its state) alive for the rest of the process
_ON: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Recompute]] = weakref.WeakKeyDictionary()


def selective_recompute(model: nn.Module, *, save: Iterable[Any] = SAVE,
                        blocks: Sequence[nn.Module] | None = None) -> Recompute:
    """Run each block of ``model`` under torch's selective activation checkpoint: the outputs of the ops
    in ``save`` (default :data:`SAVE`: matmuls, attention, norms) kept for backward, every other op of
    the block (dropout, activations, softmax, casts, elementwise) recomputed in backward. ``blocks``:
    the modules to wrap, default :func:`find_blocks`'s. Loss and gradients are bitwise unchanged.
    Returns a handle whose ``remove()`` undoes it."""
    why = unavailable_reason()
    if why is not None:
        raise RecomputeError(why)
    ops = _packets(save)
    if not ops:
        raise RecomputeError("save= is empty: every op would be recomputed, the matmuls too; pass the ops "
                             "to keep (default amp_backends.memory.recompute.SAVE)")
    if blocks is None:
        chosen = find_blocks(model)
        if not chosen:
            raise RecomputeError(
                f"no transformer blocks found in {type(model).__name__} (no nn.ModuleList of two or more "
                f"modules of one class): pass blocks=[...] (e.g. blocks=list(model.transformer.h))")
    else:
        chosen = list(blocks)
        if not chosen:
            raise RecomputeError("blocks= is empty: pass the modules to recompute, or leave it out to find them")
    inside = {id(m) for m in model.modules()}
    for block in chosen:
        if not isinstance(block, nn.Module):
            raise RecomputeError(f"blocks= takes modules of the model, got {type(block).__name__}")
        if id(block) not in inside:
            raise RecomputeError(f"{type(block).__name__} given in blocks= is not a module of this model")
        if block in _ON:
            raise RecomputeError(f"{type(block).__name__} is already recomputed selectively: call .remove() "
                                 f"on the handle first")
        if isinstance(block.__dict__.get("forward"), _Recomputed):
            raise RecomputeError(f"{type(block).__name__} is already recomputed selectively (copied so from a "
                                 f"recomputed model): it runs so on its own parameters; "
                                 f"amp_backends.patches.unwrap(block, 'forward', block.forward) undoes it")
        if getattr(block, "gradient_checkpointing", False):
            raise RecomputeError(
                f"{type(block).__name__} is checkpointed whole already (transformers' gradient checkpointing): "
                f"turn that off (model.gradient_checkpointing_disable(), activation_checkpointing_disable() in newer "
                f"transformers) or leave this lever off")
    if len({id(b) for b in chosen}) != len(chosen):
        raise RecomputeError("blocks= names a module twice")
    nested = {id(m) for b in chosen for m in b.modules() if m is not b}
    if any(id(b) in nested for b in chosen):
        raise RecomputeError("blocks= names a module and one inside it: give the outer blocks only")
    return Recompute(chosen, ops)
