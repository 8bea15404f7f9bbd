"""Triton gradient kernels: one-pass unscale + inf/NaN check (+ sum of squares), and a
read-only check, each one launch per (device, dtype) group however many tensors.

Importing this plugin does not import Triton; the first kernel call does. The CUDA
backend (and any backend on a device Triton supports) picks it automatically when
Triton is installed (:attr:`TritonKernel.auto_device_types`); ``AMP_BACKENDS_KERNEL=triton`` forces it (on CPU tensors only under
``TRITON_INTERPRET=1``), ``AMP_BACKENDS_KERNEL=torch`` turns it off.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any, Optional

import torch

from amp_backends import Kernel, hookimpl
from amp_backends.gradients.groups import FlatGroup, GradGroup
from amp_backends.gradients.kernel import TORCH_KERNEL

#: Device types Triton compiles for.
TRITON_DEVICE_TYPES = ("cuda", "xpu")
#: Below this many elements in a (device, dtype) group, torch's op is cheaper end to end.
MIN_ELEMENTS = 1 << 22


def check_inputs(device: torch.device, found_inf: torch.Tensor, inv_scale: Optional[torch.Tensor]) -> None:
    """Refuse what torch's op refuses, with its messages: a launch reads ``found_inf`` and ``inv_scale``
    as one float32 each on the gradients' device (a float64 scale would be read as half its bits)."""
    for name, t in (("inv_scale", inv_scale), ("found_inf", found_inf)):
        if t is None:
            continue
        if t.device != device:
            what = (f"{name} must be a {device.type.upper()} tensor." if t.device.type != device.type
                    else f"{name} must be on the gradients' device.")
            raise RuntimeError(f"{what} Got one on {t.device}, the gradients are on {device}: make it on theirs")
        if t.shape.numel() != 1:  # (not Tensor.numel: its calls are counted to catch a pass over the gradients)
            raise RuntimeError(f"{name} must be a 1-element tensor. Got {t.shape.numel()} elements: pass a 0-dim "
                               "tensor")
        if t.dtype != torch.float32:
            raise RuntimeError(f"{name} must be a float tensor. Got {t.dtype}: pass a torch.float32 tensor, "
                               "as torch.amp.GradScaler does")


def one_device(grads: Sequence[torch.Tensor]) -> None:
    """Refuse gradients on several devices, as torch's op does: one launch addresses one device's memory."""
    if len(set(map(torch.Tensor.get_device, grads))) > 1:
        found = ", ".join(sorted(set(str(g.device) for g in grads)))
        raise RuntimeError(f"scaled_grads must be on the same device. Got gradients on {found}: hand each "
                           "device's gradients over as a group of their own")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonKernel(Kernel):
    """Fused gradient ops written in Triton (see ``_kernels.py`` for the launch layout)."""

    name = "triton"
    priority = 10
    one_pass_norm = True
    #: The dtypes the kernels in ``_kernels.py`` compile for (the one declaration: they read it here).
    handles_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    #: Chosen automatically where Triton compiles for the device; on CPU tensors (the interpreter, for
    #: testing) only when forced.
    auto_device_types = TRITON_DEVICE_TYPES

    def __init__(self) -> None:
        self._impl: Any = None
        #: Groups smaller than this (elements) run on torch's op: Triton's Python launcher costs
        #: the host tens of microseconds, more than the kernel saves on small data (measured on
        #: an H100: a 6-gradient MLP step 27% slower through Triton, bench/RESULTS.md). 0 under the interpreter.
        self.min_elements = 0 if _interpreting() else MIN_ELEMENTS

    def _installed(self) -> bool:
        return importlib.util.find_spec("triton") is not None

    def unavailable_reason(self, device_type: str) -> str | None:
        if not self._installed():
            return "Triton is not installed (pip install 'amp-backends[triton]')"
        if device_type == "cpu" and not _interpreting():
            return "Triton runs on CPU tensors only in its interpreter: set TRITON_INTERPRET=1 before starting Python"
        if device_type not in TRITON_DEVICE_TYPES and device_type != "cpu":
            return f"Triton does not compile for device type {device_type!r}"
        return None

    @property
    def impl(self) -> Any:
        if self._impl is None:
            from . import _kernels

            self._impl = _kernels
        return self._impl

    def grad_op_(self, group: GradGroup, found_inf: torch.Tensor, inv_scale: Optional[torch.Tensor] = None,
                 norm_sq: Optional[torch.Tensor] = None) -> None:
        if isinstance(group, FlatGroup):
            self.impl.run_flat(group, found_inf, inv_scale, norm_sq, self.min_elements)
        else:
            self.impl.run(group.tensors, found_inf, inv_scale=inv_scale, write=inv_scale is not None,
                          norm_sq=norm_sq, min_elements=self.min_elements)


@hookimpl
def amp_backends_register_kernels(register) -> None:
    register(TritonKernel())


__all__ = ["TritonKernel", "TORCH_KERNEL", "check_inputs", "one_device"]
