"""A model's LM head whose logits are never made whole: :class:`LazyLogits`, :func:`lazy_head`.

A head wrapped by :func:`lazy_head` returns, instead of logits, a tensor that knows how to make them
from the head's input, weight and bias as they were in the forward. Reshapes that keep the vocabulary
as the last dimension, ``flatten`` of the leading dimensions and ``.float()`` stay lazy;
``F.cross_entropy`` of it (class-index targets, ``'mean'`` or ``'sum'``, any ``weight``,
``ignore_index`` or ``label_smoothing``) runs the fused :func:`.fused_loss.linear_cross_entropy`;
anything else computes the logits whole, once per use (correct, without the saving; a warning says so).
It never computes from stale or edited state:

- an in-place op or ``out=`` on lazy logits (``logits[..., banned] = -inf``, ``masked_fill_``,
  ``div_``) raises (the edit would not reach the loss): edit out of place, which computes them whole;
- a use after the head's weight or bias, or its input, changed (an ``optimizer.step()``, a
  ``load_state_dict``, an in-place edit; seen by their version counters and storages, and by a count of
  the optimizer steps that updated the weight, since fused optimizers move no version counter) raises:
  read the logits before ``optimizer.step()`` (a write through ``.data`` is not seen, as autograd does
  not see it);
- logits made with grad mode off carry no gradient, as plain ones would;
- their own gradient is never made (the loss is computed from the head's input): a gradient hook or
  ``retain_grad`` on them, ``torch.autograd.grad`` with respect to them, an autograd Function they pass
  through (refused at the backward, when its gradient reaches them) or that returns them (a reentrant
  checkpoint of the head: refused at their use) raises; a full backward hook on the head itself gets
  plain logits (the lever stands aside there, with a warning);
- under ``inference_mode``, forward-mode AD and inside ``torch.func``'s transforms the head returns plain
  logits;
- inside ``torch.compile`` the head returns plain logits (correct, no saving), so a compiled step works;
- under ``torch.distributed`` with more than one process, with FSDP2's DTensor weights, for a head that
  an fp8 recipe or a precision policy's float32 runs, or that ``quant_stats`` watches, the lever is
  refused (:func:`head_lever_refusal`): the lazy logits have no autograd graph to the head, so DDP's
  reducer, FSDP's resharding and quant_stats's gradient hooks would not see the head's gradients.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import patches, torch_private
from ..eager import eager
from ..errors import AmpBackendsError
from ..precision.fp32_forward import Fp32Forward
from ..torch_private import DisableTorchFunctionSubclass, make_wrapper_subclass, tree_leaves, tree_map
from .fused_loss import chunk_rows, linear_cross_entropy
from .hooks_around import backward_hooked, stand_aside

__all__ = ["LazyHeadError", "LazyLogits", "chunk_rows", "head_lever_refusal", "lazy_head", "linear_cross_entropy",
           "undo_lazy_head"]

_OFF = "or turn the head lever off (memory_lean(..., lm_head=None))"


class LazyHeadError(AmpBackendsError, RuntimeError):
    """Lazy logits asked to do what would train or read silently wrong (nothing was changed)."""


_INPLACE_DUNDERS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift", "matmul"))
_WARNED: set[str] = set()
#: tensor properties that give a tensor (the logits computed whole, then the property): not metadata
_TENSOR_PROPERTIES = frozenset({"T", "mT", "H", "mH", "data", "real", "imag"})
#: what would hook the logits' own gradient, which lazy logits never have (the loss is made from the head's input)
_GRADIENT_HOOKS = frozenset({"register_hook", "retain_grad", "register_post_accumulate_grad_hook"})
_NO_GRADIENT = ("the loss is computed from the head's input, so the logits' own gradient is never made: a hook or "
                "retain_grad on them, autograd.grad with respect to them, or an autograd Function they pass through "
                "(a module's full backward hook, a custom Function, a reentrant checkpoint of the head) would see "
                "nothing and the head would lose its gradient")


#: id of a head's weight or bias -> how many optimizer steps have updated it (a fused optimizer's kernel
#: moves no version counter), counted by an optimizer step post hook while any lazy logits are alive
_STEPS: dict[int, int] = {}
#: id -> a weak reference to each lazy logits alive (the hook goes with the last of them)
_LIVE: dict[int, weakref.ref] = {}
_STEP_HOOK: list[Any] = []


def _track(logits: LazyLogits) -> None:
    """Count the optimizer steps that update ``logits``' head while they are alive."""
    _LIVE[id(logits)] = weakref.ref(logits, functools.partial(_untrack, id(logits)))
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_post_hook(_stepped))


def _untrack(key: int, _ref: Any) -> None:
    _LIVE.pop(key, None)
    if not _LIVE and _STEP_HOOK:  # no lazy logits left to read: nothing to count, no hook on any step
        _STEP_HOOK.pop().remove()
        _STEPS.clear()


@eager
def _stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After any optimizer's step while lazy logits are alive: the heads' tensors it holds were (or may
    have been) updated."""
    watched = {id(t) for ref in list(_LIVE.values()) if (lazy := ref()) is not None for t in lazy._head if t is not None}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in watched and p.grad is not None:  # (an optimizer steps no parameter without a gradient)
                _STEPS[id(p)] = _STEPS.get(id(p), 0) + 1


def _stamp(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[Any, ...]:
    """What identifies the state the logits are made of: version counters, storages and the optimizer
    steps that updated the weights (``hidden``: the head's input itself, not a reshaped copy of it,
    whose counter starts again)."""
    return (hidden._version, weight._version, weight.untyped_storage()._cdata, _STEPS.get(id(weight), 0),
            None if bias is None else bias._version, None if bias is None else bias.untyped_storage()._cdata,
            None if bias is None else _STEPS.get(id(bias), 0))


class LazyLogits(torch.Tensor):
    """The logits ``F.linear(hidden, weight, bias)`` of a head, not computed yet (see the module
    docstring). Its shape, dtype and device are the logits'."""

    _hidden: torch.Tensor
    _head: tuple[torch.Tensor, torch.Tensor | None]
    _autocast: tuple[bool, torch.dtype]
    _upcast: bool
    _grad_mode: bool
    _stamp: tuple[Any, ...]
    _source: torch.Tensor

    @staticmethod
    def __new__(cls, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                autocast: tuple[bool, torch.dtype], upcast: bool = False, grad: bool | None = None,
                stamp: tuple[Any, ...] | None = None, source: torch.Tensor | None = None) -> LazyLogits:
        enabled, low = autocast
        dtype = torch.float32 if upcast else (low if enabled else hidden.dtype)
        grad = torch.is_grad_enabled() if grad is None else grad
        needs = grad and (hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        self = make_wrapper_subclass(
            cls, (*hidden.shape[:-1], weight.shape[0]), dtype=dtype, device=hidden.device, requires_grad=needs)
        self._hidden, self._head, self._autocast, self._upcast = hidden, (weight, bias), autocast, upcast
        self._grad_mode = grad
        self._source = hidden if source is None else source  # the head's input (hidden may be a reshaped copy)
        self._stamp = _stamp(self._source, weight, bias) if stamp is None else stamp
        _track(self)
        if needs:  # a gradient can reach these logits only through what bypasses __torch_function__: refused there
            with DisableTorchFunctionSubclass():
                torch.Tensor.register_hook(self, _gradient_reached)
        return self

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        raise LazyHeadError(f"lazy logits reached {func} below autograd (a dispatch mode, or a tracer other than "
                            f"torch.compile?): compute the logits before that point, {_OFF}")

    # -- state ---------------------------------------------------------------------------------
    def _check_fresh(self, use: str) -> None:
        with DisableTorchFunctionSubclass():
            through = self.grad_fn is not None
        if through:  # an autograd Function's output (its grad_fn set on them): the gradient would stop there
            raise LazyHeadError(f"lazy logits used by {use} after an autograd Function returned them: {_NO_GRADIENT}. "
                                f"Compute them whole first (logits = logits.materialize()), {_OFF}")
        weight, bias = self._head
        now = _stamp(self._source, weight, bias)
        if now == self._stamp:
            if weight.untyped_storage().nbytes() == 0:
                raise LazyHeadError(f"lazy logits used by {use} after the head's weight was freed (FSDP resharded "
                                    f"it?): compute the loss inside the forward, {_OFF}")
            return
        what = "input (the hidden states) was edited in place" if now[0] != self._stamp[0] else (
            "weight or bias changed (an optimizer.step(), fused ones included, load_state_dict or an in-place edit)")
        raise LazyHeadError(f"lazy logits used by {use} after the head's {what} since the forward that made them: "
                            "they would be computed from the new state, not the one the forward saw. Read the logits "
                            f"(the loss, an accuracy) before optimizer.step(), {_OFF}")

    def _mode(self) -> Any:
        return torch.set_grad_enabled(self._grad_mode and torch.is_grad_enabled())

    def materialize(self) -> torch.Tensor:
        """The logits, computed whole (differentiable where they were made with grad mode on)."""
        self._check_fresh("materialize")
        return self._compute()

    def _compute(self) -> torch.Tensor:
        weight, bias = self._head
        enabled, low = self._autocast
        with self._mode(), torch.autocast(self._hidden.device.type, dtype=low, enabled=enabled):
            out = F.linear(self._hidden, weight, bias)
        return out.float() if self._upcast else out

    def _like(self, hidden: torch.Tensor | None = None, upcast: bool | None = None) -> LazyLogits:
        self._check_fresh("a reshape")  # (a reshaped input may be a copy: the state is checked before it is made)
        return LazyLogits(self._hidden if hidden is None else hidden, *self._head, self._autocast,
                          self._upcast if upcast is None else upcast, self._grad_mode, self._stamp, self._source)

    # -- torch functions -----------------------------------------------------------------------------
    @classmethod
    @eager  # traced by torch.compile it would return the logits where a loss is asked: run eagerly (a graph break)
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        prop = getattr(getattr(func, "__self__", None), "__name__", None) if name == "__get__" else None
        if func in (torch.Tensor.size, torch.Tensor.dim, torch.Tensor.__len__, torch.Tensor.numel) or (
                name == "__get__" and prop not in _TENSOR_PROPERTIES):
            with DisableTorchFunctionSubclass():  # shape, dtype, device, requires_grad: the wrapper's own
                return func(*args, **kwargs)
        self = args[0] if args else None
        if name in _GRADIENT_HOOKS or (name == "grad" and any(isinstance(t, LazyLogits) for t in tree_leaves(
                (args[1:], kwargs.get("inputs"))))):
            raise LazyHeadError(f"{name} on lazy logits: {_NO_GRADIENT}. Compute them whole first "
                                f"(logits = logits.materialize()), {_OFF}")
        if name == "requires_grad_" and isinstance(self, LazyLogits):
            wanted = bool(kwargs.get("requires_grad", args[1] if len(args) > 1 else True))
            if wanted == self.requires_grad:
                return self
            raise LazyHeadError(f"requires_grad_({wanted}) on lazy logits that {'do' if self.requires_grad else 'do not'}"
                                f" require grad: whether they do is the head's (made with grad mode on or off), {_OFF}")
        if isinstance(self, LazyLogits) and (name == "__setitem__" or name in _INPLACE_DUNDERS
                                             or (name.endswith("_") and not name.startswith("_"))):
            raise LazyHeadError(
                f"lazy logits cannot be edited in place ({name}): the edit would not reach the loss. Edit them out of "
                "place (logits = logits.masked_fill(mask, float('-inf')), logits = logits / temperature), which "
                f"computes them whole, {_OFF}")
        if "out" in kwargs and any(isinstance(t, LazyLogits) for t in tree_leaves(kwargs["out"])):
            raise LazyHeadError(f"lazy logits cannot be written by {name}(out=...): pass a plain tensor as out=, {_OFF}")
        if isinstance(self, LazyLogits):
            lazy = self._lazy(func, args[1:], kwargs)
            if lazy is not None:
                return lazy
            if func is F.cross_entropy and self.dim() == 2:
                out = self._cross_entropy(*args[1:], **kwargs)
                if out is not None:
                    return out
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, LazyLogits):
                t._check_fresh(name)
        if name not in _WARNED:
            _WARNED.add(name)
            warnings.warn(f"lean memory: the logits of a lazy LM head were used by {name}, so they were computed whole "
                          "(no saving there): reshape, .float() and F.cross_entropy keep them lazy", RuntimeWarning,
                          stacklevel=3)
        plain_args, plain_kwargs = tree_map(lambda a: a._compute() if isinstance(a, LazyLogits) else a, (args, kwargs))
        return func(*plain_args, **plain_kwargs)

    def _shape(self, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
        """The shape a reshape/view asks for, -1 resolved; None unless it keeps the vocabulary last."""
        shape: Any = kwargs.get("shape", kwargs.get("size", rest[0] if len(rest) == 1 else rest))
        if isinstance(shape, int):
            shape = (shape,)
        if not isinstance(shape, (tuple, list, torch.Size)) or not all(isinstance(s, int) for s in shape):
            return None  # view(dtype) and the like
        shape = list(shape)
        numel = math.prod(self.shape)
        if shape.count(-1) > 1:
            return None
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            if known == 0 or numel % known:
                return None
            shape[shape.index(-1)] = numel // known
        if math.prod(shape) != numel or not shape or shape[-1] != self.shape[-1]:
            return None
        return tuple(shape)

    def _lazy(self, func: Any, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> LazyLogits | None:
        if func in (torch.Tensor.reshape, torch.Tensor.view, torch.reshape):
            shape = self._shape(rest, kwargs)
            if shape is None:
                return None
            return self._like(hidden=self._hidden.reshape(*shape[:-1], self._hidden.shape[-1]))
        if func in (torch.Tensor.flatten, torch.flatten):
            dim = self.dim()
            start = kwargs.get("start_dim", rest[0] if rest else 0)
            end = kwargs.get("end_dim", rest[1] if len(rest) > 1 else -1)
            start, end = start % dim, end % dim
            if end == dim - 1:  # the vocabulary is flattened in: (B*T*V,) as torch gives, computed whole
                return self if start == dim - 1 else None
            return self._like(hidden=self._hidden.flatten(start, end))
        upcast = func is torch.Tensor.float or (func is torch.Tensor.to and len(rest) <= 1 and not (set(kwargs) - {"dtype"})
                                               and kwargs.get("dtype", rest[0] if rest else None) is torch.float32)
        if upcast and self.dtype != torch.float64:  # (.float() of float64 logits rounds them: computed whole)
            return self._like(upcast=True)
        if func is torch.Tensor.contiguous:
            return self
        return None

    def _cross_entropy(self, target: torch.Tensor, weight: Any = None, size_average: Any = None, ignore_index: int = -100,
                       reduce: Any = None, reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor | None:
        if size_average is not None or reduce is not None or reduction not in ("mean", "sum") or \
                not isinstance(target, torch.Tensor) or target.dim() != 1 or target.dtype not in (torch.int64, torch.uint8):
            return None  # per-row losses, class probabilities, the legacy arguments, targets torch refuses: computed whole
        if isinstance(weight, torch.Tensor) and weight.requires_grad and torch.is_grad_enabled():
            return None  # a class weight to differentiate: computed whole, where torch says what it does with it
        self._check_fresh("F.cross_entropy")
        weight_, bias = self._head
        enabled, low = self._autocast
        with self._mode(), torch.autocast(self._hidden.device.type, dtype=low, enabled=enabled):
            return linear_cross_entropy(self._hidden, weight_, target, bias, ignore_index=ignore_index,
                                        reduction=reduction, label_smoothing=label_smoothing, class_weight=weight,
                                        upcast=self._upcast)


# -- the head ---------------------------------------------------------------------------------------
def _watched_by_quant_stats(module: nn.Module) -> bool:
    return any(getattr(hook, "__qualname__", "").startswith("QuantStats.") for hook in module._forward_hooks.values())


def _module_refusal(module: nn.Module) -> str | None:
    """Why ``module`` cannot be a lazy head, from the module alone, or None."""
    from ..precision.fp8.engine import is_fp8

    if is_fp8(module) or isinstance(getattr(module, "fp8_recipe", None), str):
        return ("the LM head is an fp8 layer: lazy logits would run it in the autocast dtype, not its fp8 recipe; "
                "keep the head out of the fp8 conversion, " + _OFF)
    held = module.__dict__.get("forward")
    if isinstance(held, Fp32Forward) and held.holders:
        return ("a precision policy runs the LM head in float32: lazy logits would bypass it; drop the head from the "
                "policy's float32 layers, " + _OFF)
    if _watched_by_quant_stats(module):
        return ("quant_stats watches the LM head: lazy logits have no gradient hook, so its gradient operands would "
                "never be measured; leave the head out of quant_stats(layers=...), " + _OFF)
    if hasattr(module.weight, "device_mesh"):
        return ("the LM head's weight is a DTensor (FSDP2): its unsharded weight is freed after the forward, before "
                "the lazy logits are read; " + _OFF.replace("or turn", "turn"))
    return None


def _distributed_refusal(model: nn.Module | None = None) -> str | None:
    """Why the lever cannot work under the distributed setup in place, or None."""
    parallel = None
    if model is not None:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            parallel = "the model is wrapped in DistributedDataParallel"
        elif any(hasattr(p, "device_mesh") for p in model.parameters()):
            parallel = "the model's parameters are DTensors (FSDP2)"
    if parallel is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            parallel = f"torch.distributed runs {world} processes"
    if parallel is None:
        return None
    return (f"memory_lean(lm_head=...): {parallel}, and lazy logits have no autograd graph back to the head in the "
            "forward, so DDP and FSDP would not see the head's weight gradient (never reduced across ranks, or its "
            "storage freed). Turn the head lever off (memory_lean(..., lm_head=None)); to keep the saving, compute the "
            "loss inside the wrapped model's forward with amp_backends.memory.linear_cross_entropy(hidden, "
            "head.weight, labels), whose graph DDP and FSDP see")


def head_lever_refusal(model: nn.Module | None, head: nn.Module) -> str | None:
    """Why ``head`` of ``model`` cannot take the lazy-head lever here, or None where it can: an fp8 head,
    one a precision policy runs in float32, one quant_stats watches, and distributed training (DDP, FSDP2,
    any process group of more than one process). For :func:`memory_lean` to call before it changes
    anything (raising its own error with this message); :func:`lazy_head` and every forward of a lazy
    head check the same."""
    if not isinstance(head, nn.Linear):
        return f"memory_lean(lm_head=...): the head must be an nn.Linear, got {type(head).__name__}"
    return _module_refusal(head) or _distributed_refusal(model)


def _gradient_reached(grad: torch.Tensor) -> torch.Tensor:
    """Hook of lazy logits that require grad: a gradient reached them, through an autograd Function they
    were handed to (their own gradient, which nothing would take on to the head)."""
    raise LazyHeadError(f"a gradient reached lazy logits through an autograd Function they were passed to: "
                        f"{_NO_GRADIENT}. Compute them whole before it (logits = logits.materialize()), {_OFF}")


class _LazyHead:
    """The forward of a head whose logits are made lazily (picklable; ``previous``: the instance
    forward it replaced, or None)."""

    def __init__(self, module: nn.Linear, previous: Any) -> None:
        self.module, self.previous = module, previous

    def _plain(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.previous(hidden) if self.previous is not None else type(self.module).forward(self.module, hidden)

    def __call__(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear.forward's own name
        hidden = input
        if torch.compiler.is_compiling():
            return self._plain(hidden)  # a compiled graph cannot carry lazy logits: plain ones, no saving
        active = torch_private.functorch_transforms_active
        if (torch.is_inference_mode_enabled() or hidden.is_inference() or active is None or active()
                or torch_private.forward_ad_active()):
            return self._plain(hidden)  # inference tensors keep no version, torch.func's wrappers no storage,
            # and forward-mode AD needs the logits' tangent, which lazy logits never make
        module = self.module
        if backward_hooked(module):
            # a backward hook on the head is handed the logits' gradient, which lazy logits never make
            stand_aside(module, self, "lm_head", "a backward hook (its gradient is the logits', never made lazily)")
            return self._plain(hidden)
        reason = _module_refusal(module) or _distributed_refusal()
        if reason is not None:
            raise LazyHeadError(reason)
        device_type = hidden.device.type
        enabled = torch.is_autocast_enabled(device_type)
        low = torch.get_autocast_dtype(device_type) if enabled else hidden.dtype
        return LazyLogits(hidden, self.module.weight, self.module.bias, (enabled, low))


def lazy_head(module: nn.Linear) -> _LazyHead:
    """Make ``module`` (an ``nn.Linear`` head) return :class:`LazyLogits`; :func:`undo_lazy_head` reverses
    it. Refused (:class:`LazyHeadError`, nothing changed) where :func:`head_lever_refusal` says so."""
    if not isinstance(module, nn.Linear):
        raise TypeError(f"a lazy LM head is an nn.Linear, got {type(module).__name__}")
    reason = _module_refusal(module)
    if reason is not None:
        raise LazyHeadError(reason)
    held = module.__dict__.get("forward")
    if isinstance(held, _LazyHead):
        return held
    wrapper = _LazyHead(module, held)
    patches.wrap(module, "forward", wrapper, scope="until undo_lazy_head() (Lean.remove())",
                 cause="the LM head returns lazy logits, its loss computed a block of rows at a time")
    return wrapper


def undo_lazy_head(module: nn.Linear) -> None:
    """Give ``module`` back the forward it had before :func:`lazy_head`."""
    wrapper = module.__dict__.get("forward")
    if isinstance(wrapper, _LazyHead):
        patches.unwrap(module, "forward", wrapper)
