"""Argument and state validation for the GradScaler: every number it takes, checked as strictly as
torch's scaler checks it or more, with the way out named; a malformed state_dict changes nothing."""

from __future__ import annotations

import math
import numbers
import struct
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import StateDictError

__all__ = ["SMALLEST_SCALE", "as_float", "check_factors", "check_new_scale", "check_process_group", "clip_args",
           "f32", "flag", "validate_state_dict"]

_STATE_KEYS: dict[str, type] = {
    "scale": float,
    "growth_factor": float,
    "backoff_factor": float,
    "growth_interval": int,
    "_growth_tracker": int,
}
_INT32_MAX = 2**31 - 1
#: The smallest scale the scaler backs off to: its float32 reciprocal (2**126) is finite, so an unscale
#: never multiplies the gradients by inf (torch's backs off to 0 and its unscale then writes inf).
SMALLEST_SCALE = 2.0**-126


def f32(x: float) -> float:
    """Round a Python float to float32, as the device's scale tensor stores it (inf if too large)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def flag(name: str, value: Any) -> bool:
    """``value`` as a bool: True, False, 1 or 0 (a string such as "false" is refused)."""
    if isinstance(value, bool) or (isinstance(value, numbers.Integral) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def as_float(x: Any) -> float:
    """``float(x)``, with integers too large for a float as the infinity they stand for."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _real(x: Any) -> float:
    """``x`` as a float if it is a real number (not a bool), else NaN."""
    return as_float(x) if isinstance(x, numbers.Real) and not isinstance(x, bool) else math.nan


def scalar_arg(value: Any) -> Any:
    """A one-element real tensor as the Python number it holds (torch's scaler takes ``init_scale``
    as a tensor); anything else as it is, for the checks that follow to judge."""
    if (isinstance(value, torch.Tensor) and value.numel() == 1
            and (value.is_floating_point() or (not value.is_complex() and value.dtype != torch.bool))):
        return value.item()
    return value


def clip_args(max_norm: Any, norm_type: Any) -> tuple[float, float]:
    """``max_norm`` a number >= 0 (inf: measure, do not clip), ``norm_type`` a number > 0 or inf."""
    norm, kind = _real(max_norm), _real(norm_type)
    if not norm >= 0:  # NaN fails too
        raise ValueError(f"max_norm must be a number >= 0 (inf measures without clipping), got {max_norm!r}")
    if not kind > 0:
        raise ValueError(f"norm_type must be a number > 0 or inf (2.0: the Euclidean norm), got {norm_type!r}")
    return norm, kind


def check_process_group(group: Any) -> None:
    """None, ``"world"`` or a ``torch.distributed.ProcessGroup``; anything else fails at the first
    step, after the gradients were unscaled, so it is refused here."""
    if group is None or group == "world":
        return
    import torch.distributed as dist

    pg = getattr(dist, "ProcessGroup", None)
    if pg is not None and isinstance(group, pg):
        return
    raise TypeError(
        f"process_group must be None, 'world' (the default group) or a torch.distributed.ProcessGroup "
        f"(dist.new_group(...)), got {type(group).__name__} {group!r}"
    )


def check_new_scale(new_scale: Any, device: torch.device) -> float | torch.Tensor:
    """``update(new_scale)``'s argument: a positive finite number, or a one-element float tensor."""
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad or not new_scale.is_floating_point():
            raise ValueError(
                "new_scale must be a positive number or a one-element floating-point tensor that "
                f"does not require grad, got a tensor of shape {tuple(new_scale.shape)} and dtype {new_scale.dtype}"
            )
        value = float(new_scale.detach().float().reshape(()).item())  # one host read, on an explicit call only
        if not (math.isfinite(value) and value > 0 and math.isfinite(f32(value)) and f32(value) > 0
                and math.isfinite(f32(1.0 / f32(value)))):
            raise ValueError(f"new_scale must be finite and > 0, with a finite reciprocal (as a float32: at least "
                             f"2**-126 is safe), got a tensor holding {value!r}: an inf, NaN, zero, negative or tiny "
                             "scale would skip or corrupt every later step")
        return new_scale.detach().reshape(()).to(device=device, dtype=torch.float32)
    check_factors(new_scale, 2.0, 0.5, 1, ValueError, what="new_scale")
    return float(new_scale)


def check_factors(
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    error: Callable[[str], Exception],
    what: str = "scale",
) -> None:
    """The scaler's four numbers, as torch's update op needs them (raises ``error(message)``)."""
    def number(x: Any) -> bool:
        return math.isfinite(_real(x))

    if not number(init_scale) or not float(init_scale) > 0:
        raise error(f"{what} must be a finite number > 0, got {init_scale!r}")
    stored = f32(float(init_scale))
    if not (math.isfinite(stored) and stored > 0):
        raise error(f"{what} {init_scale!r} does not fit a float32 (the scale tensor's dtype): it would be {stored!r}")
    if not math.isfinite(f32(1.0 / stored)):
        raise error(f"{what} {init_scale!r} is so small that its reciprocal overflows float32, so the unscaled "
                    "gradients would be inf: use a scale of at least 2**-126")
    if not number(growth_factor) or not float(growth_factor) > 1.0:
        raise error(f"growth_factor must be a finite number > 1.0, got {growth_factor!r}")
    if not number(backoff_factor) or not 0.0 < float(backoff_factor) < 1.0:
        raise error(f"backoff_factor must be a number in (0, 1), got {backoff_factor!r}")
    if (
        not isinstance(growth_interval, numbers.Integral)
        or isinstance(growth_interval, bool)
        or not 1 <= growth_interval <= _INT32_MAX
    ):
        raise error(f"growth_interval must be an integer in [1, 2**31-1], got {growth_interval!r}")


def validate_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Check a scaler state_dict and return its values as Python numbers."""
    if not isinstance(state_dict, Mapping):
        raise StateDictError(f"a GradScaler state_dict must be a dict, got {type(state_dict).__name__}")
    if len(state_dict) == 0:
        raise StateDictError(
            "the GradScaler state_dict is empty: it was saved from a disabled scaler (bf16 or "
            "enabled=False). Build this scaler with enabled=False, or load a checkpoint saved with scaling."
        )
    missing = [k for k in _STATE_KEYS if k not in state_dict]
    if missing:
        raise StateDictError(
            f"GradScaler state_dict is missing {', '.join(missing)}; expected keys: {', '.join(_STATE_KEYS)}"
        )
    values: dict[str, Any] = {}
    for key, kind in _STATE_KEYS.items():
        value = state_dict[key]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        ok = isinstance(value, numbers.Integral if kind is int else numbers.Real) and not isinstance(value, bool)
        if not ok:
            raise StateDictError(
                f"GradScaler state_dict[{key!r}] must be {'an int' if kind is int else 'a number'}, "
                f"got {type(value).__name__} {value!r}"
            )
        try:
            values[key] = kind(value)
        except OverflowError:
            raise StateDictError(f"GradScaler state_dict[{key!r}] = {value!r} does not fit a float") from None
    tracker = values["_growth_tracker"]
    if not 0 <= tracker <= _INT32_MAX:
        raise StateDictError(
            f"GradScaler state_dict['_growth_tracker'] must be in [0, 2**31-1] (an int32), got {tracker}"
        )
    check_factors(
        values["scale"], values["growth_factor"], values["backoff_factor"], values["growth_interval"],
        lambda msg: StateDictError(f"GradScaler state_dict: {msg}"),
    )
    if "dynamic" in state_dict:  # torch_npu's key
        dynamic = state_dict["dynamic"]
        if not isinstance(dynamic, bool):
            raise StateDictError(f"GradScaler state_dict['dynamic'] must be True or False, got {type(dynamic).__name__} "
                                 f"{dynamic!r}")
        values["dynamic"] = dynamic
    if tracker >= values["growth_interval"]:  # saved after set_growth_interval shortened it (torch's setter allows it)
        warnings.warn(
            f"GradScaler state_dict['_growth_tracker'] is {tracker}, not below growth_interval "
            f"({values['growth_interval']}): loaded as {values['growth_interval'] - 1}, so the next clean step "
            "grows the scale (as saved, it would never grow again)", RuntimeWarning, stacklevel=3)
        values["_growth_tracker"] = values["growth_interval"] - 1
    return values
