"""``torch.amp.GradScaler`` whose unscale and inf/NaN checks run on the backend's ops.

:class:`GradScaler` subclasses torch's scaler the way torch's own ``ShardedGradScaler`` does:
stages, per-device caching, the update op, the fused-optimizer protocols, pickling and the
state_dict are torch's. It overrides only where the backend acts (the unscale + inf/NaN check and
the read-only check before a fused step run as one backend op, :meth:`Backend.grad_op_`), and where
a fused kernel ignores ``found_inf`` (the scaler unscales and skips itself). What it adds lives in
modules of its own: counters and the skip signal (:mod:`.telemetry`), clipping (:mod:`.clipping`),
argument and state checks (:mod:`.validation`), agreement across ranks (:mod:`.consensus`).

Under ``torch.compile`` its methods run eagerly, as torch's do (:mod:`.eager`): a compiled training
step holding ``scale``/``step``/``update`` compiles, and ``optimizer.step()`` is compiled as torch's
scaler lets it be.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from . import clipping
from . import consensus
from ..devices import fused as fused_kernels
from ..gradients.arena import FlatGrads
from ..backend import provide
from ..eager import eager, eager_frame
from ..gradients.collect import collect
from .telemetry import ScalerStats, Telemetry
from .validation import (
    check_factors,
    check_new_scale,
    check_process_group,
    clip_args,
    f32,
    flag,
    scalar_arg,
    validate_state_dict,
)

if TYPE_CHECKING:
    from ..backend import Backend

__all__ = ["GradScaler", "ScalerStats"]

_CLOSURE = "Closure use is not currently supported if GradScaler is enabled."
# How an optimizer's step goes (GradScaler._before_step): scaling off (with or without check_finite);
# unscaled and skipped from the host (a plain optimizer; a fused one whose kernel is not trusted with
# found_inf); skipped on the device (fused); or the optimizer's own step(grad_scaler=...) protocol.
_UNSCALED, _CHECKED, _PLAIN, _HOST, _FUSED, _GRAD_SCALER = "unscaled", "checked", "plain", "host", "fused", "grad_scaler"


def _sum_on(found: Mapping[torch.device, torch.Tensor], device: torch.device) -> torch.Tensor:
    tensors = [t.to(device, non_blocking=True) for t in found.values()]
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors).sum()


class GradScaler(torch.amp.GradScaler):
    """Dynamic loss scaler (a ``torch.amp.GradScaler``) whose gradient ops are the backend's.

    Args:
        backend: a backend name (``"cpu"``, ``"cuda"``, ...), a Backend, a ``torch.device``,
            or None for the best available (or the one serving ``device``).
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as torch's.
        device: a device type, as torch spells it (``GradScaler(device="cuda")``); picks the
            backend serving that device type when ``backend`` is None.
        check_finite: when scaling is disabled, still skip a step whose gradients hold inf/NaN.
        process_group: all-reduce found_inf over this group (``"world"``: the default group)
            so that ranks holding different gradients (ZeRO, hand-made shards) skip the same
            steps. FSDP2's DTensor gradients need none: torch's op reduces over their mesh.
        dynamic: False for static loss scaling (torch_npu's ``dynamic=False``): the scale stays
            ``init_scale``; steps with inf/NaN gradients are still skipped (torch_npu's static
            mode checks nothing and always steps; docs/backends/npu.md says why this differs).
    """

    #: whether this iteration's first scale() ran the backend's on_scale hook
    _iteration_open = False
    #: a device-wide overflow status seen this iteration (shared by every optimizer of it)
    _status_overflow = False

    def __init__(
        self,
        backend: str | Backend | torch.device | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        device: str | torch.device | None = None,
        check_finite: bool = False,
        process_group: Any = None,
        dynamic: bool = True,
    ) -> None:
        from ..registry.registry import resolve_backend

        enabled = flag("enabled", enabled)
        self._check_finite = flag("check_finite", check_finite)
        self._dynamic = flag("dynamic", dynamic)
        init_scale, growth_factor, backoff_factor = map(scalar_arg, (init_scale, growth_factor, backoff_factor))
        check_factors(init_scale, growth_factor, backoff_factor, growth_interval, ValueError)
        check_process_group(process_group)
        self.backend: Backend = resolve_backend(backend, device)
        self._process_group = process_group
        super().__init__(
            self.backend.device_type,
            init_scale=float(init_scale),
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            growth_interval=int(growth_interval),
            enabled=enabled,
        )
        if not self._enabled:  # torch keeps no factors when disabled; the getters still answer
            self._init_scale, self._growth_factor = float(init_scale), float(growth_factor)
            self._backoff_factor, self._growth_interval = float(backoff_factor), int(growth_interval)
            self._init_growth_tracker = 0
        self._telemetry = Telemetry(float(init_scale))
        #: the arena whose buffers the last gradient op ran on (None: the per-tensor path)
        self._arena: FlatGrads | None = None

    # -- where the backend acts ---------------------------------------------------------
    @eager
    def scale(self, outputs: Any) -> Any:
        """torch's ``scale``; the first call of an iteration (after construction or ``update()``)
        runs the backend's :meth:`~amp_backends.Backend.on_scale` hook first, which clears a
        device-wide overflow status before any backward of the iteration (torch_npu clears it
        there, once: later micro-batches' ``scale()`` must not wipe an earlier overflow)."""
        if (self._enabled or self._check_finite) and not self._iteration_open:
            self._iteration_open = True
            self.backend.on_scale(self)
        return super().scale(outputs)

    def _inv_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """1/scale as torch computes it (in float64), or in float32 where the device has no float64."""
        return scale.double().reciprocal().float() if self.backend.has_fp64 else scale.reciprocal()

    @eager
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale (torch's ``unscale_``, on the backend's
        op; 1/scale in float32 where the device has no float64) and record found_inf."""
        if self._enabled:
            self._unscale(optimizer)

    def _unscale(self, optimizer: torch.optim.Optimizer) -> None:
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        state["found_inf_per_device"] = self._grad_op(optimizer, self._inv_scale(scale), found_inf, False)
        state["stage"] = OptState.UNSCALED

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        return self._grad_op(optimizer, inv_scale, found_inf, allow_fp16)

    @eager
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._grad_op(optimizer, None, found_inf, True)
        return state["found_inf_per_device"]

    def _grad_op(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor | None,
        found_inf: torch.Tensor,
        allow_fp16: bool,
        norm_sq: torch.Tensor | None = None,
    ) -> dict[torch.device, torch.Tensor]:
        """The step's gradient work: the optimizer's gradients (its arena's buffers, or one walk),
        one backend op over them, then agreement across ranks. ``inv_scale`` None is a read-only
        check; ``norm_sq`` also receives the fp32 sum of squares. Returns found_inf per device."""
        groups, arena = collect(optimizer, allow_fp16, norm_sq is not None)
        self._arena = arena if groups else None
        found = self.backend.grad_op_(groups, found_inf, inv_scale, norm_sq)
        if self._arena is not None and inv_scale is not None:
            self._arena.after_multiply(finite=self._scale_known_normal())
        if self.backend.global_overflow_status:
            if not found and consensus.ranks_agree_on_status(self._process_group):
                # no gradient on this rank: it reads its status and still takes part in the agreement the
                # other ranks wait in (torch_npu always all-reduces)
                self.backend.read_overflow_status_(found_inf)
                found = {found_inf.device: found_inf}
            if found:
                self._status_overflow = consensus.share_status(found, self._status_overflow, self._process_group)
        elif self._process_group is not None:
            consensus.agree(found, self._process_group)
        return found

    def _scale_known_normal(self) -> bool:
        """Whether the host knows the scale is at least 1e-30 (so 1/scale is finite) without a read."""
        mirror = self._telemetry.mirror
        return mirror is not None and mirror[0] >= 1e-30

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scale is None or self._growth_tracker is None:
            raise RuntimeError(
                f"GradScaler.{funcname}() called before scale(): call scaler.scale(loss).backward() "
                "earlier in the iteration."
            )
        return self._scale, self._growth_tracker

    def _stage(self, optimizer: torch.optim.Optimizer) -> OptState:
        return self._per_optimizer_states[id(optimizer)]["stage"] if self._enabled else OptState.UNSCALED

    def _refuse_unrunnable(self, optimizer: torch.optim.Optimizer) -> None:
        """A fused optimizer the device cannot run at all is refused before anything changes."""
        kernel = self.backend.fused_kernel(optimizer)
        if kernel.status in (fused_kernels.ABSENT, fused_kernels.REFUSED):
            raise RuntimeError(
                f"{type(optimizer).__name__}(fused=True) cannot run on {self.backend.name!r} "
                f"({kernel.status}): {kernel.note}"
            )

    def _fused(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` gets ``grad_scale``/``found_inf`` and skips on the device: it
        supports AMP scaling, and the backend's fused kernel for it honours found_inf."""
        return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and self.backend.fused_honours_found_inf(optimizer)

    # -- step -----------------------------------------------------------------------------
    @eager_frame
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, then run ``optimizer.step()`` unless a gradient was inf/NaN.

        Returns what ``optimizer.step`` returns; ``last_step_skipped`` tells whether it ran.
        A disabled scaler forwards everything (a closure too) unless ``check_finite`` is set.
        An optimizer with ``_step_supports_amp_scaling`` skips on the device by itself: it gets
        ``grad_scale``/``found_inf`` (or ``grad_scaler=self`` where its ``step`` takes that),
        unless its fused kernel is not trusted with them on this device; the scaler then skips it.
        Under torch.compile this frame is not traced, and ``optimizer.step()`` is compiled as a
        frame of its own, as with torch's scaler.
        """
        route, skipped, args, kwargs = self._before_step(optimizer, args, kwargs)
        if route == _GRAD_SCALER:  # the optimizer's step takes grad_scaler=: torch's protocol
            result = super().step(optimizer, *args, **kwargs)
        else:
            try:
                result = None if skipped else optimizer.step(*args, **kwargs)
            finally:
                if route == _FUSED:
                    optimizer.__dict__.pop("grad_scale", None)
                    optimizer.__dict__.pop("found_inf", None)
        self._after_step(route, optimizer, skipped)
        return result

    @eager
    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> tuple[str, bool | None, tuple[Any, ...], dict[str, Any]]:
        """How this optimizer's step goes, and what it needs before ``optimizer.step()``: whether
        it is skipped (None: it runs and is not counted as a checked step), and its arguments."""
        if not self._enabled:
            if not self._check_finite:
                return _UNSCALED, False, args, kwargs
            skipped, kwargs = self._checked_step(optimizer, args, kwargs)
            return _CHECKED, skipped, (), kwargs
        fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        if fused:
            self._refuse_unrunnable(optimizer)
        if fused and self._fused(optimizer) and "grad_scaler" in inspect.signature(optimizer.step).parameters:
            return _GRAD_SCALER, False, args, kwargs
        if "closure" in kwargs:
            raise RuntimeError(_CLOSURE)
        scale, _ = self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if not fused:  # torch's plain path: unscale, then skip from the host (the step's one sync)
            if state["stage"] is OptState.READY:
                self._unscale(optimizer)
            if not state["found_inf_per_device"]:
                raise AssertionError("No inf checks were recorded for this optimizer.")
            return _PLAIN, self._found_any(state), args, kwargs
        if not self._fused(optimizer):  # a fused kernel not trusted with found_inf: skipped (or unscaled)
            # from here, with what torch's fused protocol leaves: a skipped step's gradients untouched
            if state["stage"] is OptState.READY:
                self._check_inf_per_device(optimizer)
                if not state["found_inf_per_device"]:
                    raise AssertionError("No inf checks were recorded for this optimizer.")
                if self._found_any(state):
                    return _HOST, True, args, kwargs
                found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
                state["found_inf_per_device"] = self._grad_op(optimizer, self._inv_scale(scale), found_inf, True)
                state["stage"] = OptState.UNSCALED
            if not state["found_inf_per_device"]:
                raise AssertionError("No inf checks were recorded for this optimizer.")
            return _HOST, self._found_any(state), args, kwargs
        # torch's grad_scale/found_inf protocol as torch 2.5+ runs it, on every torch: after unscale_
        # a grad_scale set on the optimizer is applied
        if state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
            grad_scale = scale * getattr(optimizer, "grad_scale", 1)
        else:
            grad_scale = getattr(optimizer, "grad_scale", None)
        found = state["found_inf_per_device"]
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = _sum_on(found, scale.device) if found else torch.zeros_like(scale)  # type: ignore[attr-defined]
        return _FUSED, False, args, kwargs

    def _checked_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> tuple[bool | None, dict[str, Any]]:
        """Scaling off, ``check_finite`` on: the gradients are checked before the step."""
        # frameworks pass the closure slot empty, by keyword or by position (Accelerate:
        # ``scaler.step(optimizer, closure)`` with closure None): only a real closure is refused
        kwargs = dict(kwargs)
        closure = kwargs.pop("closure", None) if "closure" in kwargs else (args[0] if args else None)
        if closure is not None or len(args) > 1:
            raise RuntimeError(
                "check_finite=True checks gradients before optimizer.step(), but a closure would compute "
                "them inside it: run the closure (forward and backward) before scaler.step(optimizer)."
            )
        first = next((p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None), None)
        if first is None:
            return None, kwargs
        found = self._grad_op(optimizer, None, torch.zeros((), dtype=torch.float32, device=first.device), True)
        return bool(_sum_on(found, first.device).item()), kwargs

    @eager
    def _after_step(self, route: str, optimizer: torch.optim.Optimizer, skipped: bool | None) -> None:
        if skipped is None:  # check_finite with no gradient at all: the optimizer ran, nothing was checked
            self._telemetry.nothing_stepped()
            return
        if route in (_UNSCALED, _CHECKED, _PLAIN, _HOST):
            self._telemetry.stepped(optimizer, skipped)
            if route in (_PLAIN, _HOST):
                self._per_optimizer_states[id(optimizer)]["stage"] = OptState.STEPPED
            return
        state = self._per_optimizer_states[id(optimizer)]
        state["stage"] = OptState.STEPPED
        found = state["found_inf_per_device"]
        if found:  # the optimizer skipped on the device: the flag stays there until someone reads it
            self._telemetry.stepped_on_device(optimizer, _sum_on(found, next(iter(found))) > 0)
        else:  # no parameter had a gradient: nothing stepped, nothing skipped
            self._telemetry.nothing_stepped()

    def _found_any(self, optimizer_state: dict[str, Any]) -> bool:
        """Whether found_inf is set on any device (a host read: the step's one sync)."""
        found = optimizer_state["found_inf_per_device"]
        return bool(_sum_on(found, next(iter(found))).item())

    @eager
    def ensure_unscaled_(self, optimizer: torch.optim.Optimizer) -> None:
        """``unscale_(optimizer)`` unless this iteration already unscaled it (or scaling is off):
        for framework code that unscales before clipping and cannot know whether it already did."""
        if self._enabled and self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            self._unscale(optimizer)

    @eager
    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool | None:
        """Whether this iteration's unscaled gradients of ``optimizer`` hold an inf/NaN (its step
        will be skipped); None before they are unscaled, or with scaling off and ``check_finite``
        unset. With scaling off and ``check_finite`` set, the gradients are checked now. A host read."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"found_inf takes the optimizer whose gradients were unscaled, got "
                            f"{type(optimizer).__name__}: call scaler.found_inf(optimizer) after unscale_(optimizer) "
                            "or clip_grad_norm_(optimizer, ...)")
        if not self._enabled:
            if not self._check_finite:
                return None
            found = self._grad_op(optimizer, None, torch.zeros(()), True, None)
            return bool(found) and bool(_sum_on(found, next(iter(found))).item() > 0)
        state = self._per_optimizer_states[id(optimizer)]
        found = state["found_inf_per_device"]
        if state["stage"] is OptState.READY or not found:
            return None
        return bool(_sum_on(found, next(iter(found))).item() > 0)

    # -- clipping -------------------------------------------------------------------------
    @eager
    def clip_grad_norm_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        per_group: bool = False,
    ) -> torch.Tensor:
        """Unscale (if not done yet) and clip the optimizer's gradients to ``max_norm``.

        Returns the total norm of the unscaled gradients (a device tensor; inf/NaN when the
        step will be skipped, inf when the scale has underflowed to 0). With torch's kernel
        this is ``unscale_`` followed by ``torch.nn.utils.clip_grad_norm_``, bit for bit.
        With a kernel that measures the norm while it unscales (Triton) one pass unscales,
        checks and sums squares. With a fused optimizer (``AdamW(fused=True)``) the
        gradients are only read: the clip is folded into the optimizer's ``grad_scale``.

        The total norm is kept in :attr:`stats` (``grad_norm``), and with ``per_group`` each
        parameter group's norm before clipping (``group_grad_norms``), both as device tensors:
        monitoring them costs no host sync.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"clip_grad_norm_ takes the optimizer whose gradients to clip, got {type(optimizer).__name__}: "
                "call scaler.clip_grad_norm_(optimizer, max_norm) (the scaler unscales per optimizer)"
            )
        max_norm, norm_type = clip_args(max_norm, norm_type)
        if self._stage(optimizer) is OptState.STEPPED:
            raise RuntimeError("clip_grad_norm_() is being called after step(): clip between backward and "
                               "scaler.step(optimizer), before update()")
        groups = clipping.group_norms(self, optimizer, norm_type) if flag("per_group", per_group) else None
        total = clipping.clip(self, optimizer, max_norm, norm_type)
        self._telemetry.grad_norm = total.detach().clone()  # the caller's tensor is theirs to change
        self._telemetry.group_grad_norms = groups
        return total

    def _inf_when_scale_underflowed(self, total: torch.Tensor) -> torch.Tensor:
        if self._status_overflow:  # a device-wide status said overflow: the values are saturated
            return torch.full_like(total, float("inf"))
        if not self._enabled or self._scale is None:
            return total
        return torch.where(self._scale.to(total.device) == 0, torch.full_like(total, float("inf")), total)

    # -- update ---------------------------------------------------------------------------
    @eager
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back the scale off after an overflow, grow it after ``growth_interval`` clean steps;
        or set it to ``new_scale`` (a positive number or a one-element tensor)."""
        if not self._enabled:
            self._telemetry.updated_disabled()
            self._iteration_open = self._status_overflow = False
            return
        scale, _ = self._check_scale_growth_tracker("update")
        tel = self._telemetry
        if new_scale is not None:
            value = check_new_scale(new_scale, scale.device)
            super().update(value)
            tel.scale_set(value)
            tel.step_flags = {}
            tel.updates += 1
        else:
            stepped = [(k, s) for k, s in self._per_optimizer_states.items() if s["found_inf_per_device"]]
            if not stepped:
                raise RuntimeError("No inf checks were recorded prior to update. "
                                   "Call scaler.step(optimizer) before update().")
            host = [tel.step_flags.get(k) for k, _ in stepped]
            overflow: bool | torch.Tensor = any(host)
            if any(h is None for h in host):  # a fused step skipped on the device: read nothing, keep the flag there
                overflow = torch.stack([_sum_on(s["found_inf_per_device"], scale.device) for _, s in stepped]).sum() > 0
            if self._dynamic:
                super().update()
            else:  # static loss scaling: the scale stays; only the iteration's state is reset
                self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
            factors = (self._growth_factor, self._backoff_factor, self._growth_interval) if self._dynamic else None
            tel.updated(overflow, factors, scale)
        self._iteration_open = self._status_overflow = False

    # -- signals and stats ----------------------------------------------------------------
    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent ``step()`` skipped ``optimizer.step()`` (inf/NaN gradients).

        Known without a device sync after the usual path; after a fused optimizer's
        step, reading it waits for the device.
        """
        skipped = self._telemetry.last_skipped
        return bool(skipped.item()) if isinstance(skipped, torch.Tensor) else skipped

    @property
    def stats(self) -> ScalerStats:
        """Steps, skipped steps, overflows, scale and last overflow; read without a device
        sync except after fused-optimizer steps, whose counters live on the device."""
        tel = self._telemetry
        if not self._enabled:
            scale = 1.0
        elif self._scale is None:
            scale = self._init_scale  # what get_scale() says before the first scale()
        elif tel.mirror is not None:
            scale = tel.mirror[0]
        else:
            scale = self.get_scale()
        return tel.stats(scale)

    # -- setters and state ----------------------------------------------------------------
    def set_growth_factor(self, new_factor: float) -> None:
        check_factors(1.0, new_factor, 0.5, 1, ValueError)
        super().set_growth_factor(float(new_factor))

    def set_backoff_factor(self, new_factor: float) -> None:
        check_factors(1.0, 2.0, new_factor, 1, ValueError)
        super().set_backoff_factor(float(new_factor))

    def set_growth_interval(self, new_interval: int) -> None:
        check_factors(1.0, 2.0, 0.5, new_interval, ValueError)
        super().set_growth_interval(int(new_interval))

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict; plus ``"dynamic"`` (whether the scale moves) where the backend says
        its vendor's scaler requires it to load one (torch_npu's; torch's ignores the extra key)."""
        state = super().state_dict()
        if self._enabled and self.backend.state_dict_dynamic:
            state["dynamic"] = self._dynamic
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state_dict from this scaler, ``torch.amp.GradScaler`` or torch_npu's scaler (whose
        ``"dynamic"`` is taken, as torch_npu takes it); a malformed one raises StateDictError and
        changes nothing."""
        if not self._enabled:
            return
        values = validate_state_dict(state_dict)
        super().load_state_dict(values)
        self._dynamic = values.get("dynamic", self._dynamic)
        self._telemetry.mirror = (f32(values["scale"]), values["_growth_tracker"])

    def __getstate__(self) -> dict[str, Any]:
        pg = self._process_group
        if pg is not None and pg != "world":
            raise TypeError(
                "a GradScaler holding a process group object cannot be pickled: pickle its state_dict(), "
                "or build it with process_group='world'."
            )
        state = super().__getstate__()
        state["backend"] = self.backend.name  # resolved again from the registry on load
        state["_arena"] = None
        state["_telemetry"] = self._telemetry.for_pickling(self._enabled, state["_init_scale"],
                                                           state.get("_init_growth_tracker", 0))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        from ..registry.registry import get

        state = dict(state)
        state["backend"] = get(state["backend"])
        super().__setstate__(state)

    def __repr__(self) -> str:
        return f"<GradScaler backend={self.backend.name!r} enabled={self._enabled}>"


def _for_backend(backend: Backend, needs_scaling: bool, kwargs: dict[str, Any]) -> GradScaler:
    """``Backend.grad_scaler``: scaling on where the dtype needs it and the caller allows it."""
    kwargs["enabled"] = flag("enabled", kwargs.get("enabled", True)) and needs_scaling
    return GradScaler(backend, **kwargs)


provide("grad_scaler", _for_backend)  # Backend.grad_scaler builds this class without importing it
