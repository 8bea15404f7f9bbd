"""Which collective library a process group reaches, and what it refuses, asked before training.

:func:`library_of` finds the :class:`~amp_backends.devices.collectives.Collectives` a backend declares
for the library behind a process group; :func:`require_reduce` and :func:`require_gather` raise
:class:`CollectiveError` for a dtype or reduce op that library would refuse at the first collective,
naming the way out. Nothing here runs a collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..backend import Backend
from ..devices.collectives import Collectives, preset
from ..errors import AmpBackendsError

__all__ = ["CollectiveError", "dtype_name", "group_backend_name", "library_of", "require_gather", "require_reduce"]


class CollectiveError(AmpBackendsError, ValueError):
    """A collective the process group's library would refuse, found before training; nothing was changed."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def group_backend_name(group: dist.ProcessGroup | None, device_type: str) -> str:
    """The process-group backend serving ``device_type`` tensors on ``group`` ("gloo", "nccl", "cncl" ...)."""
    name = str(dist.get_backend(group)).lower()
    if ":" not in name:
        return name
    by_device = dict(part.split(":", 1) for part in name.split(",") if ":" in part)  # "cpu:gloo,cuda:nccl"
    return by_device.get(device_type, by_device.get("cpu", name))


def library_of(backend: Backend, group: dist.ProcessGroup | None = None, device_type: str | None = None) -> Collectives:
    """What the library behind ``group`` (the default group where None) reduces, for ``backend``'s device:
    the backend's declaration (:attr:`Device.collectives`) when the group runs the backend's
    ``dist_backend``, else the preset for the group's backend name. Raises :class:`CollectiveError`
    where neither says (an undeclared library, or "hccl", which is two libraries)."""
    if not dist.is_available() or not dist.is_initialized():
        raise CollectiveError("no process group: call amp_backends.distributed.init_process_group() (under torchrun) "
                              "before asking for low-precision communication")
    device_type = device_type or backend.device_type
    name = group_backend_name(group, device_type)
    declared = getattr(backend, "collectives", None)
    if declared is not None and not isinstance(declared, Collectives):
        raise CollectiveError(f"backend {backend.name!r} declares collectives={declared!r}: it must be an "
                              "amp_backends.devices.collectives.Collectives (e.g. one of its presets)")
    found = (declared or preset(name)) if name == str(backend.dist_backend).lower() else preset(name)
    if found is None:
        why = ("'hccl' is both Ascend's and Intel Gaudi's library" if name == "hccl"
               else f"no preset for {name!r} and backend {backend.name!r} declares none")
        raise CollectiveError(
            f"the process group's backend is {name!r}: what its library reduces is not known ({why}); declare it on "
            f"the backend (class attribute collectives = amp_backends.devices.collectives.<preset> or your own "
            f"Collectives(...), from the library's source), or pass the backend whose dist_backend is {name!r}")
    return found


def require_reduce(library: Collectives, dtype: torch.dtype, op: str, what: str, way_out: str) -> None:
    """Raise :class:`CollectiveError` where ``library`` would refuse to reduce ``dtype`` with ``op``."""
    why = library.reduce_refusal(dtype, op)
    if why is not None:
        raise CollectiveError(f"{what}: {why}; {way_out}")


def require_gather(library: Collectives, dtype: torch.dtype, what: str, way_out: str) -> None:
    """Raise :class:`CollectiveError` where ``library`` would refuse to all-gather ``dtype`` tensors."""
    why = library.gather_refusal(dtype)
    if why is not None:
        raise CollectiveError(f"{what}: {why}; {way_out}")
