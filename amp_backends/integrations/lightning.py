"""Lightning: one Precision plugin, for Fabric and for the Trainer, on any backend.

    from amp_backends.integrations.lightning import AmpPrecision
    trainer = L.Trainer(plugins=[AmpPrecision("cpu", torch.float16)], gradient_clip_val=1.0)
    fabric = L.Fabric(accelerator="cpu", plugins=[AmpPrecision("cpu", torch.float16)])

Lightning's own ``MixedPrecision`` refuses a scaler with bf16 and turns ``"16-mixed"`` on the
CPU into bf16; this plugin runs exactly the dtype asked for, with the backend's autocast and
``amp_backends.GradScaler``: fp16 on the CPU too, bf16 with ``check_finite=True`` (skip steps
whose gradients are inf/NaN), gradient clipping through the scaler (fused optimizers
included), the scaler's state in checkpoints, and ``last_step_skipped``/``stats`` for the user.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision
except ImportError:  # pragma: no cover - exercised only without Lightning
    raise ImportError(
        "amp_backends.integrations.lightning needs Lightning: pip install 'amp-backends[lightning]'"
    ) from None

from ..backend import Backend
from . import ScalerSignals, resolve

__all__ = ["AmpPrecision"]


def _raw(optimizer: Any) -> Any:
    """The optimizer itself: manual optimization hands the plugin Lightning's ``LightningOptimizer``
    wrapper (another object, of a subclass of the optimizer's class), automatic optimization the
    optimizer; the scaler keeps its state per optimizer object."""
    return getattr(optimizer, "_optimizer", optimizer)


def _nothing_to_clip(optimizer: Any) -> list[torch.Tensor]:
    """One zero gradient on the optimizer's device: what Fabric's clipping is handed on a step the scaler
    skips (torch's clip_grad_value_ refuses an empty list; the norm of this one is 0)."""
    device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
    stand_in = torch.zeros(1, device=device, requires_grad=True)
    stand_in.grad = torch.zeros(1, device=device)
    return [stand_in]


def _trainer_of(module: Any) -> Any:
    """The Trainer running ``module``, or None under Fabric (or for a plain module)."""
    return getattr(module, "_trainer", None) if isinstance(module, pl.LightningModule) else None


class AmpPrecision(ScalerSignals, Precision):
    """Mixed precision on an amp_backends backend, for ``L.Trainer(plugins=[...])`` and ``L.Fabric(plugins=[...])``.

    Args:
        backend: a backend name or Backend (None: the best available).
        dtype: the autocast dtype (None: the backend's default).
        **scaler_kwargs: for :class:`amp_backends.GradScaler` (``init_scale``, ``check_finite``, ...).
    """

    def __init__(self, backend: str | Backend | None = None, dtype: torch.dtype | str | None = None,
                 **scaler_kwargs: Any) -> None:
        self.backend, self.dtype, self.scaler = resolve(backend, dtype, scaler_kwargs)
        self.device = self.backend.device_type
        self.precision = "16-mixed" if self.dtype == torch.float16 else "bf16-mixed"  # what Lightning reports
        #: while a batch the Trainer skips (training_step returned None) runs its hooks: nothing to clip
        self._skipping = False

    # -- autocast -------------------------------------------------------------------------
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self.backend.autocast(self.dtype, cache_enabled=False):
            yield

    # -- backward: the Trainer scales in pre_backward and runs its hooks; Fabric in backward
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        if _trainer_of(module) is None:
            return tensor
        return super().pre_backward(self.scaler.scale(tensor), module)

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        if _trainer_of(model) is not None:
            super().backward(tensor, model, *args, **kwargs)
        else:
            self.scaler.scale(tensor).backward(*args, **kwargs)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        if _trainer_of(module) is None:
            return tensor
        return super().post_backward(tensor, module)

    # -- step -----------------------------------------------------------------------------
    def optimizer_step(
        self, optimizer: Any, model: Any = None, closure: Callable[[], Any] | None = None, **kwargs: Any
    ) -> Any:
        if isinstance(optimizer, torch.optim.LBFGS) and self.scaler.is_enabled():
            raise TypeError("AMP with loss scaling cannot run LBFGS, whose step() evaluates a closure itself.")
        if model is None:  # Fabric: the backward already ran
            if closure is not None:
                kwargs["closure"] = closure
            return self._step(optimizer, **kwargs)
        closure_result = closure() if closure is not None else None
        skip = closure_result is None and model.automatic_optimization
        if not skip:
            self.scaler.ensure_unscaled_(_raw(optimizer))  # callbacks' on_before_optimizer_step see true gradients
        self._skipping = skip  # a skipped batch is not clipped: its gradients (if accumulated) stay scaled
        try:
            self._after_closure(model, optimizer)
        finally:
            self._skipping = False
        return closure_result if skip else self._step(optimizer, **kwargs)

    def _step(self, optimizer: Any, **kwargs: Any) -> Any:
        result = self.scaler.step(_raw(optimizer), **kwargs)
        self.scaler.update()
        return result

    # -- clipping: through the scaler, so gradients are unscaled exactly once -------------
    def unscale_gradients(self, optimizer: Any) -> None:
        self.scaler.ensure_unscaled_(_raw(optimizer))

    def main_params(self, optimizer: Any) -> Any:
        """The parameters to clip (Fabric's ``clip_gradients`` asks here, after
        :meth:`unscale_gradients`). On an iteration whose gradients overflowed, none: the scaler
        skips that step, so there is nothing to clip: one zero gradient stands in, so that Fabric's
        default ``error_if_nonfinite=True`` does not raise on an overflow the scaler handles and its
        clipping by value has a tensor to clip (the norm Fabric returns for such a step is 0;
        ``precision.scaler.found_inf(optimizer)`` tells)."""
        raw = _raw(optimizer)
        if self.scaler.found_inf(raw):
            return iter(_nothing_to_clip(raw))
        return super().main_params(raw)

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        if not self._skipping:
            self.scaler.clip_grad_norm_(_raw(optimizer), clip_val)

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        if not self._skipping:
            self.scaler.ensure_unscaled_(_raw(optimizer))
            torch.nn.utils.clip_grad_value_(list(self.main_params(optimizer)), clip_value=clip_val)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint Lightning's own ``MixedPrecision`` wrote (its scaler's state under its class name,
        or an older one's ``native_amp_scaling_state``) resumes this plugin's scaler from it."""
        if type(self).__qualname__ not in checkpoint:
            state = checkpoint.get("MixedPrecision") or checkpoint.get("native_amp_scaling_state")
            if state:
                self.load_state_dict(state)

    def convert_output(self, data: Any) -> Any:
        """Floating outputs in the default dtype, as Fabric's own mixed precision gives them (a loss
        computed outside the forward runs in float32, not in the autocast dtype)."""
        from lightning.fabric.utilities.apply_func import apply_to_collection

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.get_default_dtype()) if torch.is_floating_point(t) else t

        return apply_to_collection(data, function=cast, dtype=torch.Tensor)

    def __repr__(self) -> str:
        return f"AmpPrecision(backend={self.backend.name!r}, dtype={self.dtype}, scaler={self.scaler!r})"
