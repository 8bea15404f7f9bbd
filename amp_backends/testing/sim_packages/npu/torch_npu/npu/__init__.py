"""``torch_npu.npu`` of the simulated torch_npu: the overflow status of saturation mode."""

from __future__ import annotations

from amp_backends.testing import simdevice

from . import utils  # noqa: F401


def get_npu_overflow_flag() -> bool:
    """Whether an op overflowed since the last clear (saturation mode)."""
    return simdevice.overflow_status()


def clear_npu_overflow_flag() -> None:
    simdevice.clear_overflow_status()
