"""What a device's fused optimizer kernels do with the scaler's ``grad_scale`` and ``found_inf``.

torch's fused optimizers (``Adam/AdamW/SGD(fused=True)``) take the scale and the overflow flag and
are meant to unscale and skip on the device. Whether a device's kernel does is a fact about that
device's extension, not about torch: op-plugin's Ascend ``_fused_adamw_`` accepts both and reads
neither; torch_musa refuses fused Adam and AdamW outright; an older MPS fused Adam asserted both
were None. A device declares what it knows per kind of optimizer (:attr:`Device.fused_found_inf`),
and what it does not declare is probed once on the device (:func:`probe`); :func:`kernel_of` answers
for one optimizer. The scaler hands ``found_inf`` only to a kernel that honours it, and skips every
other step itself.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import first_line

if TYPE_CHECKING:
    from .contract import Device

__all__ = ["ABSENT", "HONOURS", "IGNORES", "REFUSED", "REJECTS", "STATUSES", "FusedKernel", "forget", "kernel_of",
           "kind_of", "probe"]

#: The kernel skips the step when handed found_inf = 1 (torch's own kernels, torch_mlu's).
HONOURS = "honours"
#: It takes grad_scale and found_inf and does not read them (op-plugin's ``_fused_adamw_``).
IGNORES = "ignores"
#: It refuses to be handed them (raises) but steps without them (an older MPS fused Adam).
REJECTS = "rejects"
#: The device has no such fused kernel (op-plugin registers no ``_fused_adam_``).
ABSENT = "absent"
#: The extension refuses the fused optimizer itself (torch_musa's fused Adam and AdamW).
REFUSED = "refused"
STATUSES = (HONOURS, IGNORES, REJECTS, ABSENT, REFUSED)

_KINDS = ((torch.optim.AdamW, "adamw"), (torch.optim.Adam, "adam"), (torch.optim.SGD, "sgd"))


@dataclass(frozen=True)
class FusedKernel:
    """What one fused optimizer kernel does on one device, and where that is known from."""

    status: str
    #: the source (declared) or what the probe saw
    note: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"a fused kernel's status is one of {', '.join(STATUSES)}, got {self.status!r}")


#: What the probe found, per device, keyed by (optimizer class, defaults): asked once per process.
_PROBED: weakref.WeakKeyDictionary[Any, dict[Any, FusedKernel]] = weakref.WeakKeyDictionary()


def kernel_of(device: Device, optimizer: torch.optim.Optimizer) -> FusedKernel:
    """What ``optimizer``'s fused kernel does on ``device``: as the device declares it
    (:attr:`~.contract.Device.fused_found_inf`), else probed once on the device (cached per class and
    defaults). An optimizer whose ``step`` takes ``grad_scaler=`` (torch_mlu's FusedLAMBAMP) checks
    found_inf itself."""
    if not device.fused_steps_honour_found_inf:
        return FusedKernel(IGNORES, f"backend {device.name!r}: fused_steps_honour_found_inf = False")
    if "grad_scaler" in inspect.signature(optimizer.step).parameters:
        return FusedKernel(HONOURS, "its step(grad_scaler=) checks found_inf itself")
    kind = kind_of(optimizer)
    declared = (device.fused_found_inf or {}).get(kind)
    if declared is not None:
        status, note = (declared, "declared") if isinstance(declared, str) else declared
        return FusedKernel(status, f"backend {device.name!r}: {note}")
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
    """``"adamw"``, ``"adam"``, ``"sgd"`` for torch's optimizers (subclasses included), else the
    class's qualified name."""
    for cls, kind in _KINDS:
        if isinstance(optimizer, cls):
            return kind
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def probe(optimizer: torch.optim.Optimizer, device: torch.device) -> FusedKernel:
    """Run one step of ``optimizer``'s class, with its defaults, on a 4-element parameter on
    ``device`` handed ``found_inf = 1``: the parameter unchanged is HONOURS, changed IGNORES; a step
    that raises is retried without grad_scale/found_inf: REJECTS if that runs, else ABSENT (no
    kernel on the device) or REFUSED (the extension's own refusal, its message kept)."""
    def one_step(hand_over: bool) -> bool:
        param = torch.nn.Parameter(torch.ones(4, device=device))
        param.grad = torch.full_like(param, 0.5)
        opt = type(optimizer)([param], **_defaults(optimizer))
        if hand_over:
            opt.grad_scale = torch.ones((), device=device)  # type: ignore[attr-defined]
            opt.found_inf = torch.ones((), device=device)  # type: ignore[attr-defined]
        opt.step()
        return bool(torch.equal(param.detach().cpu(), torch.ones(4)))

    where = f"probed on {device}"
    try:
        return FusedKernel(HONOURS if one_step(True) else IGNORES, where)
    except Exception as first:  # noqa: BLE001 - a refusal is a finding
        try:
            one_step(False)
        except NotImplementedError as exc:
            return FusedKernel(ABSENT, f"{where}: {_first_line(exc)}")
        except Exception as exc:  # noqa: BLE001
            return FusedKernel(REFUSED, f"{where}: {type(exc).__name__}: {_first_line(exc)}")
        return FusedKernel(REJECTS, f"{where}: {type(first).__name__}: {_first_line(first)}")


def _defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults as its constructor takes them (torch's AdamW keeps a default its
    constructor does not accept), a tensor lr copied."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in optimizer.defaults.items()
            if takes_any or k in accepted}


def _first_line(exc: BaseException) -> str:
    return first_line(exc) or type(exc).__name__
