"""The plan each optimizer's step follows, decided once per optimizer (:func:`choose`).

- :class:`Forward`: scaling off (bf16) and nothing to check: the optimizer steps.
- :class:`CheckOnly`: scaling off, ``check_finite`` on: the gradients are checked first.
- :class:`Plain`: torch's path for a plain optimizer: unscale, then skip from the host (the step's one sync).
- :class:`Fused`: a fused optimizer whose kernel honours found_inf gets ``grad_scale`` and ``found_inf``
  and skips on the device.
- :class:`UnscaledFused`: a fused optimizer whose kernel skips on found_inf but does not divide by
  ``grad_scale`` has its gradients unscaled first and gets ``found_inf`` with ``grad_scale`` None
  (torch's protocol after ``unscale_``).
- :class:`FusedFromHost`: a fused optimizer whose kernel is not trusted with them is checked, unscaled
  and skipped from the host, leaving what torch's fused protocol leaves.
- :class:`OptimizerOwned`: the optimizer's own ``step(grad_scaler=...)`` protocol (torch's).
- :class:`Refused`: a fused kernel the device cannot run.

Each plan owns what happens before and after ``optimizer.step()``. torch's private per-optimizer record
of the scaler (stage, found_inf per device) is read and written here only (:class:`Record`), and the
gradient work goes through the scaler's :class:`~.gradwork.GradientOp`.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.amp.grad_scaler import OptState

from ..devices import fused
from ..devices.contract import Device
from .gradwork import GradientOp
from .telemetry import Telemetry

if TYPE_CHECKING:
    from ..gradients.arena import FlatGrads

__all__ = ["Plan", "Record", "Scaling", "check", "choose", "found_any", "scale_of", "sum_on", "unscale"]

_CLOSURE = "Closure use is not currently supported if GradScaler is enabled."
Args = tuple[Any, ...]
Kwargs = dict[str, Any]


class Scaling(Protocol):
    """What the plans use of the scaler (:class:`~.scaler.GradScaler`): torch's state (``_enabled``,
    ``_scale``, ``_growth_tracker``, ``_per_optimizer_states``), its own settings, the gradient op and
    the counters. They call nothing of it: the scaler calls them."""

    backend: Device
    _enabled: bool
    _check_finite: bool
    _scale: torch.Tensor | None
    _growth_tracker: torch.Tensor | None
    _per_optimizer_states: Any
    _grads: GradientOp
    _telemetry: Telemetry


class Record:
    """torch's per-optimizer record of a scaler: the stage (READY, UNSCALED, STEPPED) and found_inf
    per device, as ``torch.amp.GradScaler`` keeps them (``_per_optimizer_states``)."""

    __slots__ = ("_state",)

    def __init__(self, scaler: Scaling, optimizer: torch.optim.Optimizer) -> None:
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


def scale_of(scaler: Scaling, funcname: str) -> torch.Tensor:
    """The scale tensor, which torch makes at the first ``scale()``."""
    if scaler._scale is None or scaler._growth_tracker is None:
        raise RuntimeError(f"GradScaler.{funcname}() called before scale(): call scaler.scale(loss).backward() "
                           "earlier in the iteration.")
    return scaler._scale


def sum_on(found: dict[torch.device, torch.Tensor], device: torch.device) -> torch.Tensor:
    """found_inf over every device, on ``device`` (one tensor: itself)."""
    tensors = [t.to(device, non_blocking=True) for t in found.values()]
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors).sum()


def _known_normal(scaler: Scaling) -> bool:
    """Whether the host knows the scale is at least 1e-30 (so 1/scale is finite) without a read."""
    mirror = scaler._telemetry.mirror
    return mirror is not None and mirror[0] >= 1e-30


def found_any(found: dict[torch.device, torch.Tensor]) -> bool:
    """Whether found_inf is set on any device (a host read: the step's one sync)."""
    return bool(sum_on(found, next(iter(found))).item())


def unscale(scaler: Scaling, optimizer: torch.optim.Optimizer, with_norm: bool = False,
            funcname: str = "unscale_") -> tuple[FlatGrads | None, torch.Tensor | None]:
    """torch's ``unscale_`` on the device's op (1/scale in float32 where it has no float64), found_inf
    recorded. Returns the arena whose buffers were unscaled (None: the per-tensor path) and, with
    ``with_norm``, the fp32 sum of squares of the unscaled gradients from the same pass. float16
    parameters' gradients are refused, as torch refuses them, unless the optimizer updates float32 masters
    of them (``amp_master_weights``)."""
    scale = scale_of(scaler, funcname)
    record = Record(scaler, optimizer)
    if record.stage is OptState.UNSCALED:
        raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
    if record.stage is OptState.STEPPED:
        raise RuntimeError("unscale_() is being called after step().")
    found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
    norm_sq = torch.zeros((), dtype=torch.float32, device=scale.device) if with_norm else None
    masters = bool(getattr(optimizer, "amp_master_weights", False))
    exact = getattr(optimizer, "unscale_masters_", None)
    if exact is not None:  # float32 masters: the gradients are checked as they are, then divided in float32
        found, _ = scaler._grads.run(optimizer, None, found_inf, True)
        exact(scaler._grads.inv_scale(scale), norm_sq)
        record.unscaled(found)
        return None, norm_sq
    found, arena = scaler._grads.run(optimizer, scale, found_inf, masters, norm_sq, _known_normal(scaler))
    record.unscaled(found)
    return arena, norm_sq


def check(scaler: Scaling, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
    """A read-only check of the gradients (torch's ``_check_inf_per_device``), found_inf recorded."""
    scale = scale_of(scaler, "_check_inf_per_device")
    found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
    found, _ = scaler._grads.run(optimizer, None, found_inf, True)
    Record(scaler, optimizer).checked(found)
    return found


class Plan:
    """What happens around one optimizer's ``step()``. :meth:`before` says whether the step is skipped
    (None: it runs and counts as nothing checked) and with which arguments; :meth:`after` records it.
    The scaler calls ``optimizer.step()`` between them itself (so that torch.compile compiles it as a
    frame of its own), or torch's ``GradScaler.step`` where :attr:`calls_step` is False."""

    #: False where torch's ``GradScaler.step`` runs the optimizer's own protocol (``grad_scaler=``)
    calls_step = True
    #: whether ``grad_scale``/``found_inf`` are set on the optimizer for this step only
    hands_over = False

    def current(self, optimizer: torch.optim.Optimizer) -> Plan:
        """The plan this step follows (a guarded plan may hand over for a step)."""
        return self

    def before(self, scaler: Scaling, optimizer: torch.optim.Optimizer, args: Args,
               kwargs: Kwargs) -> tuple[bool | None, Args, Kwargs]:
        raise NotImplementedError

    def after(self, scaler: Scaling, optimizer: torch.optim.Optimizer, skipped: bool | None) -> None:
        if skipped is None:  # check_finite with no gradient at all: the optimizer ran, nothing was checked
            scaler._telemetry.nothing_stepped()
        else:
            scaler._telemetry.stepped(optimizer, skipped)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"


class Forward(Plan):
    """Scaling off and nothing to check: the optimizer steps."""

    def before(self, scaler: Scaling, optimizer: torch.optim.Optimizer, args: Args,
               kwargs: Kwargs) -> tuple[bool | None, Args, Kwargs]:
        return False, args, kwargs


class CheckOnly(Plan):
    """Scaling off, ``check_finite`` on: the gradients are checked (one host read) before the step."""

    def before(self, scaler: Scaling, optimizer: torch.optim.Optimizer, args: Args,
               kwargs: Kwargs) -> tuple[bool | None, Args, Kwargs]:
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
            return None, (), kwargs
        found, _ = scaler._grads.run(optimizer, None, torch.zeros((), dtype=torch.float32, device=first.device), True)
        return bool(sum_on(found, first.device).item()), (), kwargs


def _ready_to_step(scaler: Scaling, optimizer: torch.optim.Optimizer, kwargs: Kwargs) -> tuple[torch.Tensor, Record]:
    """torch's checks before a scaled step: no closure, a scale, not stepped since the last update."""
    if "closure" in kwargs:
        raise RuntimeError(_CLOSURE)
    scale = scale_of(scaler, "step")
    record = Record(scaler, optimizer)
    if record.stage is OptState.STEPPED:
        raise RuntimeError("step() has already been called since the last update().")
    return scale, record


class Plain(Plan):
    """torch's path for a plain optimizer: unscale (unless done), then skip from the host."""

    def before(self, scaler: Scaling, optimizer: torch.optim.Optimizer, args: Args,
               kwargs: Kwargs) -> tuple[bool | None, Args, Kwargs]:
        _, record = _ready_to_step(scaler, optimizer, kwargs)
        if record.stage is OptState.READY:
            unscale(scaler, optimizer)
        return found_any(record.require_found()), args, kwargs

    def after(self, scaler: Scaling, optimizer: torch.optim.Optimizer, skipped: bool | None) -> None:
        scaler._telemetry.stepped(optimizer, bool(skipped))
        Record(scaler, optimizer).stepped()


class FusedFromHost(Plain):
    """A fused optimizer whose kernel is not trusted with found_inf: checked first, skipped from the
    host with its gradients untouched (as torch's fused protocol leaves a skipped step), else unscaled
    here and stepped on the unscaled gradients."""

    def before(self, scaler: Scaling, optimizer: torch.optim.Optimizer, args: Args,
               kwargs: Kwargs) -> tuple[bool | None, Args, Kwargs]:
        scale, record = _ready_to_step(scaler, optimizer, kwargs)
        if record.stage is OptState.READY:
            check(scaler, optimizer)
            if found_any(record.require_found()):
                return True, args, kwargs
            found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
            found, _ = scaler._grads.run(optimizer, scale, found_inf, True, scale_known_normal=_known_normal(scaler))
            record.unscaled(found)
        return found_any(record.require_found()), args, kwargs


class _OnDevice(Plan):
    """A step whose skip is decided on the device: what it found stays there until someone reads it."""

    def after(self, scaler: Scaling, optimizer: torch.optim.Optimizer, skipped: bool | None) -> None:
        record = Record(scaler, optimizer)
        record.stepped()
        found = record.found
        if found:
            scaler._telemetry.stepped_on_device(optimizer, sum_on(found, next(iter(found))) > 0)
        else:  # no parameter had a gradient: nothing stepped, nothing skipped
            scaler._telemetry.nothing_stepped()


class Fused(_OnDevice):
    """torch's ``grad_scale``/``found_inf`` protocol as torch 2.5+ runs it, on every torch: the kernel
    unscales and skips on the device (after ``unscale_``, a ``grad_scale`` set on the optimizer applies)."""

    hands_over = True

    def before(self, scaler: Scaling, optimizer: torch.optim.Optimizer, args: Args,
               kwargs: Kwargs) -> tuple[bool | None, Args, Kwargs]:
        scale, record = _ready_to_step(scaler, optimizer, kwargs)
        if record.stage is OptState.READY:
            check(scaler, optimizer)
            grad_scale = scale * getattr(optimizer, "grad_scale", 1)
        else:
            grad_scale = getattr(optimizer, "grad_scale", None)
        found = record.found
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]  # torch's fused-optimizer protocol: set on the optimizer
        optimizer.found_inf = sum_on(found, scale.device) if found else torch.zeros_like(scale)  # type: ignore[attr-defined]  # torch's fused-optimizer protocol: set on the optimizer
        return False, args, kwargs



class UnscaledFused(_OnDevice):
    """A fused optimizer whose kernel skips on found_inf but does not divide by ``grad_scale``
    (:data:`~amp_backends.devices.fused.SCALE_BLIND`): the gradients are unscaled first (the scaler's
    ``unscale_``, found_inf recorded), and the kernel gets found_inf with ``grad_scale`` None, which is
    what torch's scaler hands a fused optimizer after ``unscale_``. The skip stays on the device (no
    host read); a skipped step leaves the gradients unscaled, as after ``unscale_``."""

    hands_over = True

    def __init__(self, kernel: fused.FusedKernel) -> None:
        self.kernel = kernel

    def before(self, scaler: Scaling, optimizer: torch.optim.Optimizer, args: Args,
               kwargs: Kwargs) -> tuple[bool | None, Args, Kwargs]:
        scale, record = _ready_to_step(scaler, optimizer, kwargs)
        if getattr(optimizer, "grad_scale", None) is not None:
            raise RuntimeError(
                f"{type(optimizer).__name__}(fused=True) on {scaler.backend.name!r} has a kernel that does not divide "
                f"by grad_scale ({self.kernel.note}), so the grad_scale set on the optimizer would be ignored: "
                "multiply the gradients yourself (after scaler.unscale_(optimizer)) and leave grad_scale unset")
        if record.stage is OptState.READY:
            unscale(scaler, optimizer, funcname="step")
        found = record.found
        optimizer.grad_scale = None  # type: ignore[attr-defined]  # torch's fused-optimizer protocol: set on the optimizer
        optimizer.found_inf = sum_on(found, scale.device) if found else torch.zeros_like(scale)  # type: ignore[attr-defined]  # torch's fused-optimizer protocol: set on the optimizer
        return False, args, kwargs

    def __repr__(self) -> str:
        return f"<UnscaledFused {self.kernel.note!r}>"


class OptimizerOwned(_OnDevice):
    """The optimizer's ``step(grad_scaler=...)`` (torch_mlu's FusedLAMBAMP): torch's protocol hands it
    the scaler, and it unscales, checks and skips itself."""

    calls_step = False

    def before(self, scaler: Scaling, optimizer: torch.optim.Optimizer, args: Args,
               kwargs: Kwargs) -> tuple[bool | None, Args, Kwargs]:
        return False, args, kwargs



class FirstStepsFromHost(Plan):
    """torch's fused SGD with momentum gives a parameter's first momentum buffer with ``empty_like``
    and lets the kernel fill it; a kernel that skips (found_inf) leaves it uninitialised, and the next
    step trains on garbage (torch 2.13; CPU and CUDA kernels, and op-plugin's and torch_musa's, have the
    same early return). Until every parameter has its buffer, such an optimizer is skipped from the host."""

    def __init__(self, trusted: Plan) -> None:
        self.trusted = trusted

    def current(self, optimizer: torch.optim.Optimizer) -> Plan:
        if any(g.get("momentum") for g in optimizer.param_groups) and \
                len(optimizer.state) < sum(len(g["params"]) for g in optimizer.param_groups):
            return FROM_HOST
        return self.trusted


class Refused(Plan):
    """A fused optimizer the device cannot run at all: refused before anything changes."""

    def __init__(self, kernel: fused.FusedKernel) -> None:
        self.kernel = kernel

    def before(self, scaler: Scaling, optimizer: torch.optim.Optimizer, args: Args,
               kwargs: Kwargs) -> tuple[bool | None, Args, Kwargs]:
        raise RuntimeError(f"{type(optimizer).__name__}(fused=True) cannot run on {scaler.backend.name!r} "
                           f"({self.kernel.status}): {self.kernel.note}")


FORWARD, CHECK_ONLY, PLAIN, FROM_HOST = Forward(), CheckOnly(), Plain(), FusedFromHost()
FUSED, OPTIMIZER_OWNED = Fused(), OptimizerOwned()


def choose(scaler: Scaling, optimizer: torch.optim.Optimizer) -> Plan:
    """The plan ``optimizer``'s steps follow under ``scaler``: from whether scaling is on, whether the
    optimizer is fused (``_step_supports_amp_scaling``), and what the device's fused kernel for it does
    with grad_scale and found_inf (declared by the backend, or probed once on the device). A torch
    optimizer running a fused kernel without taking part in the protocol (torch 2.11's
    ``Adagrad(fused=True)`` sets no ``_step_supports_amp_scaling``; 2.13's does) steps as a plain one, as torch's scaler steps it,
    unless the device has no such kernel or refuses it: then it is refused before anything changes."""
    if not scaler._enabled:
        return CHECK_ONLY if scaler._check_finite else FORWARD
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        if fused.runs_fused_kernel(optimizer):  # torch 2.11's Adagrad(fused=True): fused, not handed found_inf
            kernel = fused.kernel_of(scaler.backend, optimizer)
            if kernel.status in (fused.ABSENT, fused.REFUSED):
                return Refused(kernel)
        return PLAIN
    kernel = fused.kernel_of(scaler.backend, optimizer)
    if kernel.status in (fused.ABSENT, fused.REFUSED):
        return Refused(kernel)
    if kernel.status == fused.SCALE_BLIND:
        trusted: Plan = UnscaledFused(kernel)
    elif kernel.status != fused.HONOURS:
        return FROM_HOST
    else:
        trusted = OPTIMIZER_OWNED if "grad_scaler" in inspect.signature(optimizer.step).parameters else FUSED
    return FirstStepsFromHost(trusted) if isinstance(optimizer, torch.optim.SGD) else trusted
