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
from typing import Any, Optional

import torch

from amp_backends import Kernel, hookimpl
from amp_backends.gradients.groups import FlatGroup, GradGroup
from amp_backends.gradients.kernel import TORCH_KERNEL

#: Device types Triton compiles for.
TRITON_DEVICE_TYPES = ("cuda", "xpu")
#: Below this many elements in a (device, dtype) group, torch's op is cheaper end to end.
MIN_ELEMENTS = 1 << 22


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
        #: an H100: a 6-gradient MLP step 14% slower through Triton). 0 under the interpreter.
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


__all__ = ["TritonKernel", "TORCH_KERNEL"]
