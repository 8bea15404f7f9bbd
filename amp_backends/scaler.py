"""Device-generic dynamic loss scaling on the backend's unscale op.

Behaves like ``torch.amp.GradScaler`` (same state_dict, same update op, same results)
and adds: ``last_step_skipped`` for gating LR schedulers, ``stats`` without extra host
synchronisation, ``clip_grad_norm_`` that unscales, checks and measures the norm in one
pass, ``check_finite`` for unscaled (bf16) training, and validated checkpoints.

Host synchronisation: ``step()`` reads ``found_inf`` once (``.item()``) to decide whether
to call ``optimizer.step()``; nothing else in a training step waits for the device. With
an optimizer that unscales itself (``fused=True``), ``found_inf`` is handed to the
optimizer and ``step()`` does not synchronise at all.
"""

from __future__ import annotations

import math
import numbers
import struct
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from .backend import group_by_device_and_dtype
from .errors import StateDictError

if TYPE_CHECKING:
    from .backend import Backend

__all__ = ["GradScaler", "ScalerStats"]

_STATE_KEYS: dict[str, type] = {
    "scale": float,
    "growth_factor": float,
    "backoff_factor": float,
    "growth_interval": int,
    "_growth_tracker": int,
}


class _Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass(frozen=True)
class ScalerStats:
    """Counters of a GradScaler since it was built (not part of its state_dict)."""

    #: ``optimizer.step()`` calls that ran.
    steps: int
    #: optimizer steps skipped because a gradient was inf/NaN.
    skipped: int
    #: ``update()`` calls that found an overflow (the scale backed off).
    overflows: int
    #: the current loss scale (1.0 when scaling is disabled).
    scale: float
    #: index (0-based) of the last ``update()`` that found an overflow, or None.
    last_overflow_step: int | None
    #: ``update()`` calls so far.
    updates: int


def _f32(x: float) -> float:
    """Round a Python float to float32, as the device's scale tensor stores it."""
    return struct.unpack("f", struct.pack("f", x))[0]


class _OptimizerState:
    __slots__ = ("stage", "found_inf", "found_host", "grad_scale")

    def __init__(self) -> None:
        self.stage = _Stage.READY
        self.found_inf: dict[torch.device, torch.Tensor] = {}
        self.found_host: bool | None = None
        self.grad_scale: torch.Tensor | None = None


class GradScaler:
    """Dynamic loss scaler whose unscale runs on ``backend.unscale_and_check_``.

    Args:
        backend: a backend name (``"cpu"``, ``"cuda"``, ...), a Backend, or None for the best available.
        init_scale, growth_factor, backoff_factor, growth_interval: as ``torch.amp.GradScaler``.
        enabled: False makes ``scale``/``unscale_``/``update`` no-ops (bf16 training).
        check_finite: when scaling is disabled, still skip a step whose gradients hold inf/NaN.
        process_group: all-reduce found_inf over this group (or the default group for ``"world"``)
            so that ranks holding different gradients (FSDP, sharding) skip the same steps.
    """

    def __init__(
        self,
        backend: str | Backend | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        check_finite: bool = False,
        process_group: Any = None,
    ) -> None:
        from .registry import get

        self.backend: Backend = get(backend) if backend is None or isinstance(backend, str) else backend
        self._enabled = bool(enabled)
        self._check_finite = bool(check_finite)
        self._process_group = process_group
        _check_factors(init_scale, growth_factor, backoff_factor, growth_interval, ValueError)
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._init_growth_tracker = 0
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._scale_copies: dict[torch.device, torch.Tensor] = {}
        self._states: dict[int, _OptimizerState] = {}
        # host-side bookkeeping for stats, kept without reading the device
        self._steps = 0
        self._skipped = 0
        self._overflows = 0
        self._updates = 0
        self._last_overflow: int | None = None
        self._last_skipped: bool | torch.Tensor = False
        self._device_counts: dict[str, torch.Tensor] = {}
        self._mirror: tuple[float, int] | None = (self._init_scale, 0)
        self._warned_low_scale = False

    # -- helpers ----------------------------------------------------------------------
    def _state(self, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        return self._states.setdefault(id(optimizer), _OptimizerState())

    def _require_scale(self, what: str) -> torch.Tensor:
        if self._scale is None:
            raise RuntimeError(
                f"GradScaler.{what}() called before scale(): call scaler.scale(loss).backward() "
                "earlier in the iteration."
            )
        return self._scale

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        if self._scale is None:
            self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
            self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)
            self._scale_copies = {}
        if device == self._scale.device:
            return self._scale
        copy = self._scale_copies.get(device)
        if copy is None:
            copy = self._scale_copies[device] = self._scale.to(device, non_blocking=True)
        return copy

    @staticmethod
    def _grads(optimizer: torch.optim.Optimizer, allow_fp16: bool) -> list[torch.Tensor]:
        grads = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError(
                        "Attempting to unscale FP16 gradients: the parameters themselves are "
                        "float16. Keep parameters in float32 and let autocast lower the "
                        "compute, or use bf16 without a scaler."
                    )
                if grad.is_sparse:
                    if grad.dtype is torch.float16:
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                grads.append(grad)
        return grads

    def _found_inf_buffers(self, grads: list[torch.Tensor]) -> dict[torch.device, torch.Tensor]:
        return {
            device: torch.zeros((), dtype=torch.float32, device=device)
            for device in dict.fromkeys(g.device for g in grads)
        }

    def _all_reduce(self, found: dict[torch.device, torch.Tensor]) -> None:
        if self._process_group is None:
            return
        import torch.distributed as dist

        group = None if self._process_group == "world" else self._process_group
        for tensor in found.values():
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)

    def _unscale_grads(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor | None,
        allow_fp16: bool,
        norm_sq: torch.Tensor | None = None,
    ) -> dict[torch.device, torch.Tensor]:
        """Run the backend's op on every gradient, per device and dtype.

        ``inv_scale`` None means a read-only check; ``norm_sq`` (on the scale's device)
        also accumulates the sum of squares of the (unscaled) gradients.
        """
        with torch.no_grad():
            grads = self._grads(optimizer, allow_fp16)
            found = self._found_inf_buffers(grads)
            inv: dict[torch.device, torch.Tensor] = {}
            partial: dict[torch.device, torch.Tensor] = {}
            for (device, _), group in group_by_device_and_dtype(grads).items():
                if norm_sq is not None and device not in partial:
                    partial[device] = norm_sq if device == norm_sq.device else torch.zeros_like(norm_sq, device=device)
                if inv_scale is None:
                    if norm_sq is None:
                        self.backend.check_(group, found[device])
                    else:
                        self.backend.check_norm_(group, found[device], partial[device])
                    continue
                if device not in inv:
                    inv[device] = inv_scale.to(device, non_blocking=True)
                if norm_sq is None:
                    self.backend.unscale_and_check_(group, found[device], inv[device])
                else:
                    self.backend.unscale_check_norm_(group, found[device], inv[device], partial[device])
            for value in partial.values():
                if value is not norm_sq:
                    assert norm_sq is not None
                    norm_sq.add_(value.to(norm_sq.device))
            self._all_reduce(found)
        return found

    def _inv_scale(self) -> torch.Tensor:
        return self._require_scale("unscale_").double().reciprocal().float()

    # -- public API -------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or nested lists/tuples of tensors, by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return outputs * self._scale_on(outputs.device)

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value * self._scale_on(value.device)
            if isinstance(value, (list, tuple)):
                return type(value)(apply(v) for v in value)
            if isinstance(value, Iterable):
                return map(apply, value)
            raise ValueError(f"scale() takes a tensor or an iterable of tensors, got {type(value).__name__}")

        return apply(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale and record inf/NaN (no host sync)."""
        if not self._enabled:
            return
        state = self._state(optimizer)
        self._check_stage(state, "unscale_")
        state.found_inf = self._unscale_grads(optimizer, self._inv_scale(), allow_fp16=False)
        state.stage = _Stage.UNSCALED

    def clip_grad_norm_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        """Unscale (if not done yet) and clip the optimizer's gradients to ``max_norm``.

        Returns the total norm of the unscaled gradients (a device tensor; inf/NaN when
        the step will be skipped). For the 2-norm on gradients not yet unscaled, one pass
        unscales, checks and sums squares; the clip multiply is then folded into a fused
        optimizer's own unscale, or done as one more pass otherwise.
        """
        max_norm = float(max_norm)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        state = self._state(optimizer)
        if not self._enabled or state.stage is not _Stage.READY or float(norm_type) != 2.0:
            if self._enabled and state.stage is _Stage.READY:
                self.unscale_(optimizer)
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        self._check_stage(state, "clip_grad_norm_")
        scale = self._require_scale("clip_grad_norm_")
        norm_sq = torch.zeros((), dtype=torch.float32, device=scale.device)
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        if fused:
            # read-only pass: check and sum squares of the still-scaled gradients
            state.found_inf = self._unscale_grads(optimizer, None, True, norm_sq)
            total = norm_sq.sqrt() * self._inv_scale()
        else:
            state.found_inf = self._unscale_grads(optimizer, self._inv_scale(), False, norm_sq)
            total = norm_sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if fused:
            state.grad_scale = scale / coef
        elif params:
            grads = [p.grad for p in params]
            for (device, _), group in group_by_device_and_dtype(grads).items():
                torch._foreach_mul_(group, coef.to(device))
        state.stage = _Stage.UNSCALED
        return total

    def _check_stage(self, state: _OptimizerState, what: str) -> None:
        if state.stage is _Stage.UNSCALED:
            raise RuntimeError(
                f"{what}() has already been called on this optimizer since the last update(); "
                "gradients are unscaled once per optimizer per step."
            )
        if state.stage is _Stage.STEPPED:
            raise RuntimeError(f"{what}() is being called after step(); call update() first.")

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, then run ``optimizer.step()`` unless a gradient was inf/NaN.

        Returns what ``optimizer.step`` returns; ``last_step_skipped`` tells whether it ran.
        """
        if "closure" in kwargs:
            raise RuntimeError("closure is not supported with GradScaler: run the closure before step().")
        if not self._enabled:
            return self._step_unscaled(optimizer, *args, **kwargs)
        scale = self._require_scale("step")
        state = self._state(optimizer)
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        self._steps += 1
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if state.stage is _Stage.READY:
                state.found_inf = self._unscale_grads(optimizer, None, allow_fp16=True)
                grad_scale = scale * getattr(optimizer, "grad_scale", 1)
            else:
                grad_scale = state.grad_scale  # None when unscale_() already ran
            found = self._total(state.found_inf, scale.device)
            optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
            optimizer.found_inf = found  # type: ignore[attr-defined]
            try:
                result = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
            state.stage = _Stage.STEPPED
            self._last_skipped = found > 0
            self._count_on_device("skipped", self._last_skipped)
            return result
        if state.stage is _Stage.READY:
            self.unscale_(optimizer)
        skipped = bool(self._total(state.found_inf, scale.device).item())  # the one host sync
        state.found_host = skipped
        state.stage = _Stage.STEPPED
        self._last_skipped = skipped
        if skipped:
            self._skipped += 1
            return None
        return optimizer.step(*args, **kwargs)

    def _step_unscaled(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self._steps += 1
        if self._check_finite:
            state = self._state(optimizer)
            found = self._unscale_grads(optimizer, None, allow_fp16=True)
            skipped = bool(found) and bool(self._total(found, next(iter(found))).item())
            state.found_host = skipped
            self._last_skipped = skipped
            if skipped:
                self._skipped += 1
                return None
        else:
            self._last_skipped = False
        return optimizer.step(*args, **kwargs)

    @staticmethod
    def _total(found: dict[torch.device, torch.Tensor], device: torch.device) -> torch.Tensor:
        if not found:
            raise RuntimeError("no inf checks were recorded for this optimizer: do its parameters have gradients?")
        tensors = [t.to(device, non_blocking=True) for t in found.values()]
        return tensors[0] if len(tensors) == 1 else torch.stack(tensors).sum()

    def _count_on_device(self, key: str, flag: torch.Tensor) -> None:
        count = self._device_counts.get(key)
        self._device_counts[key] = flag.to(torch.int64) if count is None else count + flag

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back the scale off after an overflow, grow it after ``growth_interval`` clean steps."""
        states = list(self._states.values())
        index = self._updates
        if not self._enabled:
            self._states = {}
            self._updates += 1
            if any(s.found_host for s in states):
                self._overflows += 1
                self._last_overflow = index
            return
        scale = self._require_scale("update")
        tracker = self._growth_tracker
        assert tracker is not None
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1 or new_scale.requires_grad:
                    raise ValueError("new_scale must be a float or a one-element tensor that does not require grad")
                scale.copy_(new_scale.reshape(()))
                self._mirror = None
            else:
                scale.fill_(float(new_scale))
                if self._mirror is not None:
                    self._mirror = (_f32(float(new_scale)), self._mirror[1])
            self._scale_copies = {}
            self._states = {}
            self._updates += 1
            return
        found = [t for s in states for t in s.found_inf.values()]
        if not found:
            raise RuntimeError("update() found no inf checks: call scaler.step(optimizer) before update().")
        self._states = {}
        self._updates += 1
        combined = found[0].to(scale.device, non_blocking=True)
        for extra in found[1:]:
            combined = combined + extra.to(scale.device, non_blocking=True)
        torch._amp_update_scale_(
            scale, tracker, combined, self._growth_factor, self._backoff_factor, self._growth_interval
        )
        self._scale_copies = {}
        known = [s.found_host for s in states]
        if all(k is not None for k in known):
            self._record_update(any(known), index)
        else:
            self._mirror = None
            flag = combined > 0
            self._count_on_device("overflows", flag)
            last = self._device_counts.get("last_overflow", torch.full((), -1, dtype=torch.int64, device=flag.device))
            self._device_counts["last_overflow"] = torch.where(flag, torch.full_like(last, index), last)

    def _record_update(self, overflow: bool, index: int) -> None:
        if overflow:
            self._overflows += 1
            self._last_overflow = index
        if self._mirror is None:
            return
        value, tracker = self._mirror
        if overflow:
            value, tracker = _f32(value * self._backoff_factor), 0
        elif tracker + 1 == self._growth_interval:
            grown = _f32(value * self._growth_factor)
            value, tracker = (grown if math.isfinite(grown) else value), 0
        else:
            tracker += 1
        self._mirror = (value, tracker)
        if value < 1.0 and not self._warned_low_scale:
            self._warned_low_scale = True
            warnings.warn(
                f"GradScaler: the loss scale fell to {value:g} after {self._overflows} overflows. "
                "Scaling cannot fix gradients that are inf/NaN at any scale: the loss or the model "
                "itself is producing NaN/inf (a learning rate too high, log/div of zero, or bf16-"
                "pretrained weights that overflow float16; try bfloat16).",
                RuntimeWarning,
                stacklevel=3,
            )

    # -- signals and stats ------------------------------------------------------------
    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent ``step()`` skipped ``optimizer.step()`` (inf/NaN gradients).

        Known without a device sync after the usual path; after a fused optimizer's
        step, reading it waits for the device.
        """
        flag = self._last_skipped
        return bool(flag.item()) if isinstance(flag, torch.Tensor) else flag

    @property
    def stats(self) -> ScalerStats:
        """Steps, skipped steps, overflows, scale and last overflow; read without a device
        sync except after fused-optimizer steps, whose counters live on the device."""
        device_skipped = self._device_counts.get("skipped")
        device_overflows = self._device_counts.get("overflows")
        skipped = self._skipped + (int(device_skipped.item()) if device_skipped is not None else 0)
        overflows = self._overflows + (int(device_overflows.item()) if device_overflows is not None else 0)
        last = self._last_overflow
        if "last_overflow" in self._device_counts:
            device_last = int(self._device_counts["last_overflow"].item())
            last = max(last if last is not None else -1, device_last)
            last = None if last < 0 else last
        if not self._enabled:
            scale = 1.0
        elif self._mirror is not None:
            scale = self._mirror[0]
        else:
            scale = self.get_scale()
        return ScalerStats(
            steps=self._steps - skipped,
            skipped=skipped,
            overflows=overflows,
            scale=scale,
            last_overflow_step=last,
            updates=self._updates,
        )

    # -- getters, setters and state ---------------------------------------------------
    def get_scale(self) -> float:
        """The current scale as a Python float (a device sync); 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def is_enabled(self) -> bool:
        """Whether the scaler scales (False for bf16 or ``enabled=False``)."""
        return self._enabled

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        _check_factors(1.0, new_factor, 0.5, 1, ValueError)
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        _check_factors(1.0, 2.0, new_factor, 1, ValueError)
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        _check_factors(1.0, 2.0, 0.5, new_interval, ValueError)
        self._growth_interval = int(new_interval)

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, with the keys and values of ``torch.amp.GradScaler``'s."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state_dict from this scaler or ``torch.amp.GradScaler``; a malformed one
        raises StateDictError and changes nothing."""
        if not self._enabled:
            return
        values = validate_state_dict(state_dict)
        self._init_scale = values["scale"]
        self._growth_factor = values["growth_factor"]
        self._backoff_factor = values["backoff_factor"]
        self._growth_interval = values["growth_interval"]
        self._init_growth_tracker = values["_growth_tracker"]
        if self._scale is not None:
            self._scale.fill_(values["scale"])
            assert self._growth_tracker is not None
            self._growth_tracker.fill_(values["_growth_tracker"])
        self._scale_copies = {}
        self._mirror = (_f32(values["scale"]), values["_growth_tracker"])

    def __repr__(self) -> str:
        return f"<GradScaler backend={self.backend.name!r} enabled={self._enabled}>"


def _check_factors(
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    error: Callable[[str], Exception],
) -> None:
    def number(x: Any) -> bool:
        return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(float(x))

    if not number(init_scale) or not float(init_scale) > 0:
        raise error(f"scale must be a finite number > 0, got {init_scale!r}")
    if not number(growth_factor) or not float(growth_factor) > 1.0:
        raise error(f"growth_factor must be a finite number > 1.0, got {growth_factor!r}")
    if not number(backoff_factor) or not 0.0 < float(backoff_factor) < 1.0:
        raise error(f"backoff_factor must be a number in (0, 1), got {backoff_factor!r}")
    if not isinstance(growth_interval, numbers.Integral) or isinstance(growth_interval, bool) or growth_interval < 1:
        raise error(f"growth_interval must be an integer >= 1, got {growth_interval!r}")


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
        values[key] = kind(value)
    if values["_growth_tracker"] < 0:
        raise StateDictError(f"GradScaler state_dict['_growth_tracker'] must be >= 0, got {values['_growth_tracker']}")
    _check_factors(
        values["scale"], values["growth_factor"], values["backoff_factor"], values["growth_interval"],
        lambda msg: StateDictError(f"GradScaler state_dict: {msg}"),
    )
    return values
