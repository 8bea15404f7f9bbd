"""What a GradScaler counts without waiting for the device: steps, skipped steps, overflows, the
scale (mirrored on the host), gradient norms, and the warning when the scale collapses."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .validation import SMALLEST_SCALE, f32

__all__ = ["ScalerStats", "Signals", "Telemetry"]

#: With fused optimizers the overflow flags stay on the device; on devices without a non-blocking
#: copy to host memory the scale is read (one host sync) this often to notice a collapsing scale.
LOW_SCALE_CHECK_EVERY = 64


@dataclass(frozen=True)
class ScalerStats:
    """Counters of a GradScaler since it was built (not part of its state_dict)."""

    #: ``optimizer.step()`` calls that ran.
    steps: int
    #: optimizer steps skipped because a gradient was inf/NaN.
    skipped: int
    #: ``update()`` calls that found an overflow (the scale backed off).
    overflows: int
    #: the current loss scale (1.0 when scaling is disabled); equals ``get_scale()``.
    scale: float
    #: index (0-based) of the last ``update()`` that found an overflow, or None.
    last_overflow_step: int | None
    #: ``update()`` calls so far.
    updates: int
    #: the total norm of the unscaled gradients the last ``clip_grad_norm_`` computed (a device
    #: tensor, read without a sync: ``.item()`` when you want the number), or None
    grad_norm: torch.Tensor | None = None
    #: per parameter group, the norms before clipping, where ``clip_grad_norm_(per_group=True)`` asked
    group_grad_norms: tuple[torch.Tensor, ...] | None = None


class Telemetry:
    """The host-side record of one scaler. ``step_flags`` holds, per optimizer, whether this
    iteration's step was skipped (None: only the device knows, after a fused step)."""

    def __init__(self, init_scale: float) -> None:
        self.step_flags: dict[int, bool | None] = {}
        self.steps = self.skipped = self.overflows = self.updates = 0
        self.last_overflow: int | None = None
        self.last_skipped: bool | torch.Tensor = False
        self.device_counts: dict[str, torch.Tensor] = {}
        #: the scale and growth tracker as the device holds them, while the host can know them
        self.mirror: tuple[float, int] | None = (f32(init_scale), 0)
        self.warned_low_scale = False
        #: the scale's last non-blocking copy to host memory, and the event that says it arrived
        self.scale_copy: tuple[torch.Tensor, Any] | None = None
        self.grad_norm: torch.Tensor | None = None
        self.group_grad_norms: tuple[torch.Tensor, ...] | None = None

    def for_pickling(self, enabled: bool, init_scale: float, tracker: int) -> Telemetry:
        """A copy without device state (pending copies, norms): counters survive a pickle."""
        copy = Telemetry.__new__(Telemetry)
        copy.__dict__.update(self.__dict__)
        copy.scale_copy = None
        copy.grad_norm = copy.group_grad_norms = None
        copy.mirror = (f32(init_scale), tracker) if enabled else None
        return copy

    # -- steps ----------------------------------------------------------------------------
    def stepped(self, optimizer: Any, skipped: bool) -> None:
        self.step_flags[id(optimizer)] = skipped
        self.last_skipped = skipped
        self.steps += 1
        self.skipped += skipped

    def stepped_on_device(self, optimizer: Any, flag: torch.Tensor) -> None:
        """A fused optimizer skipped (or not) on the device: the flag stays there until read."""
        self.step_flags[id(optimizer)] = None
        self.last_skipped = flag
        self.steps += 1
        self._count_on_device("skipped", flag)

    def nothing_stepped(self) -> None:
        self.last_skipped = False

    # -- updates --------------------------------------------------------------------------
    def updated_disabled(self) -> None:
        """``update()`` of a scaler with scaling off: a step refused by check_finite counts as an overflow."""
        if any(self.step_flags.values()):
            self.overflows += 1
            self.last_overflow = self.updates
        self.step_flags = {}
        self.updates += 1

    def updated(self, overflow: bool | torch.Tensor, factors: tuple[float, float, int] | None,
                scale: torch.Tensor) -> None:
        """One dynamic (or static: ``factors`` None) update; ``overflow`` a host bool or a device flag."""
        index = self.updates
        if isinstance(overflow, torch.Tensor):
            self.mirror = None
            self._count_on_device("overflows", overflow)
            last = self.device_counts.get("last_overflow", torch.full((), -1, dtype=torch.int64, device=scale.device))
            self.device_counts["last_overflow"] = torch.where(overflow, torch.full_like(last, index), last)
            self._watch_scale(scale, index)
        else:
            if overflow:
                self.overflows += 1
                self.last_overflow = index
            if self.mirror is not None and factors is not None:
                self._advance_mirror(overflow, *factors)
        self.step_flags = {}
        self.updates += 1

    def scale_set(self, value: float | torch.Tensor) -> None:
        """``update(new_scale)``: the mirror follows a number, not a tensor (it would need a read)."""
        tracker = self.mirror[1] if self.mirror is not None else None
        self.mirror = None if isinstance(value, torch.Tensor) or tracker is None else (f32(value), tracker)

    def _advance_mirror(self, overflow: bool, growth: float, backoff: float, interval: int) -> None:
        value, tracker = self.mirror  # type: ignore[misc]  # called only while the mirror is set
        if overflow:
            value, tracker = max(f32(value * backoff), SMALLEST_SCALE), 0
        elif tracker + 1 == interval:
            grown = f32(value * growth)
            value, tracker = (grown if math.isfinite(grown) else value), 0
        else:
            tracker += 1
        self.mirror = (value, tracker)
        self.warn_if_low(value)

    def _count_on_device(self, key: str, flag: torch.Tensor) -> None:
        count = self.device_counts.get(key)
        self.device_counts[key] = flag.to(torch.int64) if count is None else count + flag

    def _watch_scale(self, scale: torch.Tensor, index: int) -> None:
        """With the overflow flags on the device (fused optimizers), notice a collapsing scale
        without a host sync: each update starts a non-blocking copy of the scale to host memory,
        and the next update reads it if it has arrived (CPU and CUDA; within one update of the
        collapse). Other devices read the scale every ``LOW_SCALE_CHECK_EVERY`` updates."""
        if scale.device.type not in ("cpu", "cuda"):
            if (index + 1) % LOW_SCALE_CHECK_EVERY == 0:
                self.warn_if_low(float(scale.item()))
            return
        pending = self.scale_copy
        if pending is not None and not self.warned_low_scale:
            host, event = pending
            if event is None or event.query():
                self.warn_if_low(float(host.numpy().reshape(-1)[0]))  # host memory: no device sync
        if self.warned_low_scale:
            self.scale_copy = None
            return
        host = torch.empty((), dtype=torch.float32, pin_memory=scale.is_cuda)
        host.copy_(scale.detach().reshape(()), non_blocking=True)
        event = None
        if scale.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self.scale_copy = (host, event)

    def warn_if_low(self, value: float) -> None:
        if value < 1.0 and not self.warned_low_scale:
            self.warned_low_scale = True
            warnings.warn(
                f"GradScaler: the loss scale fell to {value:g} after {self.stats_overflows()} overflows: the "
                "gradients overflow float16 even unscaled. Scales below 1 may still train (the scaler keeps "
                "backing off), but if they do not, the loss or the model itself produces inf/NaN (a learning "
                "rate too high, log/div of zero, bf16-pretrained weights that overflow float16): "
                "amp_backends.check_model(model, inputs, dtype=torch.float16) measures every scale and names the "
                "first op, or train in bfloat16.",
                RuntimeWarning,
                stacklevel=5,
            )

    # -- reading --------------------------------------------------------------------------
    def stats_overflows(self) -> int:
        flag = self.device_counts.get("overflows")
        return self.overflows + (int(flag.item()) if flag is not None else 0)

    def stats(self, scale: float) -> ScalerStats:
        counts = {k: int(v.item()) for k, v in self.device_counts.items()}
        skipped = self.skipped + counts.get("skipped", 0)
        last = max(self.last_overflow if self.last_overflow is not None else -1, counts.get("last_overflow", -1))
        return ScalerStats(
            steps=self.steps - skipped,
            skipped=skipped,
            overflows=self.overflows + counts.get("overflows", 0),
            scale=scale,
            last_overflow_step=None if last < 0 else last,
            updates=self.updates,
            grad_norm=self.grad_norm,
            group_grad_norms=self.group_grad_norms,
        )


class Signals(torch.amp.GradScaler):
    """What :class:`~.scaler.GradScaler` tells of its counters: the skip signal and the stats."""

    _telemetry: Telemetry

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent ``step()`` skipped ``optimizer.step()`` (inf/NaN gradients).

        Known without a device sync after the usual path; after a fused optimizer's
        step, reading it waits for the device.
        """
        skipped = self._telemetry.last_skipped
        return bool(skipped.item()) if isinstance(skipped, torch.Tensor) else skipped

    @property
    def stats(self) -> ScalerStats:
        """Steps, skipped steps, overflows, scale and last overflow; read without a device
        sync except after fused-optimizer steps, whose counters live on the device."""
        tel = self._telemetry
        if not self._enabled:
            scale = 1.0
        elif self._scale is None:
            scale = self._init_scale  # what get_scale() says before the first scale()
        elif tel.mirror is not None:
            scale = tel.mirror[0]
        else:
            scale = self.get_scale()
        return tel.stats(scale)
