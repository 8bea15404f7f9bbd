"""Low-precision weights with float32 master copies that the optimizer updates: the classic recipe.

The model's parameters hold bfloat16 or float16 values (the forward and backward run on them, and
autocast makes no copies of them); for each such parameter a float32 master keeps the weight the
optimizer updates. :class:`MasterWeights` wraps the user's own optimizer and steps it *as it is*,
once a step: for the length of its ``step()`` the optimizer's groups list the masters, each with the
float32 copy of its parameter's gradient, and its state is keyed by them; between steps its groups and
state are keyed by the model's parameters, so ``opt.state[p]``, hooks, schedulers and ``state_dict``
are those of the same optimizer over a float32 model, and a checkpoint moves between a lean run and a
plain one. The parameters' storage is never swapped (that would drop autograd's gradient accumulators
and the hooks DDP put on them).

The step's device work is a constant number of multi-tensor launches per device, whatever the number
of parameters: one copy of the low-precision gradients into one float32 buffer, the division by the
loss scale, the wrapped optimizer's own (foreach or fused) update, one rounding copy of the masters
into the parameters. Under a loss scale, an optimizer with torch's fused protocol (``fused=True``)
is handed ``grad_scale``/``found_inf`` and skips on the device; any other reads found_inf once, as
torch's scaler does.

**The masters stay the truth only while nobody else writes the parameters**, so every write that
autograd can see is taken in before the next step (:meth:`MasterWeights.sync`): a parameter whose
version counter moved (``load_state_dict``, an in-place op under ``no_grad``, another optimizer,
DDP's broadcast of rank 0's weights) gets its master from its new value (from the exact float32 value
loaded, where ``load_state_dict`` gave one), element by element: an element the write left as it was
keeps its master's float32 value, as a float32 weight keeps its bits under an op that leaves it be
(:func:`_take_write`; in a process group of several ranks every element takes the new
value, so that DDP's broadcast leaves each rank the same master); a parameter moved to another device
takes its master along; a parameter cast to the other low precision keeps its master; a parameter
made float32 again (``model.float()``) gets its master's value and needs none; a low-precision
parameter without a master (a model already in bfloat16, ``model.to(torch.bfloat16)`` later, a
parameter group added later) gets one. Writes through ``p.data`` are invisible to the version
counter (as they are to autograd) and are overwritten by the next step: write through the parameter.
A low-precision value loaded is a write like any other (:mod:`.master_checkpoints`).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..errors import AmpBackendsError
from ..torch_private import FakeTensor, foreach_mul
from .master_checkpoints import exact_values, hook_loads
from .master_buffers import LOW_PRECISION, Flats, consolidate, float32_grads, grad_key, grads_of, round_into
from .master_buffers import inverse as inverse_of
from .master_unscale import ExactUnscale

__all__ = ["LOW_PRECISION", "MasterWeights", "MasterWeightsError", "own_lists_refusal", "own_parameter_lists", "widen_state"]


#: (version counter, storage address, device, dtype) of a parameter as last written by the step.
_Stamp = tuple[int, int, torch.device, torch.dtype]


def _address(p: torch.Tensor) -> int:
    """Where ``p``'s storage is (0 for fake and meta tensors, which have none to compare)."""
    return 0 if p.is_meta or isinstance(p, FakeTensor) else p.data_ptr()


def _stamp(p: torch.Tensor) -> _Stamp:
    return p._version, _address(p), p.device, p.dtype


class MasterWeightsError(AmpBackendsError, ValueError):
    """An optimizer whose updates cannot be moved onto float32 masters."""


#: the attributes every torch optimizer has that hold its parameters: what the masters are swapped into
_OWN = frozenset({"param_groups", "state", "defaults"})
#: torch's optimizer hooks, shared between the wrapper and the optimizer it wraps
_HOOK_TABLES = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                "_optimizer_load_state_dict_post_hooks")


def own_parameter_lists(optimizer: torch.optim.Optimizer) -> list[str]:
    """The attributes of ``optimizer`` other than its groups and state that hold its parameters (a list
    it keeps of its own, as LBFGS's ``_params``) or another optimizer (SAM's ``base_optimizer``,
    Lookahead's): its step would update the parameters found there, or keep state keyed by what the
    masters replace, not the float32 masters swapped into its groups and state."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    found = []
    for name, value in vars(optimizer).items():
        if name in _OWN:
            continue
        if isinstance(value, torch.optim.Optimizer):
            found.append(name)
            continue
        items: list[Any] = list(value) if isinstance(value, (list, tuple, set)) else (
            [*value.keys(), *value.values()] if isinstance(value, dict) else [])
        items += [x for item in items if isinstance(item, (list, tuple)) for x in item]  # per group
        if any(isinstance(x, torch.Tensor) and id(x) in params for x in items):
            found.append(name)
    return found


def own_lists_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the float32 masters cannot serve ``optimizer`` (:func:`own_parameter_lists` found some), or None."""
    kept = own_parameter_lists(optimizer)
    if not kept:
        return None
    return (f"{type(optimizer).__name__} keeps its own list of its parameters, or another optimizer over them "
            f"({', '.join(kept)}): its step would update the low-precision parameters there, or keep state the "
            "float32 masters swapped into its param_groups and state never reach. Use an optimizer whose step reads "
            "its param_groups (torch's do, LBFGS aside), or keep the weights float32 (weights=None)")


def _ranks_share_writes() -> bool:
    """Whether this process is one rank of several, where a write to a parameter may be rank 0's value
    broadcast (DDP's, at its start) and every rank must then hold the same master."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def widen_state(optimizer: torch.optim.Optimizer, p: nn.Parameter) -> None:
    """``optimizer``'s low-precision state for ``p`` in float32: made before ``p`` had a master (an
    optimizer that stepped, or was built, on low-precision parameters: Adagrad's sums), as the masters'
    own would be; or kept while ``p`` was low precision, once it is float32 again."""
    state = optimizer.state.get(p)
    if state:
        for key, value in state.items():
            if type(value) is torch.Tensor and value.dtype in LOW_PRECISION:
                state[key] = value.float()


def _take_write(p: nn.Parameter, master: torch.Tensor, low: torch.dtype, loaded: torch.Tensor | None) -> None:
    """``p`` was written outside the step: its master takes the new value. An element the write left
    as it was (the rounding of what it held: the master's, to ``low``, the dtype the step last wrote,
    or of the value ``load_state_dict`` gave, ``loaded``) keeps that value in float32, as a float32
    weight keeps its bits under an op that changes some elements or none (a clamp,
    ``nn.Embedding(max_norm=...)``'s renorm, a cast to another low precision: ``model.half()``); an
    element it changed takes the parameter's value. Among several ranks a write other than a load or
    a cast gives every element the parameter's value (DDP's broadcast of rank 0's weights writes rank
    0's with its own: each rank must then hold the same master)."""
    if loaded is not None:
        kept, rounded = loaded.to(p.device), loaded.to(p.device, p.dtype)
    elif low == p.dtype and _ranks_share_writes():
        master.copy_(p)
        return
    else:
        kept, rounded = master, master.to(low)
        if low != p.dtype:
            rounded = rounded.to(p.dtype)
    master.copy_(torch.where(p == rounded, kept, p.to(kept.dtype)))


class _ThroughToWrapped:
    """The wrapped optimizer's public attributes, read and set through the wrapper (which keeps it as
    ``optimizer`` and provides :meth:`MasterWeights.on_masters`)."""

    optimizer: torch.optim.Optimizer

    def on_masters(self) -> Any:
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        """A public attribute of the wrapped optimizer the wrapper has not (a schedule-free optimizer's
        ``train()`` and ``eval()``, its settings), read through; its methods run on the float32 masters
        (the groups list them and the state is keyed by them, as in the step), whose rounding the
        parameters then hold."""
        inner = self.__dict__.get("optimizer")
        if inner is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = getattr(inner, name)
        if not inspect.ismethod(value):
            return value

        @functools.wraps(value)
        def on_masters(*args: Any, **kwargs: Any) -> Any:
            with torch.no_grad(), self.on_masters():
                return value(*args, **kwargs)

        return on_masters

    def __setattr__(self, name: str, value: Any) -> None:
        """A public attribute the wrapped optimizer has and the wrapper has not is set on the optimizer
        (whose step reads it); anything else on the wrapper."""
        inner = self.__dict__.get("optimizer")
        if (inner is not None and not name.startswith("_") and name not in self.__dict__
                and not hasattr(type(self), name) and name in vars(inner)):
            setattr(inner, name, value)
        else:
            object.__setattr__(self, name, value)


class MasterWeights(_ThroughToWrapped, ExactUnscale, torch.optim.Optimizer):
    """``optimizer``'s updates applied to float32 masters of its low-precision parameters
    (``masters``: parameter -> its float32 master; a low-precision parameter without one gets one from
    its value; float32 parameters are stepped as they are). See the module docstring."""

    #: the step takes ``grad_scale`` and ``found_inf`` (torch's fused protocol) and honours both
    _step_supports_amp_scaling = True
    amp_found_inf = "honours"
    #: its low-precision gradients are the scaler's to check; the update is on float32 masters
    amp_master_weights = True

    def __init__(self, optimizer: torch.optim.Optimizer,
                 masters: Mapping[nn.Parameter, torch.Tensor] | None = None) -> None:
        # not torch's __init__: the groups, the state and the hooks stay the wrapped optimizer's own
        reason = own_lists_refusal(optimizer)
        if reason is not None:
            raise MasterWeightsError(reason)
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        for table in _HOOK_TABLES:  # hooks registered on either are the same hooks
            if not hasattr(optimizer, table):
                setattr(optimizer, table, OrderedDict())
            setattr(self, table, getattr(optimizer, table))
        #: parameter -> its float32 master
        self.masters: dict[nn.Parameter, torch.Tensor] = dict(masters or {})
        self._stamps: dict[nn.Parameter, _Stamp] = {p: _stamp(p) for p in self.masters}
        #: whether the groups list the masters now (inside :meth:`on_masters`: a step, a hook of it)
        self._swapped = False
        for p in self.masters:
            widen_state(self.optimizer, p)
        #: float32 values a load_state_dict gave a parameter (taken exactly at the next sync)
        self._loaded: dict[nn.Parameter, torch.Tensor] = {}
        self._hooks: list[Any] = []
        #: parameter -> (its exact float32 gradient after unscale_, (id, version) of its gradient then)
        self._exact: dict[nn.Parameter, tuple[torch.Tensor, tuple[Any, int]]] = {}
        self._warned_new = self._warned_changed = False
        # what the last sync saw (the groups' parameters, their versions and storage) and the plan it made
        self._ids: list[int] | None = None
        self._seen: list[tuple[int, int]] = []
        self._lists: list[list[torch.Tensor]] = []
        self._with_master: list[nn.Parameter] = []
        self._on_device: bool | None = None
        self._fake = False
        #: (device, parameter dtype) -> (float32 buffer, its parameters, their masters: views of it)
        self._flats: Flats = {}
        self.sync()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def __repr__(self) -> str:
        return f"MasterWeights({self.optimizer!r}, {len(self.masters)} float32 masters)"

    def _params(self) -> list[nn.Parameter]:
        return list(dict.fromkeys(p for group in self.optimizer.param_groups for p in group["params"]))

    def _look(self) -> tuple[list[int], list[tuple[int, int]]]:
        """The groups' parameters (ids) and each one's (version, storage address), as they are now."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self._fake:
            return [id(p) for p in params], [(p._version, 0) for p in params]
        return [id(p) for p in params], [(p._version, p.data_ptr()) for p in params]

    def _planned(self) -> None:
        """What the step swaps, made again after a change: each group's list with the masters in, and
        the parameters that have one; what the groups hold now, as seen."""
        self._fake = any(isinstance(p, FakeTensor) or p.is_meta for group in self.optimizer.param_groups
                         for p in group["params"][:1])
        with torch.no_grad():
            self._flats = consolidate(self.masters, self._flats, self._fake)
        masters = self.masters
        self._lists = [[masters.get(p, p) for p in group["params"]] for group in self.optimizer.param_groups]
        self._with_master = list(masters)
        self._ids, self._seen = self._look()

    # -- taking in what others wrote -------------------------------------------------------------------
    def watch_loads(self, model: nn.Module) -> None:
        """Take the exact float32 values that ``load_state_dict`` (of ``model`` or any submodule) gives a
        parameter with a master, instead of their rounding (:mod:`.master_checkpoints`)."""
        self._hooks = hook_loads(model, self, self.masters)

    def _on_load(self, module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *args: Any) -> None:
        self._loaded.update(exact_values(module, state_dict, prefix, self.masters))

    def unwatch(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @torch.no_grad()
    def sync(self) -> None:
        """Make each master the truth again after writes made outside the step (module docstring).
        Nothing while the groups list the masters (a hook of the step, ``state_dict()`` inside it)."""
        if self._swapped or (self._ids is not None and self._look() == (self._ids, self._seen)):
            return  # inside the step, or nothing written, added or replaced since the last sync or step
        params = self._params()
        stamps = self._stamps
        before = dict(zip(self._ids or [], self._seen))  # id -> (version, address) as last seen
        for p in self.masters:  # a stamp's version and address are those seen last (the step's own write)
            if id(p) in before and p in stamps:
                stamps[p] = (*before[id(p)], *stamps[p][2:])
        created = 0
        for p in params:
            master = self.masters.get(p)
            if master is None:
                if p.dtype in LOW_PRECISION:
                    self.masters[p] = p.detach().float()
                    created += 1
                    stamps[p] = _stamp(p)
                    widen_state(self.optimizer, p)
                continue
            if stamps[p] == _stamp(p):
                continue
            loaded = self._loaded.pop(p, None)
            version, _, _, low = stamps[p]
            if p.dtype not in LOW_PRECISION:  # made float32 (or wider) again: it needs no master
                if version == p._version and torch.equal(p, master.to(low).to(p)):
                    p.copy_(master)  # the master's rounding, upcast: the master's value is the better one
                del self.masters[p], stamps[p]
                continue
            if master.device != p.device:  # moved (model.to(device)): the master goes along
                master = self.masters[p] = master.to(p.device)
            if version != p._version or low != p.dtype or not torch.equal(p, master.to(p.dtype)):  # written
                _take_write(p, master, low, loaded)
            stamps[p] = _stamp(p)
        held = set(params)
        for p in [p for p in self.masters if p not in held]:
            del self.masters[p]
            stamps.pop(p, None)
        self._loaded.clear()
        first = self._ids is None
        self._planned()
        if created and not first and not self._warned_new:
            self._warned_new = True
            warnings.warn(f"lean memory: {created} parameter(s) became low precision after memory_lean "
                          "(model.to(dtype)?) and were given float32 masters from their rounded values",
                          RuntimeWarning, stacklevel=3)

    # -- the step --------------------------------------------------------------------------------------
    @contextmanager
    def on_masters(self, grads: bool = False, grad_scale: torch.Tensor | None = None,
                   synced: bool = False) -> Iterator[None]:
        """The wrapped optimizer's groups list the masters, and its state is keyed by them, until the
        block ends (with ``grads``, each master's gradient is its parameter's in float32, divided by
        ``grad_scale`` where given); then the groups and state are the parameters' again, and the
        parameters hold the masters' values rounded (written through the parameters, so their version
        counters move as under any optimizer). The parameters' storage is never swapped: autograd's
        gradient accumulators, and DDP's hooks on them, stay."""
        if self._swapped:  # inside the step already (a hook of it calling a method of the optimizer)
            yield
            return
        if not synced:
            self.sync()
        masters, state = self.masters, self.optimizer.state
        groups = self.optimizer.param_groups
        held = [group["params"] for group in groups]
        with_master = self._with_master
        self._swapped = True
        try:  # (an error from here on leaves the groups and state the parameters' again)
            for group, swapped in zip(groups, self._lists):
                group["params"] = swapped
            for p in with_master:
                value = state.pop(p, None)
                if value is not None:
                    state[masters[p]] = value
            if grads:
                for p, g in self._master_grads(grad_scale).items():
                    masters[p].grad = g
            yield
        finally:
            self._swapped = False
            # read again: load_state_dict replaces the optimizer's groups and state with new objects
            state = self.optimizer.state
            for group, params in zip(self.optimizer.param_groups, held):
                group["params"] = params
            for p in with_master:
                m = masters[p]
                m.grad = None
                value = state.pop(m, None)
                if value is not None:
                    state[p] = value
            if with_master:
                round_into(self.masters, self._flats, with_master)
            self._ids, self._seen = self._look()  # the rounding written here is no one else's write

    def _master_grads(self, grad_scale: torch.Tensor | None) -> dict[nn.Parameter, torch.Tensor]:
        """Each master's float32 gradient for this step: the exact one :meth:`unscale_masters_` kept,
        where the parameter's gradient is still what it wrote there; else the parameter's, upcast (and
        divided by ``grad_scale`` where given)."""
        exact, self._exact = self._exact, {}
        with_grad = [p for p in self._with_master if p.grad is not None]
        out = {p: exact[p][0] for p in with_grad if p in exact and exact[p][1] == grad_key(p)}
        changed = [p for p in with_grad if p in exact and p not in out]
        if changed and not self._warned_changed:
            self._warned_changed = True
            warnings.warn(f"lean memory: {len(changed)} low-precision gradient(s) were changed after the scaler "
                          "unscaled them (torch.nn.utils.clip_grad_norm_?), so the step takes them as they are, "
                          "rounded to their dtype; scaler.clip_grad_norm_(optimizer, max_norm) clips the float32 "
                          "gradients exactly", RuntimeWarning, stacklevel=4)
        todo = [p for p in with_grad if p not in out]
        inverse = None if grad_scale is None else inverse_of(grad_scale, grad_scale.device)
        out.update(zip(todo, float32_grads(grads_of(todo), inverse)))
        return out

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """The wrapped optimizer's own step, once, on the float32 masters (see the module docstring).
        A closure runs first, with gradients on (Lightning's precision plugins pass one)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.sync()
        grad_scale, found_inf = self.__dict__.get("grad_scale"), self.__dict__.get("found_inf")
        inner = self.optimizer
        # torch's fused optimizers take grad_scale/found_inf and skip on the device, without a host read
        if self._on_device is None:
            self._on_device = bool(getattr(inner, "_step_supports_amp_scaling", False)) and \
                "grad_scaler" not in inspect.signature(inner.step).parameters
        on_device = self._on_device
        if found_inf is not None and not on_device and bool(found_inf.item()):
            self._exact = {}  # (the unscaled gradients of a skipped step are not the next step's)
            return loss  # an inf/NaN gradient: nothing moves (the scaler skips the step)
        unscale = None if on_device else grad_scale
        wide = [p for p in self._params() if p not in self.masters and p.grad is not None] if unscale is not None else []
        held = grads_of(wide)
        with self.on_masters(grads=True, grad_scale=unscale, synced=True):
            if wide and unscale is not None:  # float32 parameters' gradients, unscaled for this step only
                scaled = foreach_mul(held, inverse_of(unscale, held[0].device))
                for p, g in zip(wide, scaled):
                    p.grad = g
            if on_device:
                inner.grad_scale, inner.found_inf = grad_scale, found_inf  # type: ignore[attr-defined]  # torch's fused protocol
            try:
                result = inner.step()
            finally:
                if on_device:
                    del inner.grad_scale, inner.found_inf  # type: ignore[attr-defined]  # set just above
                for p, g in zip(wide, held):
                    p.grad = g
        return loss if closure is not None else result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._exact = {}
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its low-precision parameters get masters."""
        self.optimizer.add_param_group(param_group)
        self.sync()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state_dict, as over a float32 model."""
        self.sync()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state_dict of this optimizer, or of the same optimizer over the float32 model (its
        state is cast to the masters' float32, not to the parameters' low precision)."""
        with self.on_masters():
            self.optimizer.load_state_dict(dict(state_dict))

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
