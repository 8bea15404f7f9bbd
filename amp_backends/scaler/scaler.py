"""``torch.amp.GradScaler`` whose unscale and inf/NaN checks run on the backend's op.

:class:`GradScaler` subclasses torch's scaler the way torch's own ``ShardedGradScaler`` does:
stages, per-device caching, the update op, the fused-optimizer protocols, pickling and the
state_dict are torch's. It overrides only where the backend acts: the gradient op
(:class:`~.gradwork.GradientOp`) and :meth:`GradScaler.step`, which reads top to bottom as torch's
does, its branches chosen by the optimizer's :class:`~.treatment.Treatment` (decided once per
optimizer) and written out in :mod:`.steps`. What it adds lives in modules of its own: counters and
the skip signal (:mod:`.telemetry`), clipping (:mod:`.clipping`), argument and state checks
(:mod:`.validation`).

Under ``torch.compile`` its methods run eagerly, as torch's do (:mod:`amp_backends.eager`): a compiled
training step holding ``scale``/``step``/``update`` compiles, and ``optimizer.step()`` is compiled as
torch's scaler lets it be.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import OptState

from ..devices.contract import Device
from ..eager import eager, eager_frame
from ..errors import BackendUnavailableError
from ..registry.registry import registered, resolve_backend
from ..torch_private import refresh_per_optimizer_state as _refresh_per_optimizer_state
from . import clipping, steps
from .checkpointing import Checkpointing
from .gradwork import GradientOp
from .steps import PerOptimizerState, sum_on
from .telemetry import ScalerStats, Signals, Telemetry
from .treatment import Treatment, choose, momentum_buffers_missing
from .validation import (
    SMALLEST_SCALE,
    check_factors,
    check_new_scale,
    check_process_group,
    clip_args,
    flag,
    scalar_arg,
)

if TYPE_CHECKING:
    from ..gradients.arena import FlatGrads

__all__ = ["GradScaler", "ScalerStats"]


def _backend_of(backend: Any, device: Any, used: bool) -> Device:
    """The backend a scaler runs on. A scaler that scales and checks nothing (``enabled=False``, no
    ``check_finite``) may name a device this machine lacks, as torch's may: the pattern
    ``GradScaler("cuda", enabled=use_amp)`` runs on a CPU-only machine with ``use_amp`` False."""
    try:
        return resolve_backend(backend, device)
    except BackendUnavailableError:
        stand_in = None if used else registered(backend, device)
        if stand_in is None:
            raise
        return stand_in


class GradScaler(Checkpointing, Signals, torch.amp.GradScaler):
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

    def __init__(
        self,
        backend: str | Device | torch.device | None = None,
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
        enabled = flag("enabled", enabled)
        self._check_finite = flag("check_finite", check_finite)
        self._dynamic = flag("dynamic", dynamic)
        init_scale, growth_factor, backoff_factor = map(scalar_arg, (init_scale, growth_factor, backoff_factor))
        check_factors(init_scale, growth_factor, backoff_factor, growth_interval, ValueError)
        check_process_group(process_group)
        self.backend: Device = _backend_of(backend, device, enabled or self._check_finite)
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
        self._grads = GradientOp(self.backend, process_group)
        self._treatments: weakref.WeakKeyDictionary[torch.optim.Optimizer, Treatment] = weakref.WeakKeyDictionary()

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
        steps.note_backward_after_unscale(self)
        return super().scale(outputs)

    @eager
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale (torch's ``unscale_``, on the backend's
        op; 1/scale in float32 where the device has no float64) and record found_inf."""
        if self._enabled:
            steps.unscale(self, optimizer)

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        return self._grads.run(optimizer, None, found_inf, allow_fp16, inv_scale=inv_scale)[0]

    @eager
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return steps.check(self, optimizer)

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        return steps.scale_of(self, funcname), self._growth_tracker  # type: ignore[return-value]  # torch's signature: the tracker is its tensor

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
        frame of its own, as with torch's scaler: every other call here runs eagerly.
        """
        treatment = self._treatment(optimizer)
        if treatment.skips_on_device and isinstance(optimizer, torch.optim.SGD) and momentum_buffers_missing(optimizer):
            treatment = Treatment.FROM_HOST  # fused SGD: a step skipped on the device leaves new buffers unset
        if treatment is Treatment.REFUSED:
            raise steps.refusal(self, optimizer)
        if treatment is Treatment.OPTIMIZER_OWNED:  # its step(grad_scaler=self) unscales, checks and skips
            result = super().step(optimizer, *args, **kwargs)
            steps.record_on_device(self, optimizer)
            return result
        if treatment.skips_on_device:  # FUSED, UNSCALED_FUSED: handed grad_scale and found_inf for this step
            steps.hand_over(self, optimizer, treatment, kwargs)
            try:
                result = optimizer.step(*args, **kwargs)
            finally:  # they hold for this step only
                steps.end_hand_over(optimizer)
            steps.record_on_device(self, optimizer)
            return result
        # the host decides: FORWARD, CHECK_ONLY, PLAIN, FROM_HOST
        if treatment is Treatment.FORWARD:  # scaling off, nothing to check
            verdict = steps.RUNS
        elif treatment is Treatment.CHECK_ONLY:  # scaling off, check_finite: one host read, no closure
            verdict, kwargs = steps.check_finite_verdict(self, optimizer, args, kwargs)
            args = ()
        elif treatment is Treatment.PLAIN:  # torch's path: unscale unless done, skip on a host read
            verdict = steps.plain_verdict(self, optimizer, kwargs)
        else:  # FROM_HOST: checked first, skipped with the gradients untouched, else unscaled
            verdict = steps.from_host_verdict(self, optimizer, kwargs)
        try:
            result = None if verdict.skipped else optimizer.step(*args, **kwargs)
        finally:
            if treatment is Treatment.FROM_HOST:  # a grad_scale the user set holds for this step only
                steps.end_hand_over(optimizer)
        steps.record_from_host(self, optimizer, verdict)
        return result

    @eager
    def _treatment(self, optimizer: torch.optim.Optimizer) -> Treatment:
        """``optimizer``'s treatment, chosen at its first step (:func:`~.treatment.choose`), then kept; an
        optimizer that cannot be a weak key (unhashable: a subclass defining ``__eq__``; ``__slots__``
        without ``__weakref__``) has it chosen again at each step, as nothing may be kept by ``id``."""
        try:
            treatment = self._treatments.get(optimizer)
        except TypeError:
            return choose(self._enabled, self._check_finite, self.backend, optimizer)
        if treatment is None:
            treatment = choose(self._enabled, self._check_finite, self.backend, optimizer)
            self._treatments[optimizer] = treatment
        return treatment

    @eager
    def ensure_unscaled_(self, optimizer: torch.optim.Optimizer) -> None:
        """``unscale_(optimizer)`` unless this iteration already unscaled it (or scaling is off):
        for framework code that unscales before clipping and cannot know whether it already did."""
        steps.refuse_rescaled(self, optimizer)
        if self._enabled and self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            steps.unscale(self, optimizer)

    @eager
    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool | None:
        """Whether this iteration's unscaled gradients of ``optimizer`` hold an inf/NaN (its step
        will be skipped); None before they are unscaled, or with scaling off and ``check_finite``
        unset. With scaling off and ``check_finite`` set, the gradients are checked now, this rank's
        only (no collective: a query from one rank must not pair with the others' all-reduces; the
        step's verdict, agreed, is ``last_step_skipped`` after it). A host read."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"found_inf takes the optimizer whose gradients were unscaled, got "
                            f"{type(optimizer).__name__}: call scaler.found_inf(optimizer) after unscale_(optimizer) "
                            "or clip_grad_norm_(optimizer, ...)")
        if not self._enabled:
            if not self._check_finite:
                return None
            found, _ = self._grads.run(optimizer, None, torch.zeros(()), True, agree=False)
            return bool(found) and steps.found_any(found)
        state = PerOptimizerState(self, optimizer)
        if state.stage is OptState.READY or not state.found:
            return None
        return steps.found_any(state.found)

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
        checks and sums squares. With a fused optimizer (``AdamW(fused=True)``) too, the
        gradients are unscaled and clipped in place, and the kernel then steps on them as torch's
        fused protocol does after ``unscale_``.

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
        if self._enabled and PerOptimizerState(self, optimizer).stage is OptState.STEPPED:
            raise RuntimeError("clip_grad_norm_() is being called after step(): clip between backward and "
                               "scaler.step(optimizer), before update()")
        groups = clipping.group_norms(self, optimizer, norm_type) if flag("per_group", per_group) else None
        total = clipping.clip(self, optimizer, max_norm, norm_type)
        self._telemetry.grad_norm = total.detach().clone()  # the caller's tensor is theirs to change
        self._telemetry.group_grad_norms = groups
        return total

    # -- what clipping asks of the scaler (clipping.ScalerForClipping) -------------------
    def _clip_stage(self, optimizer: torch.optim.Optimizer) -> OptState:
        steps.refuse_rescaled(self, optimizer)
        return PerOptimizerState(self, optimizer).stage if self._enabled else OptState.UNSCALED

    def _clip_unscale(self, optimizer: torch.optim.Optimizer,
                      with_norm: bool = False) -> tuple[FlatGrads | None, torch.Tensor | None]:
        return steps.unscale(self, optimizer, with_norm, "clip_grad_norm_" if with_norm else "unscale_")

    def _clip_one_pass(self) -> bool:
        return bool(self._grads.settled_kernel().one_pass_norm)

    def _clip_total(self, total: torch.Tensor) -> torch.Tensor:
        """The norm as the step will see it: inf where the scale underflowed to 0, or where a
        device-wide status said overflow (the values are saturated)."""
        if self._grads.status_overflow:
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
            self._iteration_open = self._grads.status_overflow = False
            return
        scale = steps.scale_of(self, "update")
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
                overflow = torch.stack([sum_on(s["found_inf_per_device"], scale.device) for _, s in stepped]).sum() > 0
            if self._dynamic:
                super().update()
                if self._scale is not None:  # backed off no further than a scale whose reciprocal is finite
                    self._scale.clamp_(min=SMALLEST_SCALE)
            else:  # static loss scaling: the scale stays; only the iteration's state is reset
                self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
            factors = (self._growth_factor, self._backoff_factor, self._growth_interval) if self._dynamic else None
            tel.updated(overflow, factors, scale)
        self._iteration_open = self._grads.status_overflow = False

    # -- setters and state ----------------------------------------------------------------
    def set_growth_factor(self, new_factor: float) -> None:
        check_factors(1.0, new_factor, 0.5, 1, ValueError)
        super().set_growth_factor(float(new_factor))

    def set_backoff_factor(self, new_factor: float) -> None:
        check_factors(1.0, 2.0, new_factor, 1, ValueError)
        super().set_backoff_factor(float(new_factor))

    def set_growth_interval(self, new_interval: int) -> None:
        """torch's setter; clean steps already counted past a shorter interval leave the tracker one short
        of it (torch's keeps counting past it, and the scale never grows again)."""
        check_factors(1.0, 2.0, 0.5, new_interval, ValueError)
        super().set_growth_interval(int(new_interval))
        tracker = getattr(self, "_growth_tracker", None)
        if isinstance(tracker, torch.Tensor) and int(tracker.item()) >= int(new_interval):
            tracker.fill_(int(new_interval) - 1)
        elif not isinstance(tracker, torch.Tensor) and self._init_growth_tracker >= int(new_interval):
            self._init_growth_tracker = int(new_interval) - 1

    def __repr__(self) -> str:
        return f"<GradScaler backend={self.backend.name!r} enabled={self._enabled}>"
