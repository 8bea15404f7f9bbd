"""The simulated device's autocast policy, on the ``AutocastPrivateUse1`` key: the op lists a device's
autocast runs in the low dtype, in float32, in the widest input dtype, or refuses (CUDA's lists by
default, as torch_mlu, torch_npu and torch_musa reuse them; a simulation may give its device's own)."""

from __future__ import annotations

from typing import Any

import torch

from ..devices.autocast_lists import CUDA
from ..torch_private import DispatchKey, DispatchKeySet, ExcludeDispatchKeyGuard, get_privateuse1_backend_name, tree_leaves, tree_map

__all__ = ["FP32_OPS", "LOWER_PRECISION_OPS", "PROMOTE_OPS", "register_autocast"]

#: CUDA's lists (:data:`amp_backends.devices.autocast_lists.CUDA`, torch's macros, which the vendors'
#: ``autocast_mode.cpp`` files reuse): the ops run in the autocast dtype, in float32, in the widest
#: input dtype.
LOWER_PRECISION_OPS = tuple(sorted(CUDA.lower))
FP32_OPS = tuple(sorted(CUDA.fp32))
PROMOTE_OPS = tuple(sorted(CUDA.promote))


def _prioritize(low: torch.dtype, floats: list[torch.dtype]) -> torch.dtype:
    """torch's ``at::autocast::prioritize`` over the inputs (``autocast_mode.h``): from the autocast
    dtype, float64 ignored, float32 wins; any other mix (float16 with bfloat16) is refused."""
    target = low
    for dtype in floats:
        if dtype == torch.float64:
            continue
        if torch.float32 in (target, dtype):
            target = torch.float32
        elif not target == dtype == low:
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return target


def _autocast_kernel(cast: str, op_name: str) -> Any:
    key = DispatchKeySet(DispatchKey.AutocastPrivateUse1)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        device = get_privateuse1_backend_name()
        low = torch.get_autocast_dtype(device)
        floats = [
            x.dtype for x in tree_leaves((args, kwargs))
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == device
        ]
        if cast == "banned":
            raise RuntimeError(
                f"torch.nn.functional.{op_name.split('.')[0]} and torch.nn.BCELoss are unsafe to autocast "
                f"({device}). Use binary_cross_entropy_with_logits or BCEWithLogitsLoss, which are safe."
            )
        if cast == "lower":
            target = low
        elif cast == "fp32":
            target = torch.float32
        else:
            target = _prioritize(low, floats)

        def convert(x: Any) -> Any:
            if (
                target is not None
                and isinstance(x, torch.Tensor)
                and x.is_floating_point()
                and x.device.type == device
                and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
                and x.dtype != target
            ):
                return x.to(target)
            return x

        args, kwargs = tree_map(convert, (args, kwargs))
        with ExcludeDispatchKeyGuard(key):
            return _OVERLOADS[op_name](*args, **kwargs)

    return kernel


_OVERLOADS: dict[str, Any] = {}


def register_autocast(lib: torch.library.Library, fp32_extra: tuple[str, ...], banned: tuple[str, ...],
                       lists: dict[str, tuple[str, ...]]) -> None:
    fp32 = tuple(n for n in dict.fromkeys(lists.get("fp32", FP32_OPS) + fp32_extra) if n not in banned)
    lower, promote = lists.get("lower", LOWER_PRECISION_OPS), lists.get("promote", PROMOTE_OPS)
    for cast, names in (("lower", lower), ("fp32", fp32), ("promote", promote), ("banned", banned)):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                qualified = f"{name}.{overload}" if overload != "default" else name
                op = getattr(packet, overload)
                if op._schema.returns and all(r.alias_info is None for r in op._schema.returns):
                    _OVERLOADS[qualified] = op
                    lib.impl(qualified, _autocast_kernel(cast, qualified), "AutocastPrivateUse1")


