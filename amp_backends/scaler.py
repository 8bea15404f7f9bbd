"""``torch.amp.GradScaler`` whose unscale and inf/NaN checks run on the backend's ops.

:class:`GradScaler` subclasses torch's scaler the way torch's own ``ShardedGradScaler``
does: stages, per-device caching, the update op, the fused-optimizer protocols
(``grad_scale``/``found_inf`` attributes and ``step(grad_scaler=...)``), pickling and the
state_dict are torch's. It overrides only where the backend must act:

- ``_unscale_grads_``: the unscale + inf/NaN check, through ``backend.unscale_and_check_``;
- ``_check_inf_per_device``: the read-only check before a fused optimizer's step, through
  ``backend.check_`` (torch runs a dummy unscale by 1.0 there);

and adds what torch lacks: ``last_step_skipped``, ``stats``, ``clip_grad_norm_``,
``check_finite`` for unscaled (bf16) training, validated ``load_state_dict``, a warning
when the scale collapses, and ``process_group`` to agree on found_inf across ranks.
"""

from __future__ import annotations

import inspect
import math
import numbers
import struct
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from .arena import FlatGrads, flat_grads_of
from .backend import group_by_device_and_dtype, provide
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
_INT32_MAX = 2**31 - 1
_FP16_PARAMS = (
    "Attempting to unscale FP16 gradients: the parameters themselves are float16. Keep parameters "
    "in float32 and let autocast lower the compute, or use bf16 without a scaler."
)
#: With fused optimizers the overflow flags stay on the device; the scale is read (one
#: host sync) this often to notice a collapsing scale.
_LOW_SCALE_CHECK_EVERY = 64


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


def _f32(x: float) -> float:
    """Round a Python float to float32, as the device's scale tensor stores it (inf if too large)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool) or (isinstance(value, numbers.Integral) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def _sum_on(found: Mapping[torch.device, torch.Tensor], device: torch.device) -> torch.Tensor:
    tensors = [t.to(device, non_blocking=True) for t in found.values()]
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors).sum()


class GradScaler(torch.amp.GradScaler):
    """Dynamic loss scaler (a ``torch.amp.GradScaler``) whose gradient ops are the backend's.

    Args:
        backend: a backend name (``"cpu"``, ``"cuda"``, ...), a Backend, a ``torch.device``,
            or None for the best available (or the one serving ``device``).
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as torch's.
        device: a device type, as torch spells it (``GradScaler(device="cuda")``); picks the
            backend serving that device type when ``backend`` is None.
        check_finite: when scaling is disabled, still skip a step whose gradients hold inf/NaN.
        process_group: all-reduce found_inf over this group (``"world"``: the default group)
            so that ranks holding different gradients (ZeRO, hand-made shards) skip the same
            steps. FSDP2's DTensor gradients need none: torch's op reduces over their mesh.
        dynamic: False for static loss scaling (torch_npu's ``dynamic=False``): the scale stays
            ``init_scale``; steps with inf/NaN gradients are still skipped (torch_npu's static
            mode checks nothing and always steps; docs/backends/npu.md says why this differs).
    """

    #: whether this iteration's first scale() ran the backend's on_scale hook
    _iteration_open = False
    #: a device-wide overflow status seen this iteration (shared by every optimizer of it)
    _status_overflow = False
    #: the scale's last non-blocking copy to host memory, and the event that says it arrived
    _scale_copy: tuple[torch.Tensor, Any] | None = None

    def __init__(
        self,
        backend: str | Backend | torch.device | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        device: str | torch.device | None = None,
        check_finite: bool = False,
        process_group: Any = None,
        dynamic: bool = True,
    ) -> None:
        from .registry import resolve_backend

        enabled = _flag("enabled", enabled)
        self._check_finite = _flag("check_finite", check_finite)
        self._dynamic = _flag("dynamic", dynamic)
        _check_factors(init_scale, growth_factor, backoff_factor, growth_interval, ValueError)
        _check_process_group(process_group)
        self.backend: Backend = resolve_backend(backend, device)
        self._process_group = process_group
        self._grad_norm: torch.Tensor | None = None
        self._group_grad_norms: tuple[torch.Tensor, ...] | None = None
        super().__init__(
            self.backend.device_type,
            init_scale=float(init_scale),
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            growth_interval=int(growth_interval),
            enabled=enabled,
        )
        if not self._enabled:  # torch keeps no factors when disabled; the getters still answer
            self._init_scale, self._growth_factor = float(init_scale), float(growth_factor)
            self._backoff_factor, self._growth_interval = float(backoff_factor), int(growth_interval)
            self._init_growth_tracker = 0
        # host-side bookkeeping for stats and signals, kept without reading the device
        self._host_found: dict[int, bool] = {}
        self._steps = 0
        self._skipped = 0
        self._overflows = 0
        self._updates = 0
        self._last_overflow: int | None = None
        self._last_skipped: bool | torch.Tensor = False
        self._device_counts: dict[str, torch.Tensor] = {}
        self._mirror: tuple[float, int] | None = (_f32(float(init_scale)), 0)
        #: the arena whose buffers the last gradient op ran on (None: the per-tensor path)
        self._arena: FlatGrads | None = None
        self._warned_low_scale = False

    # -- where the backend acts ---------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """torch's ``scale``; the first call of an iteration (after construction or ``update()``)
        runs the backend's :meth:`~amp_backends.Backend.on_scale` hook first, which clears a
        device-wide overflow status before any backward of the iteration (torch_npu clears it
        there, once: later micro-batches' ``scale()`` must not wipe an earlier overflow)."""
        if (self._enabled or self._check_finite) and not self._iteration_open:
            self._iteration_open = True
            self.backend.on_scale(self)
        return super().scale(outputs)

    def _inv_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """1/scale as torch computes it (in float64), or in float32 where the device has no float64."""
        return scale.double().reciprocal().float() if self.backend.has_fp64 else scale.reciprocal()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """torch's ``unscale_``; on a device without float64, 1/scale is computed in float32."""
        if not self._enabled or self.backend.has_fp64:
            return super().unscale_(optimizer)
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, self._inv_scale(scale), found_inf, False)
        state["stage"] = OptState.UNSCALED

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        return self._grad_op(optimizer, inv_scale, found_inf, allow_fp16)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._grad_op(optimizer, None, found_inf, True)
        return state["found_inf_per_device"]

    def _grad_op(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor | None,
        found_inf: torch.Tensor,
        allow_fp16: bool,
        norm_sq: torch.Tensor | None = None,
    ) -> dict[torch.device, torch.Tensor]:
        """The backend's op per (device, dtype) group of the optimizer's gradients: on the
        buffers of its :func:`~amp_backends.flat_grads` arena when the gradients are there,
        else after one walk over the gradients.

        ``inv_scale`` None is a read-only check; ``norm_sq`` (on ``found_inf``'s device) also
        receives the fp32 sum of squares of the (unscaled) gradients. Returns found_inf per device.
        """
        arena = flat_grads_of(optimizer)
        self._arena = arena if arena is not None and arena.attached() else None
        if self._arena is not None and not self._arena.has_gradients():
            return {}  # torch's path finds no gradient either: its step raises, as torch's does
        be = self.backend
        found: dict[torch.device, torch.Tensor] = {}
        partials: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            if self._arena is not None:
                if not allow_fp16 and any(flat.dtype == torch.float16 for flat in self._arena.groups):
                    raise ValueError(_FP16_PARAMS)  # before any buffer is touched: a refusal changes nothing
                for flat in self._arena.groups:
                    inv, partial = self._per_device(flat.device, found, partials, found_inf, inv_scale, norm_sq)
                    be._run_flat(flat, found[flat.device], inv, partial)
            else:
                for (device, dtype), grads in self._walk(optimizer, allow_fp16, norm_sq is not None).items():
                    inv, partial = self._per_device(device, found, partials, found_inf, inv_scale, norm_sq)
                    be._run_group(dtype, grads, found[device], inv, partial)
            if norm_sq is not None:
                for partial in partials.values():
                    norm_sq.add_(partial.to(norm_sq.device))
            if be.global_overflow_status and found:
                self._share_status(found)  # (a clip's norm is made inf by _inf_when_scale_underflowed)
            elif self._process_group is not None:
                import torch.distributed as dist

                pg = self._named_group()
                for tensor in found.values():
                    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=pg)
        return found

    def _share_status(self, found: dict[torch.device, torch.Tensor]) -> None:
        """A device-wide overflow status holds for the whole iteration, as torch_npu's
        ``_has_overflow`` does: reading it resets the register, so what one optimizer's op read is
        kept for every later optimizer of the iteration, and agreed on across ranks (the status is
        set only on the rank whose backward saturated; after DDP's all-reduce the others hold
        finite saturated gradients and a clear status). The status read is a host read already,
        so agreeing costs no extra device sync."""
        overflow = self._status_overflow or any(bool(t.item()) for t in found.values())
        group = self._status_group()
        if group is not False:
            import torch.distributed as dist

            where = "cpu" if dist.get_backend(group) == "gloo" else next(iter(found))
            flag = torch.tensor(float(overflow), device=where)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            overflow = bool(flag.item())
        self._status_overflow = overflow
        if overflow:
            for t in found.values():
                t.fill_(1.0)

    def _named_group(self) -> Any:
        """The ``process_group`` given, as torch.distributed takes it (``"world"``: None)."""
        return None if self._process_group == "world" else self._process_group

    def _status_group(self) -> Any:
        """The process group a device-wide overflow status is agreed over: the scaler's
        ``process_group``, else the default group when one is initialised (torch_npu's rule),
        else False (one process)."""
        if self._process_group is not None:
            return self._named_group()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return None
        return False

    @staticmethod
    def _per_device(
        device: torch.device,
        found: dict[torch.device, torch.Tensor],
        partials: dict[torch.device, torch.Tensor],
        found_inf: torch.Tensor,
        inv_scale: torch.Tensor | None,
        norm_sq: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """found_inf (and the norm's partial sum) for ``device``, made on first use; inv_scale there."""
        if device not in found:
            # the caller's found_inf serves its own device (it is fresh for this call); copies elsewhere
            found[device] = found_inf if found_inf.device == device else found_inf.to(device, copy=True)
            if norm_sq is not None:
                partials[device] = torch.zeros((), dtype=torch.float32, device=device)
        if inv_scale is None or inv_scale.device == device:
            return inv_scale, partials.get(device)
        return inv_scale.to(device, non_blocking=True), partials.get(device)

    @staticmethod
    def _walk(
        optimizer: torch.optim.Optimizer, allow_fp16: bool, for_norm: bool
    ) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
        """The one walk over the gradients, grouped by device then dtype in order of appearance."""
        groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                dtype = grad.dtype
                if dtype is torch.float16 and not allow_fp16:
                    raise ValueError(_FP16_PARAMS)
                if grad.is_sparse:
                    # coalesce where duplicates matter: fp16 sums may overflow, norms count each index once
                    if dtype is torch.float16 or for_norm:
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                device = grad.device
                by_dtype = groups.get(device)
                if by_dtype is None:
                    by_dtype = groups[device] = {}
                bucket = by_dtype.get(dtype)
                if bucket is None:
                    by_dtype[dtype] = bucket = []
                bucket.append(grad)
        return {(d, t): grads for d, by_dtype in groups.items() for t, grads in by_dtype.items()}

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scale is None or self._growth_tracker is None:
            raise RuntimeError(
                f"GradScaler.{funcname}() called before scale(): call scaler.scale(loss).backward() "
                "earlier in the iteration."
            )
        return self._scale, self._growth_tracker

    # -- step: torch's, plus the skip signal and counters --------------------------------
    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        found = optimizer_state["found_inf_per_device"]
        skipped = bool(_sum_on(found, next(iter(found))).item())  # the one host sync of a step
        return self._finish_step(optimizer, skipped, *args, **kwargs)

    def _finish_step(self, optimizer: torch.optim.Optimizer, skipped: bool, *args: Any, **kwargs: Any) -> Any:
        self._host_found[id(optimizer)] = skipped
        self._last_skipped = skipped
        if skipped:
            self._steps += 1
            self._skipped += 1
            return None
        result = optimizer.step(*args, **kwargs)
        self._steps += 1
        return result

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, then run ``optimizer.step()`` unless a gradient was inf/NaN.

        Returns what ``optimizer.step`` returns; ``last_step_skipped`` tells whether it ran.
        A disabled scaler forwards everything (a closure too) unless ``check_finite`` is set.
        An optimizer with ``_step_supports_amp_scaling`` skips on the device by itself: it gets
        ``grad_scale``/``found_inf`` (or ``grad_scaler=self`` where its ``step`` takes that).
        """
        if not self._enabled:
            return self._step_unscaled(optimizer, *args, **kwargs)
        if not self._fused(optimizer):
            if getattr(optimizer, "_step_supports_amp_scaling", False):
                return self._unfused_step(optimizer, *args, **kwargs)
            return super().step(optimizer, *args, **kwargs)
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            result = super().step(optimizer, *args, **kwargs)  # the optimizer calls _check_inf_per_device
        else:
            result = self._fused_step(optimizer, *args, **kwargs)
        # The optimizer skipped on the device: the flag stays there until someone reads it.
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        if found:
            flag = _sum_on(found, next(iter(found))) > 0
            self._last_skipped = flag
            self._steps += 1
            self._count_on_device("skipped", flag)
        else:  # no parameter had a gradient: nothing stepped, nothing skipped
            self._last_skipped = False
        return result

    def _fused(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` gets ``grad_scale``/``found_inf`` and skips on the device: it
        supports AMP scaling, and the backend's fused steps honour found_inf."""
        return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and self.backend.fused_steps_honour_found_inf

    def _unfused_step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """A fused optimizer on a device whose fused steps ignore found_inf: unscaled here and
        skipped from the host, as any other optimizer (torch's path for those)."""
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if not state["found_inf_per_device"]:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        result = self._maybe_opt_step(optimizer, state, *args, **kwargs)
        state["stage"] = OptState.STEPPED
        return result

    def _fused_step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """torch's ``grad_scale``/``found_inf`` protocol as torch 2.5+ runs it, on every torch:
        after ``unscale_`` (or our clip) a ``grad_scale`` set on the optimizer is applied."""
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale, _ = self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
            grad_scale = scale * getattr(optimizer, "grad_scale", 1)
        else:
            grad_scale = getattr(optimizer, "grad_scale", None)
        found = state["found_inf_per_device"]
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = _sum_on(found, scale.device) if found else torch.zeros_like(scale)  # type: ignore[attr-defined]
        try:
            result = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        state["stage"] = OptState.STEPPED
        return result

    def _step_unscaled(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not self._check_finite:
            self._last_skipped = False
            result = optimizer.step(*args, **kwargs)
            self._steps += 1
            return result
        # frameworks pass the closure slot empty, by keyword or by position (Accelerate:
        # ``scaler.step(optimizer, closure)`` with closure None): only a real closure is refused
        closure = kwargs.pop("closure", None) if "closure" in kwargs else (args[0] if args else None)
        if closure is not None or len(args) > 1:
            raise RuntimeError(
                "check_finite=True checks gradients before optimizer.step(), but a closure would compute "
                "them inside it: run the closure (forward and backward) before scaler.step(optimizer)."
            )
        args = ()
        first = next((p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None), None)
        if first is None:
            self._last_skipped = False
            return optimizer.step(**kwargs)
        found = self._grad_op(optimizer, None, torch.zeros((), dtype=torch.float32, device=first.device), True)
        skipped = bool(_sum_on(found, first.device).item())
        return self._finish_step(optimizer, skipped, **kwargs)

    def ensure_unscaled_(self, optimizer: torch.optim.Optimizer) -> None:
        """``unscale_(optimizer)`` unless this iteration already unscaled it (or scaling is off):
        for framework code that unscales before clipping and cannot know whether it already did."""
        if self._enabled and self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            self.unscale_(optimizer)

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool | None:
        """Whether this iteration's unscaled gradients of ``optimizer`` hold an inf/NaN (its step
        will be skipped); None before they are unscaled, or with scaling off and ``check_finite``
        unset. With scaling off and ``check_finite`` set, the gradients are checked now. A host read."""
        if not self._enabled:
            if not self._check_finite:
                return None
            with torch.no_grad():
                found = self._grad_op(optimizer, None, torch.zeros(()), True, None)
            return bool(found) and bool(_sum_on(found, next(iter(found))).item() > 0)
        state = self._per_optimizer_states[id(optimizer)]
        found = state["found_inf_per_device"]
        if state["stage"] is OptState.READY or not found:
            return None
        return bool(_sum_on(found, next(iter(found))).item() > 0)

    # -- clipping -------------------------------------------------------------------------
    def clip_grad_norm_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        per_group: bool = False,
    ) -> torch.Tensor:
        """Unscale (if not done yet) and clip the optimizer's gradients to ``max_norm``.

        Returns the total norm of the unscaled gradients (a device tensor; inf/NaN when the
        step will be skipped, inf when the scale has underflowed to 0). With torch's kernel
        this is ``unscale_`` followed by ``torch.nn.utils.clip_grad_norm_``, bit for bit.
        With a kernel that measures the norm while it unscales (Triton) one pass unscales,
        checks and sums squares. With a fused optimizer (``AdamW(fused=True)``) the
        gradients are only read: the clip is folded into the optimizer's ``grad_scale``.

        The total norm is kept in :attr:`stats` (``grad_norm``), and with ``per_group`` each
        parameter group's norm before clipping (``group_grad_norms``), both as device tensors:
        monitoring them costs no host sync.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"clip_grad_norm_ takes the optimizer whose gradients to clip, got {type(optimizer).__name__}: "
                "call scaler.clip_grad_norm_(optimizer, max_norm) (the scaler unscales per optimizer)"
            )
        max_norm, norm_type = _clip_args(max_norm, norm_type)
        if self._enabled and self._per_optimizer_states[id(optimizer)]["stage"] is OptState.STEPPED:
            raise RuntimeError("clip_grad_norm_() is being called after step(): clip between backward and "
                               "scaler.step(optimizer), before update()")
        groups = self._group_norms(optimizer, norm_type) if _flag("per_group", per_group) else None
        total = self._clip_grad_norm(optimizer, max_norm, norm_type)
        self._grad_norm = total.detach()
        self._group_grad_norms = groups
        return total

    def _group_norms(self, optimizer: torch.optim.Optimizer, norm_type: float) -> tuple[torch.Tensor, ...]:
        """Each parameter group's gradient norm, unscaled, before the clip."""
        stage = self._per_optimizer_states[id(optimizer)]["stage"] if self._enabled else OptState.UNSCALED
        factor = None
        if stage is OptState.READY:
            if self._fused(optimizer):  # the gradients stay scaled: measure them and divide
                factor = self._inv_scale(self._check_scale_growth_tracker("clip_grad_norm_")[0])
            else:
                self.unscale_(optimizer)
        norms = []
        for group in optimizer.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            if not grads:
                norms.append(torch.zeros(()))
                continue
            dense = [g.coalesce()._values() if g.is_sparse else g for g in grads]
            per = [torch.linalg.vector_norm(g.float(), norm_type).to(dense[0].device) for g in dense]
            norm = torch.linalg.vector_norm(torch.stack(per), norm_type)
            norms.append(norm * factor.to(norm.device) if factor is not None else norm)
        return tuple(norms)

    def _clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float) -> torch.Tensor:
        """:meth:`clip_grad_norm_` once its arguments are checked."""
        arena = flat_grads_of(optimizer)
        # without an arena, the walk (and sparse coalescing) comes first, as torch's recipe has it
        params = _params_with_grads(optimizer) if arena is None else None
        stage = self._per_optimizer_states[id(optimizer)]["stage"] if self._enabled else OptState.UNSCALED
        fused = self._fused(optimizer)
        one_pass = norm_type == 2.0 and (fused or self.backend.kernel.one_pass_norm)
        if stage is not OptState.READY or not one_pass:
            if stage is OptState.READY:
                self.unscale_(optimizer)  # sets self._arena: the buffers hold the gradients, or not
            elif arena is not None:
                self._arena = arena if arena.attached() else None
            if arena is not None and self._arena is arena:
                total = _clip_flat(arena, max_norm, norm_type)
            else:
                holders = _dense_grad_holders(_params_with_grads(optimizer) if params is None else params)
                total = torch.nn.utils.clip_grad_norm_(holders, max_norm, norm_type=norm_type)
            return self._inf_when_scale_underflowed(total)
        scale, _ = self._check_scale_growth_tracker("clip_grad_norm_")
        state = self._per_optimizer_states[id(optimizer)]
        inv_scale = self._inv_scale(scale)
        norm_sq = torch.zeros((), dtype=torch.float32, device=scale.device)
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        if fused:  # read-only: check and measure the still-scaled gradients
            state["found_inf_per_device"] = self._grad_op(optimizer, None, found_inf, True, norm_sq)
            total = norm_sq.sqrt() * inv_scale
        else:
            state["found_inf_per_device"] = self._grad_op(optimizer, inv_scale, found_inf, False, norm_sq)
            total = norm_sq.sqrt()
        total = self._inf_when_scale_underflowed(total)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if fused:
            optimizer.grad_scale = scale * getattr(optimizer, "grad_scale", 1) / coef  # type: ignore[attr-defined]
        elif self._arena is not None:
            for flat in self._arena.groups:
                torch._foreach_mul_([flat.buffer], coef.to(flat.device))
        else:
            if params is None:  # an arena whose gradients were not in place
                params = _params_with_grads(optimizer)
            for (device, _), grads in group_by_device_and_dtype(p.grad for p in params).items():
                c = coef.to(device)
                torch._foreach_mul_([g for g in grads if not g.is_sparse], c)
                for g in grads:
                    if g.is_sparse:
                        g.mul_(c)
        state["stage"] = OptState.UNSCALED
        return total

    def _inf_when_scale_underflowed(self, total: torch.Tensor) -> torch.Tensor:
        if self._status_overflow:  # a device-wide status said overflow: the values are saturated
            return torch.full_like(total, math.inf)
        if not self._enabled or self._scale is None:
            return total
        return torch.where(self._scale.to(total.device) == 0, torch.full_like(total, math.inf), total)

    # -- update ---------------------------------------------------------------------------
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back the scale off after an overflow, grow it after ``growth_interval`` clean steps;
        or set it to ``new_scale`` (a positive number or a one-element tensor)."""
        index = self._updates
        if not self._enabled:
            self._updates += 1
            if any(self._host_found.values()):
                self._overflows += 1
                self._last_overflow = index
            self._host_found = {}
            self._iteration_open = self._status_overflow = False
            return
        scale, _ = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            value = _check_new_scale(new_scale, scale.device)
            super().update(value)
            self._mirror = None if isinstance(value, torch.Tensor) else (_f32(value), self._tracker_mirror())
        else:
            states = [s for s in self._per_optimizer_states.values() if s["found_inf_per_device"]]
            host = [self._host_found.get(k) for k, s in self._per_optimizer_states.items() if s["found_inf_per_device"]]
            device_flag = None
            if states and any(h is None for h in host):
                device_flag = torch.stack([_sum_on(s["found_inf_per_device"], scale.device) for s in states]).sum() > 0
            if not states:
                raise RuntimeError("No inf checks were recorded prior to update. "
                                   "Call scaler.step(optimizer) before update().")
            if self._dynamic:
                super().update()
            else:  # static loss scaling: the scale stays; only the iteration's state is reset
                self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
            if device_flag is None:
                self._record_update(any(host), index)
            else:
                self._mirror = None
                self._count_on_device("overflows", device_flag)
                last = self._device_counts.get("last_overflow", torch.full((), -1, dtype=torch.int64, device=scale.device))
                self._device_counts["last_overflow"] = torch.where(device_flag, torch.full_like(last, index), last)
                self._watch_scale(scale, index)
        self._host_found = {}
        self._updates += 1
        self._iteration_open = self._status_overflow = False

    def _watch_scale(self, scale: torch.Tensor, index: int) -> None:
        """With the overflow flags on the device (fused optimizers), notice a collapsing scale
        without a host sync: each update starts a non-blocking copy of the scale to host memory,
        and the next update reads it if it has arrived (CPU and CUDA; within one update of the
        collapse). Other devices read the scale every ``_LOW_SCALE_CHECK_EVERY`` updates."""
        if scale.device.type not in ("cpu", "cuda"):
            if (index + 1) % _LOW_SCALE_CHECK_EVERY == 0:
                self._warn_if_low(float(scale.item()))
            return
        pending = self._scale_copy
        if pending is not None and not self._warned_low_scale:
            host, event = pending
            if event is None or event.query():
                self._warn_if_low(float(host.numpy().reshape(-1)[0]))  # host memory: no device sync
        if self._warned_low_scale:
            self._scale_copy = None
            return
        host = torch.empty((), dtype=torch.float32, pin_memory=scale.is_cuda)
        host.copy_(scale.detach().reshape(()), non_blocking=True)
        event = None
        if scale.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._scale_copy = (host, event)

    def _tracker_mirror(self) -> int:
        return self._mirror[1] if self._mirror is not None else self._get_growth_tracker()

    def _count_on_device(self, key: str, flag: torch.Tensor) -> None:
        count = self._device_counts.get(key)
        self._device_counts[key] = flag.to(torch.int64) if count is None else count + flag

    def _record_update(self, overflow: bool, index: int) -> None:
        if overflow:
            self._overflows += 1
            self._last_overflow = index
        if self._mirror is None or not self._dynamic:
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
        self._warn_if_low(value)

    def _warn_if_low(self, value: float) -> None:
        if value < 1.0 and not self._warned_low_scale:
            self._warned_low_scale = True
            warnings.warn(
                f"GradScaler: the loss scale fell to {value:g} after {self.stats.overflows} overflows. "
                "Scaling cannot fix gradients that are inf/NaN at any scale: the loss or the model "
                "itself is producing NaN/inf (a learning rate too high, log/div of zero, or bf16-"
                "pretrained weights that overflow float16; try bfloat16).",
                RuntimeWarning,
                stacklevel=3,
            )

    # -- signals and stats ----------------------------------------------------------------
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
        counts = {k: int(v.item()) for k, v in self._device_counts.items()}
        skipped = self._skipped + counts.get("skipped", 0)
        overflows = self._overflows + counts.get("overflows", 0)
        last = max(self._last_overflow if self._last_overflow is not None else -1, counts.get("last_overflow", -1))
        if not self._enabled:
            scale = 1.0
        elif self._scale is None:
            scale = self._init_scale  # what get_scale() says before the first scale()
        elif self._mirror is not None:
            scale = self._mirror[0]
        else:
            scale = self.get_scale()
        return ScalerStats(
            steps=self._steps - skipped,
            skipped=skipped,
            overflows=overflows,
            scale=scale,
            last_overflow_step=None if last < 0 else last,
            updates=self._updates,
            grad_norm=self._grad_norm,
            group_grad_norms=self._group_grad_norms,
        )

    # -- setters and state ----------------------------------------------------------------
    def set_growth_factor(self, new_factor: float) -> None:
        _check_factors(1.0, new_factor, 0.5, 1, ValueError)
        super().set_growth_factor(float(new_factor))

    def set_backoff_factor(self, new_factor: float) -> None:
        _check_factors(1.0, 2.0, new_factor, 1, ValueError)
        super().set_backoff_factor(float(new_factor))

    def set_growth_interval(self, new_interval: int) -> None:
        _check_factors(1.0, 2.0, 0.5, new_interval, ValueError)
        super().set_growth_interval(int(new_interval))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state_dict from this scaler or ``torch.amp.GradScaler``; a malformed one
        raises StateDictError and changes nothing."""
        if not self._enabled:
            return
        values = validate_state_dict(state_dict)
        super().load_state_dict(values)
        self._mirror = (_f32(values["scale"]), values["_growth_tracker"])

    def __getstate__(self) -> dict[str, Any]:
        pg = self._process_group
        if pg is not None and pg != "world":
            raise TypeError(
                "a GradScaler holding a process group object cannot be pickled: pickle its state_dict(), "
                "or build it with process_group='world'."
            )
        state = super().__getstate__()
        state["backend"] = self.backend.name  # resolved again from the registry on load
        state["_arena"] = None
        state["_grad_norm"] = state["_group_grad_norms"] = None  # monitoring, not state
        state["_scale_copy"] = None  # a pending copy of the scale (and a CUDA event) stays behind
        state["_mirror"] = (_f32(state["_init_scale"]), state["_init_growth_tracker"]) if self._enabled else None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        from .registry import get

        state = dict(state)
        state["backend"] = get(state["backend"])
        super().__setstate__(state)

    def __repr__(self) -> str:
        return f"<GradScaler backend={self.backend.name!r} enabled={self._enabled}>"


def _params_with_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters that have a gradient, sparse gradients coalesced (a clip
    counts each index once)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    for p in params:
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()
    return params


def _clip_flat(arena: FlatGrads, max_norm: float, norm_type: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` on an arena, with its results bit for bit: the same
    norms of the same views, stacked in the same order; the clip multiplies each whole buffer
    by the coefficient with the op torch uses per gradient (foreach where the device has it)."""
    from torch.utils._foreach_utils import _device_has_foreach_support

    norms: list[torch.Tensor] = []
    for flat in arena.groups:  # where torch loops over vector_norm, _foreach_norm runs that loop in C++
        norms.extend(torch._foreach_norm(flat.views(), norm_type))
    if not norms:
        return torch.tensor(0.0)
    first = arena.groups[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for flat in arena.groups:
        c = coef.to(flat.device)
        if _device_has_foreach_support(flat.device):
            torch._foreach_mul_([flat.buffer], c)
        else:
            flat.buffer.mul_(c)
    return total


def _dense_grad_holders(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` for ``torch.nn.utils.clip_grad_norm_``, which cannot measure sparse gradients:
    each sparse (coalesced) gradient is stood in for by a holder whose ``.grad`` is an alias
    of its values, so the norm counts each index once and the clip scales it in place."""
    if not any(p.grad.is_sparse for p in params):
        return params
    holders = []
    for p in params:
        if p.grad.is_sparse:
            values = p.grad._values()
            holder = torch.empty_like(values)
            holder.grad = values
            p = holder
        holders.append(p)
    return holders


def _check_process_group(group: Any) -> None:
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


def _as_float(x: Any) -> float:
    """``float(x)``, with integers too large for a float as the infinity they stand for."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _real(x: Any) -> float:
    """``x`` as a float if it is a real number (not a bool), else NaN."""
    return _as_float(x) if isinstance(x, numbers.Real) and not isinstance(x, bool) else math.nan


def _clip_args(max_norm: Any, norm_type: Any) -> tuple[float, float]:
    """``max_norm`` a number >= 0 (inf: measure, do not clip), ``norm_type`` a number > 0 or inf."""
    norm, kind = _real(max_norm), _real(norm_type)
    if not norm >= 0:  # NaN fails too
        raise ValueError(f"max_norm must be a number >= 0 (inf measures without clipping), got {max_norm!r}")
    if not kind > 0:
        raise ValueError(f"norm_type must be a number > 0 or inf (2.0: the Euclidean norm), got {norm_type!r}")
    return norm, kind


def _check_new_scale(new_scale: Any, device: torch.device) -> float | torch.Tensor:
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad or not new_scale.is_floating_point():
            raise ValueError(
                "new_scale must be a positive number or a one-element floating-point tensor that "
                f"does not require grad, got a tensor of shape {tuple(new_scale.shape)} and dtype {new_scale.dtype}"
            )
        value = float(new_scale.detach().float().reshape(()).item())  # one host read, on an explicit call only
        if not (math.isfinite(value) and value > 0 and math.isfinite(_f32(value)) and _f32(value) > 0):
            raise ValueError(f"new_scale must be finite and > 0 (as a float32), got a tensor holding {value!r}: "
                             "an inf, NaN, zero or negative scale would skip or corrupt every later step")
        return new_scale.detach().reshape(()).to(device=device, dtype=torch.float32)
    _check_factors(new_scale, 2.0, 0.5, 1, ValueError, what="new_scale")
    return float(new_scale)


def _check_factors(
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    error: Callable[[str], Exception],
    what: str = "scale",
) -> None:
    def number(x: Any) -> bool:
        return math.isfinite(_real(x))

    if not number(init_scale) or not float(init_scale) > 0:
        raise error(f"{what} must be a finite number > 0, got {init_scale!r}")
    stored = _f32(float(init_scale))
    if not (math.isfinite(stored) and stored > 0):
        raise error(f"{what} {init_scale!r} does not fit a float32 (the scale tensor's dtype): it would be {stored!r}")
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
    _check_factors(
        values["scale"], values["growth_factor"], values["backoff_factor"], values["growth_interval"],
        lambda msg: StateDictError(f"GradScaler state_dict: {msg}"),
    )
    if tracker >= values["growth_interval"]:
        raise StateDictError(
            f"GradScaler state_dict['_growth_tracker'] is {tracker}, not below growth_interval "
            f"({values['growth_interval']}): the scale would never grow again. A scaler saves a tracker "
            "in [0, growth_interval)."
        )
    return values


def _for_backend(backend: Backend, needs_scaling: bool, kwargs: dict[str, Any]) -> GradScaler:
    """``Backend.grad_scaler``: scaling on where the dtype needs it and the caller allows it."""
    kwargs["enabled"] = _flag("enabled", kwargs.get("enabled", True)) and needs_scaling
    return GradScaler(backend, **kwargs)


provide("grad_scaler", _for_backend)  # Backend.grad_scaler builds this class without importing it
