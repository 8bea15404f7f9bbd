"""The generic backend: any accelerator torch reports that no plugin claims, from torch's own APIs.

A device extension that makes ``torch.accelerator.current_accelerator()`` report its device
(torch 2.6+; autoloaded through torch's ``torch.backends`` entry points, or imported) and gives
torch an autocast and an unscale kernel for it trains through this backend with no amp_backends
plugin at all. Everything is asked of torch, nothing assumed:

- autocast dtypes: float16/bfloat16 as ``torch.autocast(device_type, dtype)`` accepts them
  (torch's per-device rule; for a PrivateUse1 device, the module's ``get_amp_supported_dtype``);
  the default is ``torch.get_autocast_dtype(device_type)``;
- the unscale: torch's ``_amp_foreach_non_finite_check_and_unscale_``, run once on the device
  when availability is asked (a device without a kernel for it is unavailable, with torch's error);
- float64: a float64 tensor made and reduced on the device (else the scaler's fp32 path);
- synchronize and memory: the device module's calls, else ``torch.accelerator``'s (2.6+, 2.9+);
- the process-group backend: one that can reduce the device's tensors (torch's default for the
  device type, or one the extension registered); none where none can (never gloo, which reduces
  cpu and cuda tensors only: a group would start and its first collective fail).

It is registered with ``fallback=True``: the registry drops it as soon as any other backend
serves the same device type, so a vendor plugin always wins.
"""

from __future__ import annotations

from typing import Any

import torch

from amp_backends import Backend, hookimpl
from amp_backends.devices.accelerator import (
    ACCELERATOR_API,
    autocast_dtypes,
    current_accelerator_type,
    privateuse1_name,
    process_group_backend,
)
from amp_backends.torch_private import amp_foreach_non_finite_check_and_unscale_

__all__ = ["AcceleratorBackend"]

#: Device types that are never an accelerator. (Any other device type a registered backend serves
#: is left to that backend by the registry, built-in or not.)
_NOT_ACCELERATORS = {"cpu", "meta"}
_LOW = (torch.float16, torch.bfloat16)


class AcceleratorBackend(Backend):
    """Mixed precision on ``device_type`` through torch's device-generic APIs alone."""

    priority = 60  # above cpu; any dedicated backend for the device replaces it outright
    generic = True

    def __init__(self, device_type: str, api_missing: bool = False) -> None:
        self.name = device_type
        self.device_type = device_type
        self._api_missing = api_missing
        self._probed: dict[str, Any] = {}

    # -- availability: asked once per process (amp_backends.reload() asks again) ---------
    def unavailable_reason(self) -> str | None:
        if "reason" not in self._probed:
            self._probed["reason"] = self._find_reason()
        return self._probed["reason"]

    def _find_reason(self) -> str | None:
        dev = self.device_type
        if self._api_missing:
            return (f"torch {torch.__version__} reports the device {dev!r} (PrivateUse1) but has no torch.accelerator: "
                    f"the generic backend needs torch {ACCELERATOR_API}+. Upgrade torch, or install an "
                    f"amp_backends plugin for {dev!r}")
        try:
            count = int(torch.accelerator.device_count())
        except Exception as exc:  # noqa: BLE001 - a broken runtime is a reason, not a crash
            return f"torch.accelerator.device_count() failed for {dev!r}: {type(exc).__name__}: {exc}"
        if count == 0:
            return f"torch reports the accelerator {dev!r} but sees no device (torch.accelerator.device_count() is 0)"
        if not torch.amp.is_autocast_available(dev):
            return (f"torch has no autocast for {dev!r} (torch.amp.is_autocast_available({dev!r}) is False): its "
                    "extension registers none; install an amp_backends plugin for the device")
        if not self._autocast_dtypes_accepted():
            return (f"torch.autocast({dev!r}) accepts neither float16 nor bfloat16 on this device; "
                    "install an amp_backends plugin for the device")
        try:
            grads = [torch.tensor([1.0, 2.0], device=dev)]
            found = torch.zeros((), device=dev)
            amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((), 0.5, device=dev))
            ok = grads[0].cpu().tolist() == [0.5, 1.0] and float(found.item()) == 0.0
        except Exception as exc:  # noqa: BLE001 - any failure of the op is the reason, said
            return (f"torch's unscale op (_amp_foreach_non_finite_check_and_unscale_) has no working kernel on {dev!r}: "
                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        if not ok:
            return f"torch's unscale op gives wrong results on {dev!r} (0.5 * [1, 2] != [0.5, 1])"
        return None

    # -- dtypes ------------------------------------------------------------------------
    def _autocast_dtypes_accepted(self) -> tuple[torch.dtype, ...]:
        """The low dtypes ``torch.autocast(device_type, dtype)`` takes (it warns and disables
        itself for the others)."""
        if "dtypes" not in self._probed:
            self._probed["dtypes"] = autocast_dtypes(self.device_type)
        return self._probed["dtypes"]

    @property
    def default_dtype(self) -> torch.dtype:  # type: ignore[override]  # a class attribute of the contract, a property here
        accepted = self._autocast_dtypes_accepted() if not self._api_missing else ()
        try:
            preferred = torch.get_autocast_dtype(self.device_type)
        except Exception:  # noqa: BLE001 - no autocast for the device at all
            preferred = torch.float16
        if preferred in accepted or not accepted:
            return preferred if preferred in _LOW else torch.float16
        return accepted[0]

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        if not self.is_available():
            return (self.default_dtype,)
        default = self.default_dtype
        return (default, *[d for d in self._autocast_dtypes_accepted() if d != default])

    @property
    def has_fp64(self) -> bool:  # type: ignore[override]  # a class attribute of the contract, a property here
        """Whether the device makes and reduces a float64 tensor (Apple and Intel Arc GPUs do not)."""
        if "fp64" not in self._probed:
            try:
                self._probed["fp64"] = float(torch.ones(2, dtype=torch.float64, device=self.device_type).sum()) == 2.0
            except Exception:  # noqa: BLE001 - a device refusing float64 in any way has none
                self._probed["fp64"] = False
        return self._probed["fp64"]

    dist_install_hint = ("install the device's collective library with its torch.distributed bindings (they "
                         "register a backend with torch.distributed.Backend.register_backend(..., devices=[...]))")

    @property
    def dist_backend(self) -> str:  # type: ignore[override]  # a class attribute of the contract, a property here
        """The process-group backend that can reduce the device's tensors (torch's default for the
        device type, or one an extension registered for it); "" where none can: gloo cannot."""
        return process_group_backend(self.device_type)

    def describe(self) -> str:
        """How ``info`` shows where this backend comes from."""
        return f"generic: torch.accelerator reports {self.device_type!r}; no plugin claims it"


def detect() -> AcceleratorBackend | None:
    """A generic backend for the accelerator torch reports, if any (registered as a fallback)."""
    device_type = current_accelerator_type()
    if device_type is not None:
        return None if device_type in _NOT_ACCELERATORS else AcceleratorBackend(device_type)
    renamed = privateuse1_name()  # torch < 2.6: an extension's device, seen by its name only
    if renamed is not None and not hasattr(torch, "accelerator"):
        return AcceleratorBackend(renamed, api_missing=True)
    return None


@hookimpl
def amp_backends_register_backends(register) -> None:
    backend = detect()
    if backend is not None:
        register(backend, fallback=True)
