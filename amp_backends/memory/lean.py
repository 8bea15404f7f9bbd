"""Memory-lean mixed precision, turned on in one place:

    lean = amp_backends.memory_lean(model, optimizer, weights=torch.bfloat16, lm_head="head")
    optimizer = lean.optimizer           # the training loop is otherwise unchanged

Each lever is on its own switch and usable alone:

- ``recompute``: the model's transformer blocks recompute their cheap elementwise ops (dropout,
  activations, softmax) in backward instead of saving their outputs (:mod:`.recompute`);
- ``activations`` (default on): GELUs written out in Python (transformers' ``gelu_new``, GPT-2's) run
  as ``F.gelu``, saving one tensor for backward instead of four (:mod:`.activations`; the same
  function, rounded once instead of at every op of the chain);
- ``activation_outputs`` (default on): the activations' outputs (GELU, SiLU, Mish modules) are
  recomputed from their inputs for the ops that save them (the MLP's second linear), instead of kept
  beside those inputs (:mod:`.activation_outputs`; bitwise the same gradients, one elementwise op a
  layer more in backward);
- ``activation_inputs`` (default off): the activations' inputs (the MLP's up-projection outputs) are
  recomputed in backward from the up-projection's input, which it keeps anyway (:mod:`.activation_inputs`;
  bitwise the same gradients, one matmul a layer more; with ``activation_outputs`` the MLP keeps nothing of
  its inner width);
- ``dropout_masks`` (default off): the masks ``nn.Dropout`` modules keep for backward are stored as
  bits, eight to a byte (:mod:`.dropout_masks`; the same masks, bitwise the same gradients, a few small
  ops a dropout to pack and unpack);
- ``shared_casts`` (default on): where autocast casts one float32 activation for several sibling
  linears (BERT's query, key and value on a GPU), one low-precision copy is kept for backward instead of
  one per linear, the later linears handed views of the first copy (:mod:`.shared_casts`; the same
  matmuls, fewer casts, bitwise the same gradients);
- ``saves`` (default on): norms and softmax that autocast runs in float32 keep a low-precision input
  for backward (exact; :mod:`.saves`);
- ``lm_head``: the LM head's logits are never made whole; cross-entropy over them runs a block of rows
  at a time, each block's gradients made in the forward (:mod:`.chunked_loss`, :mod:`.fused_loss`);
- ``weights``: the parameters the optimizer trains in bfloat16/float16, with float32 masters it
  updates (:mod:`.master`); or, with ``master=False``, no masters, for an optimizer that rounds its
  bfloat16 updates stochastically (:class:`.sr_adamw.StochasticAdamW`, or torchao's with
  ``bf16_stochastic_round=True``), whose moments follow the parameters' dtype. What stays float32:
  normalisation layers, layers a precision policy keeps in float32, fp8 layers, parameters the
  optimizer does not hold (another optimizer's, frozen ones), and parameters of layers whose forward
  cannot take low-precision weights from float32 inputs under autocast (anything but the layers in
  :data:`LOW_PRECISION_LAYERS`: ``nn.Bilinear``, custom layers; :attr:`Lean.kept` says which and why).

The model stays the user's to write: ``model.load_state_dict``, in-place edits under ``no_grad``,
another optimizer, DDP's broadcast and ``model.to(...)`` all reach the masters (:mod:`.master`).
:meth:`Lean.state_dict` gives the model's weights in float32 (a plain float32 model loads it), and
:meth:`Lean.remove` turns everything off, the model's parameters float32 again with the trained values.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch import nn

from .. import patches
from ..errors import AmpBackendsError
from ..precision.fp8.engine import is_fp8
from ..precision.policy import fp32_modules
from ..precision.selectors import NORM_TYPES
from ..registry.registry import resolve_backend
from .activation_inputs import ActivationInputs, recompute_activation_inputs
from .activation_outputs import ActivationOutputs, pure_function, recompute_activation_outputs
from .activations import FusedActivations, fused_activations
from .chunked_loss import head_lever_refusal, lazy_head, undo_lazy_head
from .compile_once import compile_once_patch, uses_compile_per_call
from .dropout_masks import DropoutMasks, pack_dropout_masks
from .master import LOW_PRECISION, MasterWeights, own_lists_refusal, widen_state
from .recompute import Recompute, RecomputeError, selective_recompute
from .saves import LowPrecisionSaves, low_precision_saves
from .shared_casts import SharedCasts, share_casts
from .notices import Notices, notices, quiet_state_dict

__all__ = ["Lean", "LeanError", "memory_lean"]


class LeanError(AmpBackendsError, ValueError):
    """A lean-memory setting that cannot work here (nothing was changed)."""


#: Layers whose forward runs through autocast's low-precision ops (or a lookup), so low-precision weights
#: work with float32 inputs; transformers' GPT-2 ``Conv1D`` (an ``addmm``) is recognised by name.
LOW_PRECISION_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.Embedding, nn.MultiheadAttention)
_LOW_PRECISION_NAMES = {"transformers.pytorch_utils.Conv1D"}

#: the models memory_lean is on for (twice on one model is refused); a mark only: a value that held the
#: Lean would hold the model, and the weak key would never go
_ON: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


class Lean:
    """What :func:`memory_lean` turned on; :meth:`remove` turns it off."""

    #: the optimizer's step building each compile wrapper once, where memory_lean made it so
    _compile_once: patches.Patch | None = None

    def __init__(self, model: nn.Module, optimizer: Any, lowered: list[nn.Parameter], kept: dict[str, str],
                 saves: LowPrecisionSaves | None, head: nn.Linear | None, weights: torch.dtype | None,
                 recompute: Recompute | None = None, activations: FusedActivations | None = None,
                 outputs: ActivationOutputs | None = None, casts: SharedCasts | None = None,
                 inputs: ActivationInputs | None = None, masks: DropoutMasks | None = None,
                 notes: Notices | None = None) -> None:
        self.model, self.optimizer, self.weights = model, optimizer, weights
        #: parameter name -> why it stayed float32 (of those the optimizer trains)
        self.kept = kept
        self._lowered, self._saves, self._head, self._recompute = lowered, saves, head, recompute
        self._activations, self._outputs, self._casts, self._inputs = activations, outputs, casts, inputs
        self._masks, self._notes = masks, notes

    @property
    def masters(self) -> dict[nn.Parameter, torch.Tensor]:
        """Each low-precision parameter's float32 master, up to date with writes made since the last
        step (empty without masters)."""
        if not isinstance(self.optimizer, MasterWeights):
            return {}
        self.optimizer.sync()
        return self.optimizer.masters

    _masters = masters

    @property
    def stood_aside(self) -> dict[str, str]:
        """Layer name -> the lever that stood aside there for another's hook, and the hook (at least once since
        it was turned on; :func:`.substitutes.others_hooked`): the memory that lever saves is kept there."""
        found = {id(m): f"{lever}: {hook}" for lever, handle in (("activation_outputs", self._outputs),
                                                                 ("shared_casts", self._casts),
                                                                 ("activation_inputs", self._inputs))
                 if handle is not None for m, hook in handle.stood_aside}
        return {name: found[id(m)] for name, m in self.model.named_modules() if id(m) in found}

    def state_dict(self) -> dict[str, Any]:
        """The model's ``state_dict`` with each low-precision weight's float32 master (same keys; a copy,
        tied weights one tensor), or its value upcast where it has none: what a plain float32 model of the
        same architecture loads, and what resumes a lean run exactly (the model's own gives the rounding)."""
        masters = {id(p): m for p, m in self.masters.items()}
        lowered = {id(p) for p in self._lowered}
        with quiet_state_dict(self._notes):
            state = self.model.state_dict()
        copies: dict[int, torch.Tensor] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if name not in state:
                continue
            if id(p) in masters:
                if id(p) not in copies:
                    copies[id(p)] = masters[id(p)].detach().clone()
                state[name] = copies[id(p)]
            elif id(p) in lowered and p.dtype in LOW_PRECISION:
                state[name] = p.detach().float()
        return state

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Load float32 (or any) weights: the masters take them exactly, the model's parameters rounded
        (``model.load_state_dict`` does the same)."""
        result = self.model.load_state_dict(state_dict, strict=strict)
        if isinstance(self.optimizer, MasterWeights):
            self.optimizer.sync()
        return result

    def remove(self) -> Any:
        """Turn it all off: float32 parameters again holding the trained (master) values, the head and
        norms as they were. Returns the optimizer to train on afterwards (the one given); the wrapper,
        where kept, goes on stepping it as it is, its state untouched."""
        if self._saves is not None:
            self._saves.remove()
        if self._activations is not None:
            self._activations.remove()
            self._activations = None
        if self._outputs is not None:
            self._outputs.remove()
            self._outputs = None
        if self._casts is not None:
            self._casts.remove()
            self._casts = None
        if self._inputs is not None:
            self._inputs.remove()
            self._inputs = None
        if self._masks is not None:
            self._masks.remove()
            self._masks = None
        if self._notes is not None:
            self._notes.remove()
            self._notes = None
        if self._head is not None:
            undo_lazy_head(self._head)
        if self._recompute is not None:
            self._recompute.remove()
            self._recompute = None
        if self._compile_once is not None:
            self._compile_once.remove()
            self._compile_once = None
        optimizer = self.optimizer
        if isinstance(optimizer, MasterWeights):
            optimizer.sync()
            optimizer.unwatch()
            with torch.no_grad():
                for p, m in optimizer.masters.items():
                    p.data = m.clone()  # (a view would hold the whole buffer of the masters: a save writes it all)
            optimizer.masters.clear()
            optimizer._stamps.clear()
            optimizer._planned()
            optimizer = optimizer.optimizer
        else:
            with torch.no_grad():
                for p in self._lowered:
                    if p.dtype in LOW_PRECISION:
                        p.data = p.data.float()
                        if optimizer is not None:
                            widen_state(optimizer, p)  # (its moments: float32 as the parameter's own would be)
        _ON.pop(self.model, None)
        self._lowered, self._saves, self._head = [], None, None
        self.optimizer = optimizer
        return optimizer

    def __repr__(self) -> str:
        known = sum(pure_function(m) is not None for m in self._outputs.modules) if self._outputs is not None else 0
        parts = [f"weights {str(self.weights).replace('torch.', '')} with float32 masters" if self.masters else "",
                 f"weights {str(self.weights).replace('torch.', '')} without masters"
                 if self._lowered and not self.masters else "",
                 "lm head fused" if self._head is not None else "",
                 f"{len(self._recompute.blocks)} blocks recompute cheap ops" if self._recompute is not None else "",
                 f"low-precision saves on {len(self._saves.modules)} modules" if self._saves else "",
                 f"{len(self._activations.modules)} GELUs fused" if self._activations and self._activations.modules else "",
                 f"{known} activations' outputs recomputed" if known and self._outputs is not None and self._outputs.active
                 else "",  # (a written-out GELU is known once fused: not where activations=False)
                 f"autocast's copies shared by {len(self._casts.modules)} linears"
                 if self._casts is not None and self._casts.active else "",
                 f"{len(self._inputs.activations)} activations' inputs recomputed"
                 if self._inputs is not None and self._inputs.active else "",
                 f"{len(self._masks.modules)} dropouts' masks as bits" if self._masks is not None and self._masks.active else "",
                 f"{len(self.stood_aside)} layers stood aside for others' hooks" if self.stood_aside else ""]
        return f"<Lean {'; '.join(p for p in parts if p) or 'off'}>"


def _kept_float32(model: nn.Module) -> dict[int, str]:
    """Parameters that stay float32, and why: normalisation layers', those of modules a precision policy
    runs in float32, fp8 layers' (their weights are quantized from float32), and those of layers not in
    :data:`LOW_PRECISION_LAYERS` (their forward may not take low-precision weights)."""
    keep: dict[int, str] = {}
    policy = set(fp32_modules(model))
    for name, m in model.named_modules():
        cls = type(m)
        if isinstance(m, NORM_TYPES):
            why = "a normalisation layer"
        elif name in policy:
            why = "a precision policy runs it in float32"
        elif is_fp8(m):
            why = "an fp8 layer (quantized from float32)"
        elif isinstance(m, LOW_PRECISION_LAYERS) or f"{cls.__module__}.{cls.__qualname__}" in _LOW_PRECISION_NAMES:
            continue
        else:
            why = f"{cls.__name__}'s forward may not take low-precision weights"
        for p in m.parameters(recurse=False):
            keep.setdefault(id(p), why)
    return keep


def _wrapped_by_ddp(model: nn.Module) -> bool:
    """Whether a DistributedDataParallel already wraps ``model`` (its reducer holds the parameters as
    they are: replacing their storage stops it reducing them)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    ddp = torch.nn.parallel.DistributedDataParallel
    wrappers = [o for o in gc.get_objects() if isinstance(o, ddp)]  # a DDP holds no mark on what it wraps
    return any(any(m is model for m in w.module.modules()) for w in wrappers)


def _carried_levers(model: nn.Module) -> str | None:
    """Where ``model`` holds a lever this package's memory levers install (a forward set on a module, a
    forward hook), said; None where it holds none."""
    def ours(fn: Any) -> bool:
        owner = fn if isinstance(fn, type) or hasattr(fn, "__code__") else type(fn)  # (a function, or a callable object)
        return str(getattr(owner, "__module__", "")).startswith(__package__ + ".")

    for name, module in model.named_modules():
        forward = vars(module).get("forward")
        if forward is not None and ours(forward):
            return f"{name or 'the model'}'s forward is {type(forward).__name__}"
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for hook in hooks.values():
                if ours(getattr(hook, "__func__", hook)):
                    return f"{name or 'the model'} has the forward hook {getattr(hook, '__qualname__', type(hook).__name__)}"
    return None


def _check(model: Any, optimizer: Any, weights: Any, master: bool, lm_head: Any, backend: Any) -> tuple[Any, Any]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"memory_lean takes a torch.nn.Module, got {type(model).__name__}")
    if model in _ON:
        raise LeanError("memory_lean: already on for this model; call remove() on the handle it returned first")
    carried = _carried_levers(model)
    if carried is not None:
        raise LeanError(f"memory_lean: this model has memory levers on already ({carried}): turned on by hand "
                        "(selective_recompute, low_precision_saves...: take them off with their handle's remove()), or "
                        "brought along by a copy of a lean model (deepcopy, torch.load), which a handle of its own could "
                        "not take off: copy the model before memory_lean or after lean.remove(), or use the copy as it is")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) or _wrapped_by_ddp(model):
        raise LeanError("memory_lean on a model DistributedDataParallel already wraps: DDP's reducer holds the "
                        "float32 parameters and would stop reducing the low-precision ones; call memory_lean on "
                        "the plain model first, then wrap it in DDP (DDP's broadcast reaches the masters)")
    be = resolve_backend(backend)
    if weights is not None:
        weights = be.resolve_dtype(weights)
        if optimizer is None:
            raise LeanError("memory_lean(weights=...): pass the optimizer too (built over model.parameters()): its "
                            "updates go to the float32 masters")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"memory_lean(optimizer=...) takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, MasterWeights):
        raise LeanError("memory_lean: this optimizer already updates float32 masters (memory_lean ran on it)")
    params = {id(p) for p in model.parameters()}
    if optimizer is not None:
        foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in params]
        if foreign:
            raise LeanError(f"memory_lean: the optimizer holds {len(foreign)} parameter(s) that are not the model's; "
                            "build it over model.parameters()")
    if weights is not None and any(hasattr(p, "device_mesh") for p in model.parameters()):
        raise LeanError("memory_lean(weights=...) with FSDP2 (DTensor parameters): fully_shard casts the parameters "
                        "itself; use its MixedPrecisionPolicy(param_dtype=...) instead of lean weights")
    if weights is not None and master and optimizer is not None and (reason := own_lists_refusal(optimizer)):
        raise LeanError(f"memory_lean(weights=...): {reason}")
    if weights is not None and not master:
        stochastic = getattr(optimizer, "bf16_stochastic_round", optimizer.defaults.get("bf16_stochastic_round"))
        if not stochastic or weights != torch.bfloat16:
            raise LeanError(
                "memory_lean(master=False): bfloat16 weights without float32 masters lose the small updates (a "
                "round-to-nearest AdamW stalls), so the optimizer must round stochastically: pass "
                "amp_backends.memory.StochasticAdamW(model.parameters()) (or torchao's AdamW with "
                "bf16_stochastic_round=True), or master=True")
    head = None
    if lm_head is not None:
        head = lm_head if isinstance(lm_head, nn.Module) else _submodule(model, lm_head)
        if not isinstance(head, nn.Linear):
            raise LeanError(f"memory_lean(lm_head=...): the head must be an nn.Linear, got {type(head).__name__}")
        if not any(m is head for m in model.modules()):
            raise LeanError("memory_lean(lm_head=...): that module is not in this model; pass its name, e.g. 'lm_head'")
        reason = head_lever_refusal(model, head)
        if reason is not None:
            raise LeanError(reason)
    return weights, head


def _submodule(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][-6:]
        raise LeanError(f"memory_lean(lm_head={name!r}): no such module; Linear layers here end with "
                        f"{', '.join(names) or '(none)'}") from None


def memory_lean(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, backend: Any = None,
                weights: torch.dtype | str | None = None, master: bool = True, lm_head: str | nn.Module | None = None,
                saves: bool = True, recompute: bool | list[nn.Module] = False, activations: bool = True,
                activation_outputs: bool = True, shared_casts: bool = True, activation_inputs: bool = False,
                dropout_masks: bool = False) -> Lean:
    """Turn on the memory levers of mixed precision for ``model`` (see the module docstring); returns
    the handle whose ``optimizer`` the training loop uses. Everything is checked before anything changes.
    ``recompute``: True (the model's repeated blocks, found) or the blocks: their cheap elementwise ops
    (dropout, activations, softmax) recomputed in backward (:mod:`.recompute`). ``activations``: GELUs
    written out in Python run as ``F.gelu`` (:mod:`.activations`). ``activation_outputs``: activations'
    outputs recomputed from their inputs where a later op saves them (:mod:`.activation_outputs`).
    ``shared_casts``: one low-precision copy saved of a float32 activation autocast casts for several
    sibling linears (:mod:`.shared_casts`). ``activation_inputs``: activations' inputs recomputed from the
    up-projection's input in backward, a matmul a layer (:mod:`.activation_inputs`). ``dropout_masks``: the
    masks dropouts save kept as bits (:mod:`.dropout_masks`)."""
    weights, head = _check(model, optimizer, weights, master, lm_head, backend)
    again = None
    if recompute is not False:
        try:  # first of the changes: it refuses what it cannot wrap, before anything else changed
            again = selective_recompute(model, blocks=None if recompute is True else recompute)
        except RecomputeError as exc:
            raise LeanError(f"memory_lean(recompute=...): {exc}") from None
    lowered: list[nn.Parameter] = []
    kept: dict[str, str] = {}
    masters: dict[nn.Parameter, torch.Tensor] = {}
    compiled = None
    if weights is not None:
        assert optimizer is not None
        trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
        why = _kept_float32(model)
        names = {id(p): n for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in dict.fromkeys(model.parameters()):
                if id(p) not in trained or not p.is_floating_point():
                    continue
                if id(p) in why and p.dtype not in LOW_PRECISION:
                    kept[names[id(p)]] = why[id(p)]
                    continue
                if p.dtype not in LOW_PRECISION and p.dtype != torch.float32:  # float64: its layer computes in it
                    kept[names[id(p)]] = (f"{str(p.dtype).replace('torch.', '')}: autocast leaves its layer's "
                                          "arithmetic in it, and its master would be no wider")
                    continue
                if p.dtype != weights and p.dtype not in LOW_PRECISION:
                    held = p.data
                    p.data = held.to(weights)
                    if master:
                        masters[p] = held
                lowered.append(p)
        if master:
            optimizer = MasterWeights(optimizer, masters)
            optimizer.watch_loads(model)
        elif uses_compile_per_call(optimizer):  # torchao's per-parameter compiled update: its wrapper built once
            compiled = compile_once_patch(optimizer)
    low = low_precision_saves(model) if saves else None
    fused = fused_activations(model) if activations else None
    outputs = recompute_activation_outputs(model) if activation_outputs else None
    casts = share_casts(model) if shared_casts else None
    inputs = recompute_activation_inputs(model) if activation_inputs else None
    masks = pack_dropout_masks(model) if dropout_masks else None
    if head is not None:
        lazy_head(head)
    notes = notices(model, lowered[0], masters=master) if lowered else None
    lean = Lean(model, optimizer, lowered, kept, low, head, weights, again, fused, outputs, casts, inputs, masks,
                notes)
    lean._compile_once = compiled
    _ON[model] = True
    return lean
