"""What ``GradScaler.step`` does in each of its branches, and the unscale and check they share.

The step itself (``scaler.GradScaler.step``) reads its decisions in order; each branch here is the
part a few lines long: a :class:`Verdict` taken on the host before ``optimizer.step()``
(:func:`check_finite_verdict`, :func:`plain_verdict`, :func:`from_host_verdict`), ``grad_scale`` and
``found_inf`` handed to a fused kernel that skips on the device (:func:`hand_over`), and what is
recorded after (:func:`record_from_host`, :func:`record_on_device`). torch's private per-optimizer
record of the scaler (stage, found_inf per device) is read and written here only
(:class:`PerOptimizerState`), and the gradient work goes through the scaler's
:class:`~.gradwork.GradientOp`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.amp.grad_scaler import OptState

from ..devices import fused
from ..devices.contract import Device
from ..eager import eager
from .gradwork import GradientOp
from .telemetry import Telemetry
from .treatment import Treatment

if TYPE_CHECKING:
    from ..gradients.arena import FlatGrads

__all__ = ["RUNS", "PerOptimizerState", "ScalerState", "Verdict", "check", "check_finite_verdict", "found_any",
           "from_host_verdict", "hand_over", "inv_scale_finite", "plain_verdict", "record_from_host",
           "record_on_device", "refusal", "scale_of", "sum_on", "unscale"]

_CLOSURE = "Closure use is not currently supported if GradScaler is enabled."
Args = tuple[Any, ...]
Kwargs = dict[str, Any]


class ScalerState(Protocol):
    """What the step's branches use of the scaler (:class:`~.scaler.GradScaler`): torch's state
    (``_enabled``, ``_scale``, ``_growth_tracker``, ``_per_optimizer_states``), its own settings, the
    gradient op and the counters. They call nothing of it: the scaler calls them."""

    backend: Device
    _enabled: bool
    _check_finite: bool
    _scale: torch.Tensor | None
    _growth_tracker: torch.Tensor | None
    _per_optimizer_states: Any
    _grads: GradientOp
    _telemetry: Telemetry


class PerOptimizerState:
    """One optimizer's entry in torch's ``GradScaler._per_optimizer_states``: the stage (READY,
    UNSCALED, STEPPED) and found_inf per device, as ``torch.amp.GradScaler`` keeps them."""

    __slots__ = ("_state",)

    def __init__(self, scaler: ScalerState, optimizer: torch.optim.Optimizer) -> None:
        self._state = scaler._per_optimizer_states[id(optimizer)]

    @property
    def stage(self) -> OptState:
        return self._state["stage"]

    @property
    def found(self) -> dict[torch.device, torch.Tensor]:
        return self._state["found_inf_per_device"]

    def checked(self, found: dict[torch.device, torch.Tensor]) -> None:
        self._state["found_inf_per_device"] = found

    def unscaled(self, found: dict[torch.device, torch.Tensor]) -> None:
        self._state["found_inf_per_device"] = found
        self._state["stage"] = OptState.UNSCALED

    def stepped(self) -> None:
        self._state["stage"] = OptState.STEPPED

    def require_found(self) -> dict[torch.device, torch.Tensor]:
        if not self.found:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        return self.found


@dataclass(frozen=True)
class Verdict:
    """What the host decided before ``optimizer.step()``."""

    #: whether ``optimizer.step()`` is skipped (an inf/NaN was found)
    skipped: bool
    #: whether the step counts in the stats (False: ``check_finite`` found no gradient to check)
    counted: bool = True


#: FORWARD's verdict: nothing to check, the optimizer steps (made once: the step builds nothing)
RUNS = Verdict(skipped=False)


def scale_of(scaler: ScalerState, funcname: str) -> torch.Tensor:
    """The scale tensor, which torch makes at the first ``scale()``."""
    if scaler._scale is None or scaler._growth_tracker is None:
        raise RuntimeError(f"GradScaler.{funcname}() called before scale(): call scaler.scale(loss).backward() "
                           "earlier in the iteration.")
    return scaler._scale


def sum_on(found: dict[torch.device, torch.Tensor], device: torch.device) -> torch.Tensor:
    """found_inf over every device, on ``device`` (one tensor: itself)."""
    tensors = [t.to(device, non_blocking=True) for t in found.values()]
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors).sum()


def inv_scale_finite(scaler: ScalerState) -> bool:
    """Whether the host knows 1/scale is finite (the scale is at least 1e-30) without a read."""
    mirror = scaler._telemetry.mirror
    return mirror is not None and mirror[0] >= 1e-30


def found_any(found: dict[torch.device, torch.Tensor]) -> bool:
    """Whether found_inf is set on any device (a host read: the step's one sync)."""
    return bool(sum_on(found, next(iter(found))).item())


def unscale(scaler: ScalerState, optimizer: torch.optim.Optimizer, with_norm: bool = False,
            funcname: str = "unscale_") -> tuple[FlatGrads | None, torch.Tensor | None]:
    """torch's ``unscale_`` on the device's op (1/scale in float32 where it has no float64), found_inf
    recorded. Returns the arena whose buffers were unscaled (None: the per-tensor path) and, with
    ``with_norm``, the fp32 sum of squares of the unscaled gradients from the same pass. float16
    parameters' gradients are refused, as torch refuses them, unless the optimizer updates float32 masters
    of them (``amp_master_weights``)."""
    scale = scale_of(scaler, funcname)
    state = PerOptimizerState(scaler, optimizer)
    if state.stage is OptState.UNSCALED:
        raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
    if state.stage is OptState.STEPPED:
        raise RuntimeError("unscale_() is being called after step().")
    found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
    norm_sq = torch.zeros((), dtype=torch.float32, device=scale.device) if with_norm else None
    masters = bool(getattr(optimizer, "amp_master_weights", False))
    exact = getattr(optimizer, "unscale_masters_", None)
    if exact is not None:  # float32 masters: the gradients are checked as they are, then divided in float32
        found, _ = scaler._grads.run(optimizer, None, found_inf, True)
        exact(scaler._grads.inv_scale(scale), norm_sq)
        state.unscaled(found)
        _remember(scaler, optimizer)
        return None, norm_sq
    found, arena = scaler._grads.run(optimizer, scale, found_inf, masters, norm_sq, inv_scale_finite(scaler))
    state.unscaled(found)
    _remember(scaler, optimizer)
    return arena, norm_sq


def _remember(scaler: ScalerState, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer unscaled, weakly, for :func:`note_backward_after_unscale` (never pickled)."""
    try:
        scaler.__dict__.setdefault("_unscaled_refs", {})[id(optimizer)] = weakref.ref(optimizer)
    except TypeError:  # an optimizer that cannot be weakly referenced: not followed
        pass


def check(scaler: ScalerState, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
    """A read-only check of the gradients (torch's ``_check_inf_per_device``), found_inf recorded."""
    scale = scale_of(scaler, "_check_inf_per_device")
    found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
    found, _ = scaler._grads.run(optimizer, None, found_inf, True)
    PerOptimizerState(scaler, optimizer).checked(found)
    return found


# -- the step's branches ---------------------------------------------------------------------
@eager
def check_finite_verdict(scaler: ScalerState, optimizer: torch.optim.Optimizer, args: Args,
                         kwargs: Kwargs) -> tuple[Verdict, Kwargs]:
    """CHECK_ONLY: the gradients checked now (one host read); the step's keyword arguments, an empty
    closure slot dropped. Frameworks pass the slot empty, by keyword or by position (Accelerate:
    ``scaler.step(optimizer, closure)`` with closure None): only a real closure is refused."""
    kwargs = dict(kwargs)
    closure = kwargs.pop("closure", None) if "closure" in kwargs else (args[0] if args else None)
    if closure is not None or len(args) > 1:
        raise RuntimeError(
            "check_finite=True checks gradients before optimizer.step(), but a closure would compute "
            "them inside it: run the closure (forward and backward) before scaler.step(optimizer)."
        )
    first = next((p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None), None)
    if first is None and scaler._grads.process_group is None:
        return Verdict(skipped=False, counted=False), kwargs
    # a rank with no gradient still joins the agreement the other ranks wait in
    where = first.device if first is not None else scaler.backend.device()
    found, _ = scaler._grads.run(optimizer, None, torch.zeros((), dtype=torch.float32, device=where), True,
                                 require=False)
    skipped = bool(sum_on(found, where).item())
    # another rank's inf skips this rank's step too: counted as a skip here as there
    return Verdict(skipped=skipped, counted=first is not None or skipped), kwargs


def _ready_to_step(scaler: ScalerState, optimizer: torch.optim.Optimizer,
                   kwargs: Kwargs) -> tuple[torch.Tensor, PerOptimizerState]:
    """torch's checks before a scaled step: no closure, a scale, not stepped since the last update."""
    if "closure" in kwargs:
        raise RuntimeError(_CLOSURE)
    scale = scale_of(scaler, "step")
    state = PerOptimizerState(scaler, optimizer)
    if state.stage is OptState.STEPPED:
        raise RuntimeError("step() has already been called since the last update().")
    return scale, state


@eager
def plain_verdict(scaler: ScalerState, optimizer: torch.optim.Optimizer, kwargs: Kwargs) -> Verdict:
    """PLAIN: unscaled (unless done this iteration), skipped on an inf/NaN read on the host."""
    _, state = _ready_to_step(scaler, optimizer, kwargs)
    if state.stage is OptState.READY:
        unscale(scaler, optimizer)
    return Verdict(skipped=found_any(state.require_found()))


@eager
def from_host_verdict(scaler: ScalerState, optimizer: torch.optim.Optimizer, kwargs: Kwargs) -> Verdict:
    """FROM_HOST: checked first and, where this rank found an inf/NaN, skipped with the gradients
    untouched (as torch's fused protocol leaves a skipped step), else unscaled here for the kernel to
    step on. Ranks agree once, after both (another rank's path may be the fused one, which agrees once):
    a rank whose own check was clean has unscaled its gradients when another rank's inf skips the step,
    as torch's unfused scaler leaves them."""
    scale, state = _ready_to_step(scaler, optimizer, kwargs)
    if state.stage is OptState.READY:
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        found, _ = scaler._grads.run(optimizer, None, found_inf, True, agree=False)
        # a device-wide status an earlier optimizer of this iteration read (and reset) skips this one too
        if found and not found_any(found) and not scaler._grads.status_overflow:
            found, _ = scaler._grads.run(optimizer, scale, found_inf, True, inv_scale_finite=inv_scale_finite(scaler),
                                         agree=False)
            state.unscaled(found)
        state.checked(scaler._grads.agree(found, found_inf))
    return Verdict(skipped=found_any(state.require_found()))


@eager
def hand_over(scaler: ScalerState, optimizer: torch.optim.Optimizer, treatment: Treatment, kwargs: Kwargs) -> None:
    """FUSED, UNSCALED_FUSED: set ``grad_scale`` and ``found_inf`` on the optimizer for this step (torch's
    fused protocol as torch 2.5+ runs it, on every torch). FUSED: checked here, the kernel unscales
    (a ``grad_scale`` set after ``unscale_`` applies). UNSCALED_FUSED: unscaled here, ``grad_scale`` None,
    which is what torch's scaler hands a fused optimizer after ``unscale_``."""
    scale, state = _ready_to_step(scaler, optimizer, kwargs)
    if treatment is Treatment.UNSCALED_FUSED:
        if getattr(optimizer, "grad_scale", None) is not None:
            note = fused.fused_kernel_of(scaler.backend, optimizer).note
            raise RuntimeError(
                f"{type(optimizer).__name__}(fused=True) on {scaler.backend.name!r} has a kernel that does not divide "
                f"by grad_scale ({note}), so the grad_scale set on the optimizer would be ignored: "
                "multiply the gradients yourself (after scaler.unscale_(optimizer)) and leave grad_scale unset")
        if state.stage is OptState.READY:
            unscale(scaler, optimizer, funcname="step")
        grad_scale = None
    elif state.stage is OptState.READY:
        check(scaler, optimizer)
        grad_scale = scale * getattr(optimizer, "grad_scale", 1)
    else:
        grad_scale = getattr(optimizer, "grad_scale", None)
    found = state.found
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]  # torch's fused-optimizer protocol: set on the optimizer
    optimizer.found_inf = sum_on(found, scale.device) if found else torch.zeros_like(scale)  # type: ignore[attr-defined]  # torch's fused-optimizer protocol: set on the optimizer


def note_backward_after_unscale(scaler: ScalerState) -> None:
    """``scale()`` of another backward: an optimizer unscaled this iteration may get gradients still
    multiplied by the scale on top of its unscaled ones (a clip on every micro-batch). Its gradients as
    they are now are noted (only then: the common step pays nothing), to tell at its next unscale or
    clip whether this backward reached them."""
    refs = scaler.__dict__.get("_unscaled_refs", {})
    for key, state in getattr(scaler, "_per_optimizer_states", {}).items():  # (torch 2.4 keeps none while disabled)
        optimizer = refs[key]() if key in refs else None
        if state["stage"] is OptState.UNSCALED and "grads_before" not in state and optimizer is not None:
            state["grads_before"] = [(p, p.grad, None if p.grad is None else p.grad._version)
                                     for group in optimizer.param_groups for p in group["params"]]


def refuse_rescaled(scaler: ScalerState, optimizer: torch.optim.Optimizer) -> None:
    """Refuse to unscale or clip gradients that mix unscaled ones with scaled ones a later backward added
    (torch's scaler raises there too, at its second ``unscale_``), before anything changes; an optimizer
    whose gradients no later backward reached (another optimizer's loss) is left alone."""
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
    if state is None or state["stage"] is not OptState.UNSCALED or "grads_before" not in state:
        return
    if any(p.grad is not grad or (grad is not None and grad._version != version)
           for p, grad, version in state["grads_before"]):
        raise RuntimeError(
            "unscale_() has already been called on this optimizer since the last update(), and a backward since "
            "added gradients still multiplied by the scale: unscale and clip once per step, after the last "
            "micro-batch's backward (Accelerate: when accelerator.sync_gradients; Lightning and Fabric: on the "
            "step that calls optimizer.step())")


def end_hand_over(optimizer: torch.optim.Optimizer) -> None:
    """``grad_scale`` and ``found_inf`` (the scaler's or the user's) off the optimizer after its step, as
    torch's scaler removes them: they hold for one step."""
    optimizer.__dict__.pop("grad_scale", None)
    optimizer.__dict__.pop("found_inf", None)


@eager
def refusal(scaler: ScalerState, optimizer: torch.optim.Optimizer) -> RuntimeError:
    """REFUSED: the error for a fused optimizer the device cannot run, raised before anything changes."""
    kernel = fused.fused_kernel_of(scaler.backend, optimizer)
    return RuntimeError(f"{type(optimizer).__name__}(fused=True) cannot run on {scaler.backend.name!r} "
                        f"({kernel.status}): {kernel.note}")


# -- after the optimizer's step --------------------------------------------------------------
@eager
def record_from_host(scaler: ScalerState, optimizer: torch.optim.Optimizer, verdict: Verdict) -> None:
    """Count a step the host decided; with scaling on, torch's record says STEPPED."""
    if not verdict.counted:  # check_finite with no gradient at all: the optimizer ran, nothing was checked
        scaler._telemetry.nothing_stepped()
        return
    scaler._telemetry.stepped(optimizer, verdict.skipped)
    if scaler._enabled:
        PerOptimizerState(scaler, optimizer).stepped()


@eager
def record_on_device(scaler: ScalerState, optimizer: torch.optim.Optimizer) -> None:
    """Count a step the kernel skipped (or not) on the device: what it found stays there until read."""
    state = PerOptimizerState(scaler, optimizer)
    state.stepped()
    found = state.found
    if found:
        scaler._telemetry.stepped_on_device(optimizer, sum_on(found, next(iter(found))) > 0)
    else:  # no parameter had a gradient: nothing stepped, nothing skipped
        scaler._telemetry.nothing_stepped()
