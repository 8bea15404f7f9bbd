"""HF Accelerate: make an ``Accelerator`` train with the backend's autocast and scaler.

    accelerator = Accelerator(cpu=True)
    prepare(accelerator, "cpu", torch.float16)          # before accelerator.prepare(...)
    model, opt, dl = accelerator.prepare(model, opt, dl)

Accelerate alone runs ``mixed_precision="fp16"`` on the CPU in fp32, unscales before clipping
only for its own fp16 scaler, and cannot take another autocast. After ``prepare`` it runs the
backend's autocast on every prepared model's forward (outputs returned in fp32, as Accelerate
does) and in ``accelerator.autocast()``, scales with ``amp_backends.GradScaler``, unscales
before ``clip_grad_norm_``/``clip_grad_value_`` (once per step, whoever asks), reports skipped
steps through ``optimizer_step_was_skipped`` (fused optimizers too), and round-trips the scaler
through ``save_state``/``load_state``.
"""

from __future__ import annotations

import functools
from types import MethodType
from typing import Any

import torch

try:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import convert_to_fp32
except ImportError:  # pragma: no cover - exercised only without Accelerate
    raise ImportError(
        "amp_backends.integrations.accelerate needs Accelerate: pip install 'amp-backends[accelerate]'"
    ) from None

from ..backend import Backend
from ..errors import AmpBackendsError
from ..registry.registry import resolve_backend
from ..scaler.scaler import GradScaler

__all__ = ["prepare"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class _SkipAwareOptimizer(AcceleratedOptimizer):
    """Accelerate learns of a skipped step by the optimizer's step not being called; a fused
    optimizer's step is always called (it skips on the device), so ask the scaler instead."""

    def step(self, closure: Any = None) -> None:
        super().step(closure)
        if (
            isinstance(self.scaler, GradScaler)
            and self.gradient_state.sync_gradients
            and getattr(self.optimizer, "_step_supports_amp_scaling", False)
        ):
            self._is_overflow = self.scaler.last_step_skipped


def _wrap_forward(model: torch.nn.Module, backend: Backend, dtype: torch.dtype) -> None:
    """Run ``model.forward`` under the backend's autocast, outputs in fp32 (Accelerate's layout:
    ``_original_forward`` kept, so ``accelerator.unwrap_model`` removes it again)."""
    forward = model.forward
    func = getattr(forward, "__func__", None)

    def wrap(f: Any) -> Any:
        @functools.wraps(f)
        def autocast_forward(*args: Any, **kwargs: Any) -> Any:
            with backend.autocast(dtype):
                out = f(*args, **kwargs)
            return convert_to_fp32(out)

        return autocast_forward

    model._original_forward = forward
    model.forward = MethodType(wrap(func), model) if func is not None else wrap(forward)


def prepare(
    accelerator: Accelerator,
    backend: str | Backend | None = None,
    dtype: torch.dtype | str | None = None,
    **scaler_kwargs: Any,
) -> GradScaler:
    """Make ``accelerator`` use the backend's autocast and scaler; returns the scaler.

    Call it before ``accelerator.prepare(...)``. ``backend`` defaults to the one serving
    ``accelerator.device``; ``dtype`` to the Accelerator's ``mixed_precision`` (fp16/bf16), else
    the backend's default. ``scaler_kwargs`` go to :class:`amp_backends.GradScaler`
    (``check_finite=True`` makes bf16 training skip steps with inf/NaN gradients).
    """
    if accelerator._models or accelerator._optimizers:
        raise AmpBackendsError(
            "prepare(accelerator) must run before accelerator.prepare(model, optimizer, ...): "
            "it decides how the model's forward and the optimizer's step are wrapped."
        )
    if getattr(accelerator, "amp_backend", None) is not None:
        raise AmpBackendsError(
            "prepare(accelerator) ran on this Accelerator already: a second call would wrap the forward in one "
            "autocast and step with another's scaler. Build a new Accelerator for another backend or dtype."
        )
    be = resolve_backend(backend, None if backend is not None else accelerator.device)
    if dtype is None:
        dtype = _DTYPES.get(str(accelerator.mixed_precision))
    resolved = be.resolve_dtype(dtype)
    scaler = be.grad_scaler(resolved, **scaler_kwargs)

    accelerator.scaler = scaler
    accelerator.native_amp = False  # Accelerate's own autocast wrapper stays out; ours goes in
    accelerator.amp_backend = be

    original_prepare_model = accelerator.prepare_model
    original_prepare_optimizer = accelerator.prepare_optimizer

    def prepare_model(model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        model = original_prepare_model(model, *args, **kwargs)
        _wrap_forward(model, be, resolved)
        return model

    def prepare_optimizer(optimizer: Any, *args: Any, **kwargs: Any) -> AcceleratedOptimizer:
        wrapped = original_prepare_optimizer(optimizer, *args, **kwargs)
        if type(wrapped) is AcceleratedOptimizer:
            wrapped.__class__ = _SkipAwareOptimizer
        return wrapped

    def unscale_gradients(optimizer: Any = None) -> None:
        if optimizer is None:
            optimizers = list(accelerator._optimizers)
        else:
            optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        for opt in optimizers:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            scaler.ensure_unscaled_(opt)

    def autocast(autocast_handler: Any = None) -> torch.autocast:
        kwargs = autocast_handler.to_kwargs() if autocast_handler is not None else {}
        return be.autocast(resolved, enabled=kwargs.get("enabled", True), cache_enabled=kwargs.get("cache_enabled"))

    accelerator.prepare_model = prepare_model
    accelerator.prepare_optimizer = prepare_optimizer
    accelerator.unscale_gradients = unscale_gradients
    accelerator.autocast = autocast
    return scaler
