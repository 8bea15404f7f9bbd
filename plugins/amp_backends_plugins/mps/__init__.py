"""Apple GPU backend (``mps``): autocast as the running torch allows it on mps, no float64, the
scaler where torch has the mps kernels it needs, no process-group backend.

Checked against torch's sources by version: ``torch/backends/mps/__init__.py`` (``is_built``,
``is_available``, ``is_macos_or_newer``); ``torch/amp/autocast_mode.py`` (no mps autocast
before torch 2.5; float16 first, then bfloat16, accepted by ``torch.autocast("mps")``); bf16 on
the GPU needs macOS 14 (torch's ``expectedFailureMPSPre14`` on the bf16 autocast test);
pytorch issue 142397 (the scaler's float64 reciprocal on mps) and PR 150255 (native mps kernels
for ``_amp_foreach_non_finite_check_and_unscale_`` and ``_amp_update_scale_``), after which
Accelerate allows a GradScaler on mps from torch 2.8 (``utils/modeling.py`` ``get_grad_scaler``).
Two device bugs are guarded at run time rather than by version, because a fix reaches users
only with a new torch: unscaling zeroing finite float16/bfloat16 gradients (fixed by PR 184286),
probed once here (those gradients then go through float32 copies); and fused Adam ignoring
``found_inf`` (fixed by PR 186360), or, when fused Adam came to mps, asserting that
``grad_scale`` and ``found_inf`` are None: mps declares no fused kernel, so each kind is probed
once on the device (:mod:`amp_backends.devices.fused`) and a kernel that ignores or refuses found_inf is
skipped from the host.
"""

from __future__ import annotations

import platform
from typing import Any

import torch

from amp_backends import Backend, hookimpl
from amp_backends.devices import autocast_lists
from amp_backends.devices.accelerator import autocast_dtypes
from amp_backends.errors import UnsupportedDtypeError
from amp_backends.torch_private import amp_foreach_non_finite_check_and_unscale_

__all__ = ["MPSBackend", "SCALER_TORCH"]

#: The first torch whose GradScaler runs on mps (native mps kernels for the scaler's ops).
SCALER_TORCH = (2, 8)
#: macOS release from which bf16 runs on the GPU.
BF16_MACOS = (14, 0)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _macos() -> tuple[int, int] | None:
    release = platform.mac_ver()[0]
    if not release:
        return None
    parts = [int(p) for p in release.split(".")[:2] if p.isdigit()]
    return (parts + [0])[0], (parts + [0, 0])[1]


class MPSBackend(Backend):
    """Mixed precision on Apple GPUs through ``torch.autocast("mps")``."""

    name = "mps"
    device_type = "mps"
    dist_backend = ""  # no collective library for mps tensors: train on one GPU
    priority = 100
    has_fp64 = False  # Metal has no float64: the scaler computes 1/scale in float32
    #: torch's hand-written MPS lists (aten/src/ATen/autocast_mode.cpp, MPS block): batch_norm in float32,
    #: nothing banned
    autocast_lists = autocast_lists.MPS

    def __init__(self) -> None:
        self._probed: dict[str, Any] = {}

    def unavailable_reason(self) -> str | None:
        mps = torch.backends.mps
        if not mps.is_built():
            return (f"torch {torch.__version__} is not built with MPS: Apple GPUs need macOS on Apple silicon "
                    "and torch's macOS build (pip install torch)")
        if not mps.is_available():
            macos = "14" if _torch_version() >= (2, 9) else "12.3"  # torch 2.9 dropped macOS 13 and older for MPS
            return (f"torch is built with MPS but no Metal device is available: torch {torch.__version__} needs "
                    f"macOS {macos}+ for MPS, and an Apple-silicon or AMD GPU (not a virtual machine without GPU "
                    "passthrough)")
        if not torch.amp.is_autocast_available("mps"):
            return f"torch {torch.__version__} has no autocast for mps: it needs torch 2.5+ (pip install -U torch)"
        if not self._accepted():
            return f"torch {torch.__version__}'s autocast on mps accepts neither float16 nor bfloat16"
        return None

    def _accepted(self) -> tuple[torch.dtype, ...]:
        """The dtypes torch.autocast("mps") takes in this torch, bf16 only from macOS 14."""
        if "accepted" not in self._probed:
            macos = _macos()
            bf16_ok = macos is not None and macos >= BF16_MACOS
            self._probed["accepted"] = tuple(d for d in autocast_dtypes("mps") if d != torch.bfloat16 or bf16_ok)
        return self._probed["accepted"]

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        if not self.is_available():
            return (torch.float16,)
        default = self.default_dtype
        return (default, *[d for d in self._accepted() if d != default])

    @property
    def default_dtype(self) -> torch.dtype:  # type: ignore[override]  # a class attribute of the contract, a property here
        """float16 where this torch's mps autocast accepts it (and where no mps device is here), else the
        first dtype it accepts."""
        accepted = self._accepted() if self.is_available() else ()
        return torch.float16 if not accepted or torch.float16 in accepted else accepted[0]

    def grad_scaler(self, dtype: torch.dtype | str | None = None, **kwargs: Any) -> torch.amp.GradScaler:
        """The scaler; for float16 on a torch without the mps kernels it needs, a clear error."""
        scaling = self.resolve_dtype(dtype) == torch.float16 and kwargs.get("enabled", True) is not False
        if scaling and _torch_version() < SCALER_TORCH:
            raise UnsupportedDtypeError(
                f"loss scaling on mps needs torch {'.'.join(map(str, SCALER_TORCH))}+ (native mps kernels for the "
                f"scaler's ops, pytorch PR 150255); this is torch {torch.__version__}. Upgrade torch, or train in "
                "bfloat16 (no scaler needed; macOS 14+), or pass enabled=False"
            )
        return super().grad_scaler(dtype, **kwargs)

    # -- device-bug guards, probed once on the device ----------------------------------
    @property
    def unscale_dtypes(self) -> tuple[torch.dtype, ...] | None:  # type: ignore[override]  # a class attribute of the contract, a property here
        """None (every dtype) unless the device's unscale zeroes finite fp16/bf16 gradients
        (pytorch PR 184286): then those go through float32 copies."""
        if "unscale" not in self._probed:
            self._probed["unscale"] = None if not self.is_available() or _unscale_keeps_values("mps") else (
                torch.float32,)
        return self._probed["unscale"]

    def describe(self) -> str | None:
        if not self.is_available():
            return None
        macos = _macos()
        notes = []
        if self.unscale_dtypes is not None:
            notes.append("unscale zeroes fp16/bf16 values here: unscaled through float32")
        where = f"macOS {'.'.join(map(str, macos))}" if macos else "macOS"
        return f"Apple GPU ({platform.machine()}, {where}, no float64)" + (f"; {'; '.join(notes)}" if notes else "")


def _unscale_keeps_values(device: str) -> bool:
    """Whether torch's unscale op on ``device`` gives 0.5 * x for finite fp16 and bf16 x."""
    values = [1.5, -2.0, 6.0e-5, 3.0e4]
    for dtype in (torch.float16, torch.bfloat16):
        try:
            grads = [torch.tensor(values, dtype=dtype, device=device)]
            found = torch.zeros((), device=device)
            amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((), 0.5, device=device))
            expected = (torch.tensor(values, dtype=dtype).float() * 0.5).to(dtype)
            if not torch.equal(grads[0].cpu(), expected) or float(found.item()) != 0.0:
                return False
        except Exception:  # noqa: BLE001 - no kernel for the dtype: the float32 path is the safe one
            return False
    return True


@hookimpl
def amp_backends_register_backends(register) -> None:
    register(MPSBackend())
