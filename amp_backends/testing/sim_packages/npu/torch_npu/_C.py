"""``torch_npu._C`` of the simulated torch_npu: the options torch_npu's ``set_option`` sets and
``_npu_getOption`` reads (bytes, None where never set), and what ``ACL_PRECISION_MODE`` does."""

from __future__ import annotations

import torch

from amp_backends.testing import simdevice

_OPTIONS: dict[str, str] = {}


def _npu_getOption(name: str) -> bytes | None:  # noqa: N802 - torch_npu's name
    value = _OPTIONS.get(name)
    return None if value is None else value.encode()


def _npu_setOption(option: dict[str, str]) -> None:  # noqa: N802
    _OPTIONS.update({k: str(v) for k, v in option.items()})
    _apply_precision_mode()


def _npu_get_soc_version() -> int:  # noqa: N802 - torch_npu's name
    """``c10_npu::GetSocVersion()`` as an int (``csrc/npu/Module.cpp``): the simulated chip's."""
    import torch_npu

    return torch_npu.SOC


def _npu_is_support_inf_nan() -> bool:  # noqa: N802
    import torch_npu

    return torch_npu.INF_NAN


def allow_fp32_to_fp16() -> bool:
    """``IsAllowFP32ToFP16``: the option where set, else the chip's default (allowed below Ascend910B1)."""
    import torch_npu

    value = _OPTIONS.get("ACL_PRECISION_MODE")
    if value == "must_keep_origin_dtype":
        return False
    if value == "allow_fp32_to_fp16":
        return True
    return torch_npu.SOC < torch_npu.SOCS["Ascend910B1"]


def _apply_precision_mode() -> None:
    simdevice.set_fp32_cube_dtype(torch.float16 if allow_fp32_to_fp16() else None)
