"""What a device's fused optimizer kernels do with the scaler's ``grad_scale`` and ``found_inf``.

torch's fused optimizers (``Adam/AdamW/SGD/Adagrad(fused=True)``) take the scale and the overflow
flag and are meant to unscale (divide the gradients by ``grad_scale``) and skip (on ``found_inf``) on
the device. Whether a device's kernel does both is a fact about that device's extension, not about
torch: op-plugin's Ascend ``_fused_adamw_`` accepts both and reads neither; torch_musa refuses fused
Adam and AdamW outright; an older MPS fused Adam asserted both were None; a kernel may skip on
found_inf and never divide by grad_scale, and would then step on gradients multiplied by the loss
scale. A device declares what it knows per kind of optimizer (:attr:`Device.fused_found_inf`), and
what it does not declare is probed once on the device (:func:`probe`); :func:`fused_kernel_of` answers
for one optimizer with a :class:`FusedOptimizerKernel` (a :class:`FusedStatus` and where it is
known from). The scaler hands ``grad_scale`` and ``found_inf`` only to a kernel that honours both,
hands a scale-blind one ``found_inf`` after unscaling its gradients itself, and skips every other
step itself.
"""

from __future__ import annotations

import enum
import inspect
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import first_line
from .contract import EVERY_KIND

if TYPE_CHECKING:
    from .contract import Device

__all__ = ["ABSENT", "HONOURS", "IGNORES", "PROBE_SCALE", "REFUSED", "REJECTS", "SCALE_BLIND", "STATUSES",
           "FusedOptimizerKernel", "FusedStatus", "forget", "fused_kernel_of", "kind_of", "probe", "runs_fused_kernel", "status_of"]


class FusedStatus(str, enum.Enum):
    """What a fused optimizer kernel does with ``grad_scale`` and ``found_inf``. A ``str`` Enum: a
    status declared as a string (``fused_found_inf = {"adam": "honours"}``) is the same status."""

    #: The kernel skips the step when handed found_inf = 1 and divides the gradients by grad_scale
    #: otherwise (torch's own kernels, torch_mlu's).
    HONOURS = "honours"
    #: It takes grad_scale and found_inf and does not read them (op-plugin's ``_fused_adamw_``).
    IGNORES = "ignores"
    #: It refuses to be handed them (raises) but steps without them (an older MPS fused Adam).
    REJECTS = "rejects"
    #: The device has no such fused kernel (torch_musa registers no ``_fused_adagrad_`` and has no CPU fallback).
    ABSENT = "absent"
    #: The extension refuses the fused optimizer itself (torch_musa's fused Adam and AdamW).
    REFUSED = "refused"
    #: It skips the step when handed found_inf = 1 but does not divide the gradients by grad_scale, or is
    #: not known to (op-plugin's ``_fused_sgd_`` hands grad_scale to CANN, whose use of it is not visible):
    #: the scaler unscales the gradients first and hands it found_inf with grad_scale None.
    SCALE_BLIND = "scale_blind"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# The statuses by their module-level names, as plugins and earlier releases spell them: typed ``str``,
# as a device's declarations (``Mapping[str, str | tuple[str, str]]``) hold them.
HONOURS: str = FusedStatus.HONOURS
IGNORES: str = FusedStatus.IGNORES
REJECTS: str = FusedStatus.REJECTS
ABSENT: str = FusedStatus.ABSENT
REFUSED: str = FusedStatus.REFUSED
SCALE_BLIND: str = FusedStatus.SCALE_BLIND
STATUSES = tuple(FusedStatus)


def status_of(value: str) -> FusedStatus:
    """The :class:`FusedStatus` a string names (``"honours"``), or a ValueError listing them."""
    try:
        return FusedStatus(value)
    except ValueError:
        raise ValueError(f"a fused kernel's status is one of {', '.join(STATUSES)}, got {value!r}") from None

_KINDS = ((torch.optim.AdamW, "adamw"), (torch.optim.Adam, "adam"), (torch.optim.SGD, "sgd"),
          (torch.optim.Adagrad, "adagrad"))
#: The grad_scale the probe hands over with found_inf = 0 (a power of two: dividing by it is exact).
PROBE_SCALE = 1024.0
#: The probe's parameter and its (unscaled) gradient: distinct values of both signs, exact in float32
#: when multiplied by :data:`PROBE_SCALE`.
_PARAM = (1.0, -2.0, 0.5, 3.0)
_GRAD = (0.5, -0.25, 1.0, 0.125)


@dataclass(frozen=True)
class FusedOptimizerKernel:
    """What one fused optimizer kernel does on one device, and where that is known from. ``status``
    may be given as its string (``"honours"``); it is kept as the :class:`FusedStatus`."""

    status: FusedStatus
    #: the source (declared) or what the probe saw
    note: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", status_of(self.status))  # frozen: a string given is kept as its member


#: What the probe found, per device, keyed by (optimizer class, defaults): asked once per process.
_PROBED: weakref.WeakKeyDictionary[Any, dict[Any, FusedOptimizerKernel]] = weakref.WeakKeyDictionary()


def fused_kernel_of(device: Device, optimizer: torch.optim.Optimizer) -> FusedOptimizerKernel:
    """What ``optimizer``'s fused kernel does on ``device``: as the device declares it
    (:attr:`~.contract.Device.fused_found_inf`), else probed once on the device (cached per class and
    defaults). An optimizer whose ``step`` takes ``grad_scaler=`` (torch_mlu's FusedLAMBAMP) checks
    found_inf itself; one whose class says what its step does (``amp_found_inf``, a status: a wrapper
    whose step is Python, as amp_backends' master-weight optimizer) is taken at its word."""
    own = getattr(type(optimizer), "amp_found_inf", None)
    if own is not None:
        return FusedOptimizerKernel(own, f"{type(optimizer).__name__} says its step {own} found_inf")
    every = (device.fused_found_inf or {}).get(EVERY_KIND)
    if every is not None:
        status, note = (every, "declared for every kind") if isinstance(every, str) else every
        return FusedOptimizerKernel(status_of(status), f"backend {device.name!r}: {note}")
    if "grad_scaler" in inspect.signature(optimizer.step).parameters:
        return FusedOptimizerKernel(FusedStatus.HONOURS, "its step(grad_scaler=) checks found_inf itself")
    kind = kind_of(optimizer)
    declared = (device.fused_found_inf or {}).get(kind)
    if declared is not None:
        status, note = (declared, "declared") if isinstance(declared, str) else declared
        return FusedOptimizerKernel(status_of(status), f"backend {device.name!r}: {note}")
    try:
        cache = _PROBED.setdefault(device, {})
    except TypeError:  # a device that cannot be weakly referenced: probed each time
        cache = {}
    key = (type(optimizer), repr(sorted(optimizer.defaults.items())))
    if key not in cache:
        cache[key] = probe(optimizer, device.device())
    return cache[key]


def forget(device: Device) -> None:
    """Forget what was probed on ``device`` (``amp_backends.reprobe()``)."""
    _PROBED.pop(device, None)


def kind_of(optimizer: torch.optim.Optimizer) -> str:
    """``"adamw"``, ``"adam"``, ``"sgd"``, ``"adagrad"`` for torch's optimizers (subclasses included),
    else the class's qualified name."""
    for cls, kind in _KINDS:
        if isinstance(optimizer, cls):
            return kind
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def runs_fused_kernel(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of torch's optimizers with ``fused=True`` in a parameter group (it then
    runs a fused kernel whether or not it sets ``_step_supports_amp_scaling``)."""
    return any(isinstance(optimizer, cls) for cls, _ in _KINDS) and \
        any(group.get("fused") for group in optimizer.param_groups)


def probe(optimizer: torch.optim.Optimizer, device: torch.device) -> FusedOptimizerKernel:
    """Step ``optimizer``'s class, with its defaults, on a 4-element parameter on ``device``, twice:

    1. handed ``found_inf = 1`` (and ``grad_scale`` = :data:`PROBE_SCALE`): the parameter unchanged
       means it skips, changed is IGNORES; a step that raises is retried without grad_scale/found_inf:
       REJECTS if that runs, else ABSENT (no kernel on the device) or REFUSED (the extension's own
       refusal, its message kept);
    2. a kernel that skips is handed ``found_inf = 0`` and ``grad_scale`` = :data:`PROBE_SCALE` with the
       gradient multiplied by it, and its parameter and state are compared with the unfused step
       (the same class with ``fused=False, foreach=False``) on the unscaled gradient: equal is HONOURS;
       anything else (a kernel that never divides by grad_scale steps on the scaled gradient) is
       SCALE_BLIND, as is a comparison that cannot be made."""
    where = f"probed on {device}"
    try:
        skipped = _skips(optimizer, device, hand_over=True)
    except Exception as first:  # noqa: BLE001 - a refusal is a finding
        return _without_hand_over(optimizer, device, where, first)
    if not skipped:
        return FusedOptimizerKernel(FusedStatus.IGNORES, f"{where}: it stepped although handed found_inf = 1")
    try:
        fused_run = _stepped(optimizer, device, fused=True)
    except Exception as exc:  # noqa: BLE001 - it skips, but a real step with grad_scale fails
        return _without_hand_over(optimizer, device, where, exc)
    try:
        reference = _stepped(optimizer, device, fused=False)
    except Exception as exc:  # noqa: BLE001 - no unfused step to compare with: grad_scale not trusted
        return FusedOptimizerKernel(FusedStatus.SCALE_BLIND, f"{where}: it skips on found_inf; whether it divides by grad_scale could "
                                        f"not be checked (the unfused step failed: {type(exc).__name__}: "
                                        f"{_first_line(exc)})")
    if _same(fused_run, reference):
        return FusedOptimizerKernel(FusedStatus.HONOURS, f"{where}: it skips on found_inf and divides by grad_scale")
    try:
        blind = _same(fused_run, _stepped(optimizer, device, fused=False, scaled=True))
    except Exception:  # noqa: BLE001 - only the note depends on it
        blind = False
    what = ("steps on the gradient still multiplied by grad_scale" if blind else
            "steps differently from the unfused step on the unscaled gradient")
    return FusedOptimizerKernel(FusedStatus.SCALE_BLIND, f"{where}: it skips on found_inf but, handed grad_scale = {PROBE_SCALE:g}, {what}")


def _probe_param(device: torch.device, scale: float = 1.0) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.tensor(_PARAM, device=device))
    param.grad = torch.tensor(_GRAD, device=device) * scale
    return param


def _skips(optimizer: torch.optim.Optimizer, device: torch.device, hand_over: bool) -> bool:
    """Whether one step handed found_inf = 1 (or nothing, ``hand_over`` False) leaves the parameter."""
    param = _probe_param(device, PROBE_SCALE)
    cls = _probe_class(optimizer)
    opt = cls([param], **_defaults(optimizer, cls))
    if hand_over:
        opt.grad_scale = torch.full((), PROBE_SCALE, device=device)  # type: ignore[attr-defined]  # torch's fused-optimizer protocol: set on the optimizer
        opt.found_inf = torch.ones((), device=device)  # type: ignore[attr-defined]  # torch's fused-optimizer protocol: set on the optimizer
    opt.step()
    return bool(torch.equal(param.detach().cpu(), torch.tensor(_PARAM)))


def _without_hand_over(optimizer: torch.optim.Optimizer, device: torch.device, where: str,
                       first: BaseException) -> FusedOptimizerKernel:
    """A step handed grad_scale/found_inf raised: REJECTS if one without them runs, else why not."""
    try:
        _skips(optimizer, device, hand_over=False)
    except NotImplementedError as exc:
        return FusedOptimizerKernel(FusedStatus.ABSENT, f"{where}: {_first_line(exc)}")
    except Exception as exc:  # noqa: BLE001 - the extension's own refusal, its message kept
        return FusedOptimizerKernel(FusedStatus.REFUSED, f"{where}: {type(exc).__name__}: {_first_line(exc)}")
    return FusedOptimizerKernel(FusedStatus.REJECTS, f"{where}: {type(first).__name__}: {_first_line(first)}")


def _stepped(optimizer: torch.optim.Optimizer, device: torch.device, fused: bool,
             scaled: bool = False) -> list[torch.Tensor]:
    """The parameter and the float state after one step: ``fused``, the optimizer's own class and
    defaults handed found_inf = 0 and grad_scale with the gradient scaled by it; else the unfused
    step (``fused=False, foreach=False`` where the class takes them) on the unscaled gradient, or
    on the scaled one with ``scaled``."""
    param = _probe_param(device, PROBE_SCALE if fused or scaled else 1.0)
    cls = _probe_class(optimizer)
    kwargs = _defaults(optimizer, cls)
    if not fused:
        accepted = inspect.signature(cls.__init__).parameters
        kwargs.update({k: False for k in ("fused", "foreach") if k in accepted})
    opt = cls([param], **kwargs)
    if fused:
        opt.grad_scale = torch.full((), PROBE_SCALE, device=device)  # type: ignore[attr-defined]  # torch's fused-optimizer protocol: set on the optimizer
        opt.found_inf = torch.zeros((), device=device)  # type: ignore[attr-defined]  # torch's fused-optimizer protocol: set on the optimizer
    opt.step()
    state = opt.state[param]
    return [param.detach().cpu().float()] + [state[k].detach().cpu().float() for k in sorted(state)
                                             if torch.is_tensor(state[k]) and state[k].is_floating_point()
                                             and state[k].shape == param.shape]


def _same(run: list[torch.Tensor], reference: list[torch.Tensor]) -> bool:
    """Equal up to the rounding that separates a fused kernel from the unfused loop."""
    return len(run) == len(reference) and all(torch.allclose(a, b, rtol=1e-4, atol=1e-6)
                                               for a, b in zip(run, reference))


def _probe_class(optimizer: torch.optim.Optimizer) -> type[torch.optim.Optimizer]:
    """The class a probe builds: the optimizer's own where its constructor takes ``(params, **defaults)``,
    else torch's class it derives from (a subclass whose constructor needs more: a schedule's name)."""
    own = type(optimizer)
    try:
        inspect.signature(own.__init__).bind(None, [], **_defaults(optimizer, own))
    except TypeError:
        return next((cls for cls, _ in _KINDS if isinstance(optimizer, cls)), own)
    return own


def _defaults(optimizer: torch.optim.Optimizer, cls: type[torch.optim.Optimizer] | None = None) -> dict[str, Any]:
    """The optimizer's defaults as ``cls``'s constructor (default: its own) takes them (torch's AdamW
    keeps a default its constructor does not accept), a tensor lr copied."""
    accepted = inspect.signature((cls or type(optimizer)).__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in optimizer.defaults.items()
            if takes_any or k in accepted}


def _first_line(exc: BaseException) -> str:
    return first_line(exc) or type(exc).__name__


#: Earlier names, answered with a DeprecationWarning until release 0.3.0 removes them: a fused
#: optimizer's kernel read beside the gradient op's ``Kernel`` as if it were the same kind of thing.
_RENAMED = {"FusedKernel": "FusedOptimizerKernel", "kernel_of": "fused_kernel_of"}


def __getattr__(name: str) -> Any:
    new = _RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} is now {new} (the old name goes in 0.3.0): use {new}",
                  DeprecationWarning, stacklevel=2)
    return globals()[new]
