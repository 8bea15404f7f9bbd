"""``torch_npu.npu.utils`` of the simulated torch_npu (torch_npu's ``npu/utils.py``)."""

from __future__ import annotations

import torch


def is_support_inf_nan() -> bool:
    """True on chips with inf/NaN mode; False in saturation mode (``AMP_SIM_NPU_INF_NAN=0``)."""
    import torch_npu

    return torch_npu.INF_NAN


def get_soc_version() -> int:
    """``npu/_backends.py`` ``get_soc_version``: ``c10_npu::SocVersion`` of the chip (Ascend950: 260)."""
    from torch_npu import _C

    return _C._npu_get_soc_version()


def is_bf16_supported() -> bool:
    """Whether the chip runs bf16 (``AMP_SIM_NPU_BF16=0`` for one without)."""
    import torch_npu

    return torch_npu.BF16


def npu_check_overflow(grad: object) -> bool:
    """In inf/NaN mode, whether ``grad`` (a tensor or a float) holds inf/NaN, from the sum of its
    values; in saturation mode the status register, cleared when it was set."""
    from . import clear_npu_overflow_flag, get_npu_overflow_flag

    if is_support_inf_nan():
        if isinstance(grad, float):
            total = grad
        elif isinstance(grad, torch.Tensor):
            total = float(grad.float().sum())
        else:
            raise RuntimeError("Unsupported type.")
        return total != total or total in (float("inf"), -float("inf"))
    overflow = get_npu_overflow_flag()
    if overflow:
        clear_npu_overflow_flag()
    return overflow
