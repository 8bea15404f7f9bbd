"""Asking a device, bounded in time: availability probes, plugin hooks and kernel self-checks.

A device's driver query can hang; a plugin's hook can hang. Each runs in a daemon thread for at most
:func:`~.environment.probe_timeout` seconds, and an answer that does not come in time is a reason the
device cannot be used, never a hung ``get()``. Availability is asked once per device per process
(:func:`forget` asks again).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..devices import fused
from ..devices.contract import Device
from ..gradients import selfcheck
from ..gradients.kernel import Kernel
from .environment import probe_timeout

__all__ = ["bounded", "forget", "probe", "timed_self_check"]

#: Devices whose probe did not return in time: the reason, so a hang costs its wait once.
_HUNG: dict[int, str] = {}
#: Each device's availability answer, kept for the process (per instance: reload() makes new ones).
_PROBED: weakref.WeakKeyDictionary[Device, str | None] = weakref.WeakKeyDictionary()


def bounded(fn: Callable[[], Any], timeout: float) -> tuple[bool, Any, BaseException | None]:
    """Run ``fn`` in a daemon thread for at most ``timeout`` seconds: (finished, result, exception).
    Whatever it raises (KeyboardInterrupt and SystemExit too) comes back to the caller."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((fn(), None))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out.append((None, exc))

    thread = threading.Thread(target=run, name="amp-backends plugin call", daemon=True)
    thread.start()
    thread.join(timeout)
    if not out:
        return False, None, None
    return True, out[0][0], out[0][1]


def _probe_method(device: Device) -> str:
    """The method a device answers availability with (older plugins implement ``is_available``)."""
    own = type(device).unavailable_reason is not Device.unavailable_reason
    return "unavailable_reason()" if own else "is_available()"


def _ask(device: Device) -> str | None:
    """The device's one probe, checked: a reason, or None; then its autocast dtypes, which every
    caller of ``get()`` uses next (broken means unusable)."""
    cls = type(device).__name__
    asking = _probe_method(device)
    try:
        reason = device.unavailable_reason()
        if isinstance(reason, bool):
            return (f"{cls}.{asking} returned {reason!r}: it returns None where the device can be used, else the "
                    "reason it cannot (a str), not a bool")
        if reason is not None:
            return str(reason) if reason else f"{cls}.{asking} returned an empty reason"
        try:
            torch.device(device.device_type)
        except RuntimeError:
            return (f"{cls}.device_type {device.device_type!r} is not a device type torch knows (did the extension "
                    "call torch.utils.rename_privateuse1_backend, or is it not imported?)")
        asking = "supported_dtypes()"
        dtypes = device.supported_dtypes()
        if not isinstance(dtypes, tuple) or not dtypes or not all(isinstance(d, torch.dtype) for d in dtypes):
            return f"{cls}.supported_dtypes() returned {dtypes!r}, not a non-empty tuple of torch dtypes"
        if device.default_dtype not in dtypes:
            return (f"{cls}.default_dtype is {device.default_dtype} but supported_dtypes() is {dtypes}: the default "
                    "must be one of them (the first)")
        return None
    except Exception as exc:  # noqa: BLE001 - a failing probe is a reason, not a crash
        return f"{cls}.{asking} raised {type(exc).__name__}: {exc}"


def probe(device: Device) -> str | None:
    """Why ``device`` cannot be used, or None when it can: :meth:`Device.unavailable_reason` in a
    daemon thread for at most :func:`probe_timeout` seconds (a hung driver query makes the device
    unavailable, with that reason), asked once per process."""
    hung = _HUNG.get(id(device))
    if hung is not None:
        return hung
    try:
        return _PROBED[device]
    except (KeyError, TypeError):
        pass
    timeout = probe_timeout()
    done, answer, _ = bounded(lambda: _ask(device), timeout)
    if not done:
        _HUNG[id(device)] = (
            f"{type(device).__name__}.{_probe_method(device)} did not return within {timeout:g} s (a hung driver "
            "or device query?); set AMP_BACKENDS_PROBE_TIMEOUT=SECONDS to wait longer"
        )
        return _HUNG[id(device)]
    try:
        _PROBED[device] = answer  # asked once per process: amp_backends.reprobe() asks again
    except TypeError:  # an object that cannot be weakly referenced: not cached
        pass
    return answer


def forget(devices: Iterable[Device]) -> None:
    """Forget every availability answer, and what ``devices`` (and every device asked so far) cached of
    their hardware (:meth:`Device.forget_probes`, the fused kernels probed)."""
    for device in {id(d): d for d in [*_PROBED.keys(), *devices]}.values():
        with contextlib.suppress(Exception):  # a plugin's broken override costs only its own cache
            device.forget_probes()
        fused.forget(device)
    _PROBED.clear()
    _HUNG.clear()


def timed_self_check(kernel: Kernel, device: Device) -> str | None:
    """The kernel self-check on ``device``'s current device, bounded in time like a probe: a kernel
    op that hangs is a problem."""
    timeout = probe_timeout()
    where = device.device()
    module = getattr(torch, where.type, None)
    if where.index is None and where.type != "cpu" and callable(getattr(module, "current_device", None)):
        with contextlib.suppress(Exception):  # the caller's current device (a DDP rank's), not the thread's default
            where = torch.device(where.type, int(module.current_device()))
    use = getattr(module, "device", None) if where.index is not None else None

    def check() -> str | None:
        with use(where.index) if callable(use) else contextlib.nullcontext():
            return selfcheck.kernel_self_check(kernel, where)

    done, problem, error = bounded(check, timeout)
    if not done:
        return f"its ops did not finish within {timeout:g} s"
    if error is not None:
        if not isinstance(error, Exception):
            raise error
        return f"raised {type(error).__name__}: {error}"
    return problem
