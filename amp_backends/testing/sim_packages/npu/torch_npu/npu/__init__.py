"""``torch_npu.npu`` of the simulated torch_npu: the overflow-status functions of saturation mode.

As in torch_npu's ``npu/utils.py``: ``get_npu_overflow_flag()`` raises and
``clear_npu_overflow_flag()`` warns and does nothing on chips with inf/NaN mode, where no
status register is used.
"""

from __future__ import annotations

import warnings

from amp_backends.testing import simdevice

from . import amp, utils  # noqa: F401 - torch_npu.npu exposes them
from .utils import is_bf16_supported, is_support_inf_nan, npu_check_overflow  # noqa: F401 - torch_npu.npu exposes them


_OPTION_VALUES = {"ACL_PRECISION_MODE": ["allow_fp32_to_fp16", "must_keep_origin_dtype"]}


def set_option(option: dict) -> None:
    """``npu/npu_config.py`` ``set_option``: a dict of options, known values checked."""
    from torch_npu import _C

    if not isinstance(option, dict):
        raise TypeError("npu option must be a dict.")
    for name, value in option.items():
        allowed = _OPTION_VALUES.get(name)
        if allowed is not None and str(value) not in allowed:
            raise ValueError(f"value of {name} should be in {allowed} but got {value}")
    _C._npu_setOption({k: str(v) for k, v in option.items()})


def get_npu_overflow_flag() -> bool:
    """Whether an op overflowed since the last clear (saturation mode only)."""
    if is_support_inf_nan():
        raise RuntimeError("Unsupported api when soc_version >= Ascend910B1, please use npu_check_overflow")
    return simdevice.overflow_status()


def clear_npu_overflow_flag() -> None:
    """Reset the status (saturation mode); on chips with inf/NaN mode a warning and nothing else."""
    if is_support_inf_nan():
        warnings.warn("When soc_version >= Ascend910B1, clear_npu_overflow_flag is useless, please remove it.")
        return
    simdevice.clear_overflow_status()
