"""What torch itself says about the machine's accelerator, on every torch the package supports.

``torch.accelerator`` (torch 2.6+: ``current_accelerator``, ``device_count``, ``synchronize``;
2.9+: ``max_memory_allocated``, ``reset_peak_memory_stats``) names the one accelerator torch
was built or extended for, whatever its device type. These helpers answer with None where the
running torch lacks the call, so a backend can fall back to its device module.
"""

from __future__ import annotations

import warnings

import torch

from ..torch_private import get_privateuse1_backend_name

__all__ = ["ACCELERATOR_API", "autocast_dtypes", "available_accelerator_type", "current_accelerator_type", "memory_call",
           "privateuse1_name", "process_group_backend", "synchronize"]

#: The torch release that added ``torch.accelerator`` (current_accelerator, device_count, synchronize).
ACCELERATOR_API = "2.6"


def current_accelerator_type() -> str | None:
    """The device type torch reports as its accelerator (built in or from an extension), or None:
    none, or a torch without ``torch.accelerator``. A CUDA build reports ``"cuda"`` even on a
    machine without a GPU: availability is the backend's question."""
    api = getattr(torch, "accelerator", None)
    current = getattr(api, "current_accelerator", None)
    if not callable(current):
        return None
    device = current()
    return None if device is None else torch.device(device).type


def privateuse1_name() -> str | None:
    """The name an extension gave PyTorch's PrivateUse1 device (``torch.utils.rename_privateuse1_backend``),
    or None while it keeps its default name."""
    name = get_privateuse1_backend_name()
    return None if name == "privateuseone" else name


def _mine(device_type: str) -> object | None:
    """``torch.accelerator`` when ``device_type`` is the accelerator it speaks for, else None."""
    return torch.accelerator if current_accelerator_type() == device_type else None


def synchronize(device_type: str) -> bool:
    """Wait for the device through ``torch.accelerator``; False where torch cannot (older torch,
    another accelerator)."""
    api = _mine(device_type)
    sync = getattr(api, "synchronize", None)
    if not callable(sync):
        return False
    sync()
    return True


def memory_call(device_type: str, name: str) -> tuple[bool, object]:
    """Call ``torch.accelerator.<name>()`` (a memory statistic) for ``device_type``: (True, result),
    or (False, None) where torch has no such call or the device keeps no allocator statistics
    (torch asserts "Allocator for X is not a DeviceAllocator" for such devices)."""
    fn = getattr(_mine(device_type), name, None)
    if not callable(fn):
        return False, None
    try:
        return True, fn()
    except (RuntimeError, NotImplementedError, AttributeError):
        return False, None


def available_accelerator_type() -> str | None:
    """The accelerator's device type when torch says one is usable here (a device present),
    else None (none, none visible, or torch < 2.6)."""
    api = getattr(torch, "accelerator", None)
    is_available = getattr(api, "is_available", None)
    if not callable(is_available):
        return None
    try:
        return current_accelerator_type() if is_available() else None
    except Exception:  # noqa: BLE001 - a broken runtime: the backends say why
        return None


def autocast_dtypes(device_type: str) -> tuple[torch.dtype, ...]:
    """The low dtypes (float16, bfloat16) ``torch.autocast(device_type, dtype)`` accepts in the
    running torch: torch warns and disables itself for the others, or refuses the device outright."""
    accepted = []
    for dtype in (torch.float16, torch.bfloat16):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                enabled = bool(torch.autocast(device_type, dtype=dtype)._enabled)
            except Exception:  # noqa: BLE001 - refused outright
                enabled = False
        if enabled:
            accepted.append(dtype)
    return tuple(accepted)


def process_group_backend(device_type: str) -> str:
    """The torch.distributed backend that can reduce tensors of ``device_type``: torch's default for
    it where that backend's declared capability includes the device type (gloo reduces cpu and cuda
    tensors only; torch maps mps to gloo all the same), else one an extension registered for it
    (``torch.distributed.Backend.register_backend(..., devices=[...])``); "" where none can."""
    import torch.distributed as dist

    if not dist.is_available():
        return ""
    capability = getattr(dist.Backend, "backend_capability", {})
    name = dist.Backend.default_device_backend_map.get(device_type)
    if name and device_type in capability.get(name, ()):
        return name
    return next((b for b, devices in capability.items() if device_type in devices and b != "fake"), "")
