"""``torch_npu.npu.utils`` of the simulated torch_npu."""

from __future__ import annotations

import torch


def is_support_inf_nan() -> bool:
    """True on chips with inf/NaN mode; False in saturation mode (``AMP_SIM_NPU_INF_NAN=0``)."""
    import torch_npu

    return torch_npu.INF_NAN


def npu_check_overflow(grad: object) -> bool:
    """In inf/NaN mode, whether ``grad`` holds inf/NaN; in saturation mode, the status register."""
    import torch_npu

    from . import get_npu_overflow_flag

    if not torch_npu.INF_NAN:
        return get_npu_overflow_flag()
    tensors = grad if isinstance(grad, (list, tuple)) else [grad]
    return any(isinstance(t, torch.Tensor) and not bool(torch.isfinite(t).all()) for t in tensors)
