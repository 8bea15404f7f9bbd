"""Which kernel a device's gradient ops run on: the one forced by ``AMP_BACKENDS_KERNEL``, else the
highest-priority registered kernel that selects itself for the device type and passes its self-check
on the device, else torch's."""

from __future__ import annotations

import warnings

from ..devices.contract import Device
from ..devices.old_contract import KERNEL_METHODS, KERNEL_SPELLINGS, deprecations, refusal
from ..errors import BackendUnavailableError, DuplicateBackendError
from ..gradients.kernel import TORCH_KERNEL, Kernel, selects_itself
from .environment import forced_kernel
from .probing import probe, timed_self_check
from .records import PluginRecord

__all__ = ["KernelChoice"]


class KernelChoice:
    """The kernels plugins registered, and the choice for each device (settled once per device)."""

    def __init__(self) -> None:
        self.kernels: dict[str, tuple[Kernel, PluginRecord]] = {}
        #: (kernel name, device type) -> why the kernel was not adopted there
        self.rejections: dict[tuple[str, str], str] = {}

    def add(self, record: PluginRecord, kernel: Kernel) -> None:
        """A plugin's ``register(kernel)``: the older spellings it uses are warned about
        (DeprecationWarning, pointing at the plugin's call) and honoured."""
        if not isinstance(kernel, Kernel):
            raise TypeError(f"register() takes an amp_backends.Kernel instance, got {type(kernel).__name__}: "
                            "subclass amp_backends.Kernel and register an instance of it")
        old = refusal(kernel, KERNEL_METHODS, "kernel")
        if old is not None:
            raise TypeError(old)
        for message in deprecations(kernel, Kernel, KERNEL_SPELLINGS):
            warnings.warn(message, DeprecationWarning, stacklevel=3)
        key = kernel.name.lower()
        if key == TORCH_KERNEL.name or key in self.kernels:
            owner = "amp-backends" if key == TORCH_KERNEL.name else self.kernels[key][1].package
            raise DuplicateBackendError(f"kernel name {key!r} is already registered by {owner}")
        self.kernels[key] = (kernel, record)
        record.kernels.append(key)

    def drop(self, record: PluginRecord) -> None:
        for key in [k for k, (_, rec) in self.kernels.items() if rec is record]:
            del self.kernels[key]

    def by_name(self) -> dict[str, Kernel]:
        return {TORCH_KERNEL.name: TORCH_KERNEL, **{k: v for k, (v, _) in self.kernels.items()}}

    def for_device(self, device: Device) -> Kernel:
        """The kernel ``device`` runs its gradient ops on: pinned on it by hand, else chosen now and
        kept on the device."""
        pinned = device.__dict__.get("_kernel")
        if pinned is not None:
            return pinned
        kernel = self._choose(device)
        device._kernel = kernel  # type: ignore[attr-defined]  # the chosen kernel kept on the device
        return kernel

    def _choose(self, device: Device) -> Kernel:
        device_type = device.device_type
        forced = forced_kernel()
        if forced is not None:
            kernels = self.by_name()
            if forced not in kernels:
                raise BackendUnavailableError(
                    f"AMP_BACKENDS_KERNEL={forced!r} names no registered kernel; "
                    f"known: {', '.join(sorted(kernels))}. Unset it to choose automatically."
                )
            kernel = kernels[forced]
            try:
                reason = kernel.unavailable_reason(device_type)
            except Exception as exc:  # noqa: BLE001 - said with the variable that chose it
                reason = f"its unavailable_reason() raised {type(exc).__name__}: {exc}"
            if reason is None and kernel is not TORCH_KERNEL:
                problem = timed_self_check(kernel, device)
                reason = None if problem is None else f"it failed its self-check ({problem})"
            if reason is not None:
                raise BackendUnavailableError(
                    f"AMP_BACKENDS_KERNEL={forced!r} cannot run on {device_type!r}: {reason}. "
                    "Unset it, or set it to 'torch'."
                )
            return kernel
        for kernel, record in sorted(self.kernels.values(), key=lambda kr: -kr[0].priority):
            try:
                if not selects_itself(kernel, device_type):
                    continue
            except Exception as exc:  # noqa: BLE001 - a broken kernel falls back to torch's, said once
                key = (kernel.name, device_type)
                if key not in self.rejections:
                    self.rejections[key] = (f"kernel {kernel.name!r} from {record.package} raised {type(exc).__name__} "
                                            f"when asked whether it runs on {device_type} ({exc}); torch's kernel is "
                                            "used instead")
                    warnings.warn(self.rejections[key], RuntimeWarning, stacklevel=5)
                continue
            if probe(device) is not None:
                return kernel  # no device to check it on; the backend cannot run gradient ops anyway
            if self._self_check(kernel, record, device) is None:
                return kernel
        return TORCH_KERNEL

    def _self_check(self, kernel: Kernel, record: PluginRecord, device: Device) -> str | None:
        """Run the kernel's op on small tensors of the device against torch's: a kernel that raises,
        misses an inf/NaN, writes when it should only read, or gets a value wrong is not adopted (the
        reason is kept for ``info``)."""
        key = (kernel.name, device.device_type)
        if key in self.rejections:
            return self.rejections[key]
        problem = timed_self_check(kernel, device)
        if problem is None:
            return None
        message = (f"kernel {kernel.name!r} from {record.package} failed its self-check on {device.device_type} "
                   f"({problem}); torch's kernel is used instead")
        self.rejections[key] = message
        warnings.warn(message, RuntimeWarning, stacklevel=5)
        return message

    def rejections_for(self, device_type: str) -> list[str]:
        """Why kernels were not adopted for ``device_type`` (failed self-checks)."""
        return [m for (_, dev), m in self.rejections.items() if dev == device_type]
