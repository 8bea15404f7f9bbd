"""The backend contract: what every device plugs in to run mixed precision."""

from __future__ import annotations

import inspect
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from .devices import accelerator
from .devices import fused
from .errors import PerformanceWarning, UnsupportedDtypeError
from .gradients.groups import FlatGroup, GradGroup
from .gradients.kernel import TORCH_KERNEL, Kernel, add_sum_of_squares

__all__ = ["FP8_RECIPES", "Backend", "group_by_device_and_dtype", "provide"]

#: What the layers above lend this one, so that it imports neither: "grad_scaler" (from
#: amp_backends.scaler: backend, needs_scaling, kwargs -> GradScaler) and "kernel" (from
#: amp_backends.registry: backend -> Kernel). Each is set once, when that module is imported.
_PROVIDED: dict[str, Callable[..., Any]] = {}


def provide(what: str, factory: Callable[..., Any]) -> None:
    """Lend this layer a factory from a layer above (``"grad_scaler"`` or ``"kernel"``)."""
    if what not in ("grad_scaler", "kernel"):
        raise ValueError(f"provide({what!r}): only 'grad_scaler' and 'kernel' are provided from above")
    _PROVIDED[what] = factory

#: (backend name, dtype) pairs already warned about: once per process each.
_WARNED_EMULATED: set[tuple[str, torch.dtype]] = set()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def group_by_device_and_dtype(
    tensors: Iterable[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """Split tensors into lists that share a device and a dtype, keeping their order."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    return groups


def _kernel_op(kernel: Kernel, found_inf: torch.Tensor, inv_scale: torch.Tensor | None,
               norm_sq: torch.Tensor | None) -> tuple[Any, tuple[torch.Tensor, ...]]:
    if inv_scale is None:
        return (kernel.check_, (found_inf,)) if norm_sq is None else (kernel.check_norm_, (found_inf, norm_sq))
    if norm_sq is None:
        return kernel.unscale_and_check_, (found_inf, inv_scale)
    return kernel.unscale_check_norm_, (found_inf, inv_scale, norm_sq)


#: torchao's float8 training recipes (``Float8LinearConfig.from_recipe_name``): per-tensor dynamic
#: scaling (fastest), per-row scaling with power-of-two scales, and per-row with the weight gradient
#: kept in high precision (most accurate).
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


class Backend:
    """Base class of every backend.

    A device that already works with ``torch.autocast(device_type)`` and torch's own
    unscale kernel needs only ``name``, ``device_type``, ``default_dtype`` and
    :meth:`is_available`; everything else has a torch-generic default here.
    """

    #: Registry key, e.g. ``"cuda"``.
    name: str = ""
    #: The torch device type tensors live on, e.g. ``"cuda"``.
    device_type: str = ""
    #: Autocast dtype used when none is given.
    default_dtype: torch.dtype = torch.float16
    #: ``torch.distributed`` process-group backend that reduces this device's tensors ("" where none
    #: can: ``init_process_group`` then refuses, naming :attr:`dist_install_hint`).
    dist_backend: str = "gloo"
    #: What to install for a process-group backend where :attr:`dist_backend` is "".
    dist_install_hint: str = ""
    #: Automatic choice picks the available backend with the highest priority.
    priority: int = 50

    # -- what the device's own ops can do (declare; the core adapts) --------------------
    #: Gradient dtypes the device's unscale/check op accepts (None: every dtype). Gradients of
    #: other dtypes go through a float32 copy, with the results of torch's op (which computes
    #: in float32 too). torch_mlu's op and CUDA's (reused by torch_musa) take float32 and float16.
    unscale_dtypes: tuple[torch.dtype, ...] | None = None
    #: Most elements one tensor may have in the device's op (torch_mlu: 2**31 - 1); larger
    #: gradients are handed over in slices. None: no limit.
    max_tensor_elements: int | None = None
    #: False where the device has no float64: the scaler computes 1/scale in float32.
    has_fp64: bool = True
    #: True where overflow comes from a device-wide status register (torch_npu on chips without
    #: inf/NaN mode): :meth:`on_scale` clears it once per iteration, before the first backward;
    #: the unscale reads it instead of inspecting the tensors, and the scaler keeps what it read
    #: for every optimizer of the iteration and agrees on it across ranks. Implement
    #: :meth:`clear_overflow_status` and :meth:`read_overflow_status_`.
    global_overflow_status: bool = False
    #: Ops that must run in float32 under this device's autocast beyond torch's lists (names from
    #: :data:`amp_backends.precision.OP_MODULES`, e.g. ``"binary_cross_entropy"``): a precision
    #: policy built with this backend runs the modules calling them in float32.
    fp32_ops: tuple[str, ...] = ()
    #: What the device's fused optimizer kernels (``Adam/AdamW/SGD(fused=True)``) do with the
    #: scaler's ``found_inf``, per kind (``"adam"``, ``"adamw"``, ``"sgd"``, or a vendor optimizer's
    #: qualified class name): a status of :mod:`amp_backends.devices.fused` (HONOURS, IGNORES, REJECTS, ABSENT,
    #: REFUSED) or ``(status, "the source it is known from")``. A kind not declared is probed once on
    #: the device; None probes every kind. The scaler hands found_inf only to a kernel that honours
    #: it and skips every other fused step itself; an ABSENT or REFUSED one is refused with the reason.
    fused_found_inf: Mapping[str, str | tuple[str, str]] | None = None
    #: False: every fused kernel of the device ignores found_inf (older form of the declaration above).
    fused_steps_honour_found_inf: bool = True

    def fused_kernel(self, optimizer: torch.optim.Optimizer) -> fused.FusedKernel:
        """What ``optimizer``'s fused kernel does on this device: as declared in
        :attr:`fused_found_inf`, else probed once on the device (cached per class and defaults)."""
        if not self.fused_steps_honour_found_inf:
            return fused.FusedKernel(fused.IGNORES, f"backend {self.name!r}: fused_steps_honour_found_inf = False")
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:  # torch_mlu's FusedLAMBAMP: it checks
            return fused.FusedKernel(fused.HONOURS, "its step(grad_scaler=) checks found_inf itself")
        kind = fused.kind_of(optimizer)
        declared = (self.fused_found_inf or {}).get(kind)
        if declared is not None:
            status, note = (declared, "declared") if isinstance(declared, str) else declared
            return fused.FusedKernel(status, f"backend {self.name!r}: {note}")
        cache = self.__dict__.setdefault("_fused_probed", {})
        key = (type(optimizer), repr(sorted(optimizer.defaults.items())))
        if key not in cache:
            cache[key] = fused.probe(optimizer, self.device())
        return cache[key]

    def fused_honours_found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s fused step on this device skips itself when handed ``found_inf``
        (else the scaler skips it from the host).

        torch's fused SGD with momentum gives a parameter's first momentum buffer with
        ``empty_like`` and lets the kernel fill it; a kernel that skips (found_inf) leaves it
        uninitialised, and the next step trains on garbage (torch 2.13; CPU and CUDA kernels, and
        op-plugin's and torch_musa's, have the same early return). Until every parameter has its
        buffer, such an optimizer is skipped from the host."""
        if self.fused_kernel(optimizer).status != fused.HONOURS:
            return False
        if isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum") for g in optimizer.param_groups):
            return len(optimizer.state) >= sum(len(g["params"]) for g in optimizer.param_groups)
        return True

    #: Whether the scaler's ``state_dict`` carries ``"dynamic"``: torch_npu's scaler requires the key
    #: to load a checkpoint (``npu/amp/grad_scaler.py``), torch's ignores it.
    state_dict_dynamic: bool = False
    #: The torch release the device extension was built for, e.g. ``"2.4.0"``; ``info`` warns on
    #: a mismatch with the running torch.
    built_for_torch: str | None = None

    _kernel: Kernel | None = None

    @property
    def _autocast_dtypes(self) -> dict[Any, torch.dtype]:
        cache = self.__dict__.get("_autocast_dtype_cache")
        if cache is None:
            cache = self.__dict__["_autocast_dtype_cache"] = {}
        return cache

    #: instance attributes (dicts) where a backend keeps what it asked the device once; ``forget_probes``
    #: empties them. A backend with caches of its own names them here.
    probe_caches: tuple[str, ...] = ("_probed", "_fused_probed", "_autocast_dtype_cache")

    def forget_probes(self) -> None:
        """Forget what was asked of the device (``amp_backends.reprobe()`` calls it on every backend)."""
        for attr in self.probe_caches:
            cache = self.__dict__.get(attr)
            if isinstance(cache, dict):
                cache.clear()

    # -- availability -----------------------------------------------------------------
    def is_available(self) -> bool:
        """Whether the device can be used on this machine."""
        raise NotImplementedError(f"{type(self).__name__} must implement is_available()")

    def unavailable_reason(self) -> str | None:
        """Why the backend cannot be used, or None when it can."""
        if self.is_available():
            return None
        return f"{type(self).__name__}.is_available() returned False"

    def describe(self) -> str | None:
        """What the device is, in one line for ``info`` (model, runtime version), or None."""
        return None

    def fp32_note(self) -> str | None:
        """Where float32 compute on this device may not be float32 (Ascend's precision mode), what
        runs instead and the way to keep float32; None where float32 is float32."""
        return None

    # -- dtypes and autocast ----------------------------------------------------------
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """Autocast dtypes this device supports, the default first."""
        dtypes = [self.default_dtype]
        module = getattr(torch, self.device_type, None)
        query = getattr(module, "get_amp_supported_dtype", None)
        if callable(query):  # autocast dtypes only: torch_npu's list includes float32
            dtypes += [d for d in query() if d in (torch.float16, torch.bfloat16) and d not in dtypes]
        return tuple(dtypes)

    def native_dtypes(self) -> tuple[torch.dtype, ...]:
        """The supported autocast dtypes whose math the device runs natively (default: all).

        A dtype that is supported but not native works, emulated, and is usually slower
        than float32: entering autocast in it warns with :class:`PerformanceWarning`.
        """
        return self.supported_dtypes()

    # -- fp8 (declare; a precision policy's fp8= uses it) ----------------------------------
    def fp8_dtypes(self) -> tuple[torch.dtype, ...]:
        """The fp8 dtypes the device's matmuls take natively (``torch._scaled_mm`` or the vendor's own),
        e.g. ``(torch.float8_e4m3fn, torch.float8_e5m2)``; () where it has none (the default)."""
        return ()

    def fp8_recipes(self) -> tuple[str, ...]:
        """The fp8 training recipes (:data:`FP8_RECIPES`) the device runs: all of them
        where it has fp8 matmuls, else none."""
        return FP8_RECIPES if self.fp8_dtypes() else ()

    def fp8_linear(self, linear: torch.nn.Linear, config: Any) -> torch.nn.Module | None:
        """A vendor's own fp8 layer replacing ``linear`` (``config``: torchao's ``Float8LinearConfig``),
        or None (the default) for torchao's ``Float8Linear``. A vendor layer must keep ``linear``'s
        parameter objects under the same names (``weight``, ``bias``) and set ``is_fp8 = True`` on its
        class."""
        return None

    def emulation_reason(self, dtype: torch.dtype) -> str:
        """What the device lacks for ``dtype`` to be native (shown in the warning and ``info``)."""
        return f"backend {self.name!r} reports no native {_dtype_name(dtype)} math on this device"

    def warn_if_emulated(self, dtype: torch.dtype, enabled: bool = True) -> None:
        """Warn once per process (per backend and dtype) when ``dtype`` runs emulated here."""
        if not enabled or (self.name, dtype) in _WARNED_EMULATED or dtype in self.native_dtypes():
            return
        _WARNED_EMULATED.add((self.name, dtype))
        name = _dtype_name(dtype)
        warnings.warn(
            f"{name} autocast on {self.name} is emulated: {self.emulation_reason(dtype)}. Matrix math in "
            f"{name} will run slower than float32 here (often many times slower); activation memory is still "
            f"about halved. To train faster, use float32 (autocast(enabled=False), `amp-backends demo --no-amp`) "
            f"or a dtype this device runs natively ({', '.join(map(_dtype_name, self.native_dtypes())) or 'none'}). "
            "Silence with warnings.filterwarnings('ignore', category=amp_backends.PerformanceWarning).",
            PerformanceWarning,
            stacklevel=3,
        )

    def resolve_dtype(self, dtype: torch.dtype | str | None = None) -> torch.dtype:
        """Return ``dtype`` (or the default) after checking the backend supports it."""
        if dtype is None:
            return self.default_dtype
        supported = self.supported_dtypes()
        names = ", ".join(_dtype_name(d) for d in supported)
        if isinstance(dtype, str):
            resolved = getattr(torch, dtype.replace("torch.", ""), None)
            if not isinstance(resolved, torch.dtype):
                raise UnsupportedDtypeError(
                    f"{dtype!r} is not a torch dtype; backend {self.name!r} supports: {names}"
                )
            dtype = resolved
        if not isinstance(dtype, torch.dtype):
            raise UnsupportedDtypeError(
                f"dtype must be a torch dtype or None, got {type(dtype).__name__} {dtype!r}; "
                f"backend {self.name!r} supports: {names}"
            )
        if dtype not in supported:
            raise UnsupportedDtypeError(
                f"backend {self.name!r} does not support autocast dtype {_dtype_name(dtype)}; "
                f"supported: {names}. Pass one of those, or dtype=None for the default "
                f"({_dtype_name(self.default_dtype)})."
            )
        return dtype

    def autocast(
        self,
        dtype: torch.dtype | str | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> torch.autocast:
        """Autocast for this device; a context manager that also works as a decorator.

        Warns once (:class:`PerformanceWarning`) when the dtype is emulated on this device.
        """
        try:
            resolved = self._autocast_dtypes.get(dtype) if enabled else None
        except TypeError:  # unhashable: certainly no dtype; resolve_dtype says what is wrong
            resolved = None
        if resolved is None:
            resolved = self.resolve_dtype(dtype)
            self.warn_if_emulated(resolved, enabled)
            if enabled:  # validated (and warned about) once: a training step asks again every time
                self._autocast_dtypes[dtype] = resolved  # hashable: resolve_dtype took it
        return torch.autocast(
            self.device_type,
            dtype=resolved,
            enabled=enabled,
            cache_enabled=cache_enabled,
        )

    def grad_scaler(self, dtype: torch.dtype | str | None = None, **kwargs: Any) -> torch.amp.GradScaler:
        """A GradScaler for training under ``autocast(dtype)``.

        It scales when the dtype is float16; for bfloat16 it is free (no scaling, no
        unscale pass) and, with ``check_finite=True``, still refuses non-finite steps.
        """
        needs_scaling = self.resolve_dtype(dtype) == torch.float16
        return _PROVIDED["grad_scaler"](self, needs_scaling, kwargs)

    # -- gradient ops -----------------------------------------------------------------
    @property
    def kernel(self) -> Kernel:
        """The kernel this backend's gradient ops run on (``AMP_BACKENDS_KERNEL`` forces one)."""
        if self._kernel is None:
            choose = _PROVIDED.get("kernel")
            self._kernel = TORCH_KERNEL if choose is None else choose(self)
        return self._kernel

    def on_scale(self, scaler: torch.amp.GradScaler) -> None:
        """Run by the first ``GradScaler.scale()`` of an iteration (after construction or
        ``update()``), before any backward of it; clears the overflow status where the device
        keeps one (:attr:`global_overflow_status`). Later ``scale()`` calls of the same iteration
        (gradient accumulation, several losses) do not run it: an overflow in an early
        micro-batch must survive until the step reads it."""
        if self.global_overflow_status:
            self.clear_overflow_status()

    def clear_overflow_status(self) -> None:
        """Reset the device-wide overflow status (only with :attr:`global_overflow_status`)."""
        raise NotImplementedError(f"{type(self).__name__} sets global_overflow_status: implement clear_overflow_status()")

    def read_overflow_status_(self, found_inf: torch.Tensor) -> None:
        """Set ``found_inf`` to 1 if the device-wide status says an overflow happened since the
        last clear, and clear it (only with :attr:`global_overflow_status`)."""
        raise NotImplementedError(f"{type(self).__name__} sets global_overflow_status: implement read_overflow_status_()")

    def grad_op_(
        self,
        groups: Sequence[GradGroup],
        found_inf: torch.Tensor,
        inv_scale: torch.Tensor | None,
        norm_sq: torch.Tensor | None = None,
    ) -> dict[torch.device, torch.Tensor]:
        """The scaler's one op over an optimizer's gradients, grouped by (device, dtype) (arena
        buffers, or lists a walk found): unscale and check (``inv_scale`` set) or check only, adding
        the fp32 sum of squares of the result to ``norm_sq`` when given. Returns found_inf per device:
        ``found_inf`` itself for its own device, a copy for each other."""
        found: dict[torch.device, torch.Tensor] = {}
        partials: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for item in groups:
                device = item.device if isinstance(item, FlatGroup) else item[0]
                if device not in found:
                    found[device] = found_inf if found_inf.device == device else found_inf.to(device, copy=True)
                    if norm_sq is not None:
                        partials[device] = torch.zeros((), dtype=torch.float32, device=device)
                inv = inv_scale if inv_scale is None or inv_scale.device == device else inv_scale.to(device, non_blocking=True)
                if isinstance(item, FlatGroup):
                    self._run_flat(item, found[device], inv, partials.get(device))
                else:
                    self._run_group(item[1], item[2], found[device], inv, partials.get(device))
            if norm_sq is not None:
                for partial in partials.values():
                    norm_sq.add_(partial.to(norm_sq.device))
        return found

    def _run_group(self, dtype: torch.dtype, grads: Sequence[torch.Tensor], found_inf: torch.Tensor,
                   inv_scale: torch.Tensor | None, norm_sq: torch.Tensor | None) -> None:
        """The op on one list of gradients that share a device and ``dtype`` (no regrouping):
        unscale and check when ``inv_scale`` is set, else check; the fp32 sum of squares to
        ``norm_sq`` when given. Within the dtypes and sizes the device's op accepts."""
        if self.global_overflow_status:
            return self._status_op(grads, grads, found_inf, inv_scale, norm_sq)
        kernel = self.kernel
        op, args = _kernel_op(kernel, found_inf, inv_scale, norm_sq)
        limit = self.max_tensor_elements
        through_fp32 = not self._takes(kernel, dtype)
        if not through_fp32 and (limit is None or all(g.numel() <= limit for g in grads)):
            return op(grads, *args)
        # work on stand-ins (float32 copies, contiguous copies to slice), written back after
        stand_ins = [g.float() if through_fp32 else g for g in grads]
        if limit is not None:
            stand_ins = [s.contiguous() if s.numel() > limit else s for s in stand_ins]
        # one device and one dtype still: the pieces go to the op together
        op([p for s in stand_ins for p in (s.view(-1).split(limit) if limit and s.numel() > limit else (s,))], *args)
        if inv_scale is not None:
            for g, s in zip(grads, stand_ins):
                if s is not g:
                    g.copy_(s)

    def _takes(self, kernel: Kernel, dtype: torch.dtype) -> bool:
        """Whether ``kernel`` runs gradients of ``dtype`` as they are (else through float32)."""
        if kernel.handles_dtypes is not None and dtype in kernel.handles_dtypes:
            return True
        return self.unscale_dtypes is None or dtype in self.unscale_dtypes

    def _run_flat(self, group: FlatGroup, found_inf: torch.Tensor, inv_scale: torch.Tensor | None,
                  norm_sq: torch.Tensor | None) -> None:
        """The op on one arena group: the kernel's flat op on the buffer where the device's op
        takes it whole, else the per-tensor op on the group's views (no walk either way)."""
        if self.global_overflow_status:
            return self._status_op([group.buffer], group.views(), found_inf, inv_scale, norm_sq)
        limit = self.max_tensor_elements
        if not self._takes(self.kernel, group.dtype) or (limit is not None and group.buffer.numel() > limit):
            return self._run_group(group.dtype, group.views(), found_inf, inv_scale, norm_sq)
        self.kernel.flat_op_(group, found_inf, inv_scale, norm_sq)

    def _status_op(self, to_scale: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], found_inf: torch.Tensor,
                   inv_scale: torch.Tensor | None, norm_sq: torch.Tensor | None) -> None:
        """The ops of a device with a global overflow status, as its unscale op runs them: read
        (and reset) the status first; on overflow set found_inf and leave the gradients scaled
        (op-plugin's NPU kernel returns before unscaling), else unscale. The norm of a group that
        overflowed is inf: its saturated values are no gradient."""
        self.read_overflow_status_(found_inf)
        overflow = found_inf > 0
        if inv_scale is not None:
            torch._foreach_mul_(list(to_scale), torch.where(overflow, torch.ones_like(inv_scale), inv_scale))
        if norm_sq is not None:
            add_sum_of_squares(grads, norm_sq)
            norm_sq.copy_(torch.where(overflow.to(norm_sq.device), torch.full_like(norm_sq, math.inf), norm_sq))

    def _each_group(self, grads: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor | None,
                    norm_sq: torch.Tensor | None) -> None:
        for (device, dtype), group in group_by_device_and_dtype(grads).items():
            self._run_group(dtype, group, found_inf, None if inv_scale is None else inv_scale.to(device), norm_sq)

    def unscale_and_check_(
        self, grads: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
    ) -> None:
        """Multiply every gradient in place by ``inv_scale``; set ``found_inf`` (0-dim fp32)
        to 1 if any element is inf, -inf or NaN. Lists may mix dtypes and strides."""
        self._each_group(grads, found_inf, inv_scale, None)

    def check_(self, grads: Sequence[torch.Tensor], found_inf: torch.Tensor) -> None:
        """Read-only inf/NaN check: set ``found_inf`` to 1 on any non-finite element."""
        self._each_group(grads, found_inf, None, None)

    def unscale_check_norm_(
        self,
        grads: Sequence[torch.Tensor],
        found_inf: torch.Tensor,
        inv_scale: torch.Tensor,
        norm_sq: torch.Tensor,
    ) -> None:
        """Unscale and check, adding the fp32 sum of squares of the result to ``norm_sq``."""
        self._each_group(grads, found_inf, inv_scale, norm_sq)

    def check_norm_(self, grads: Sequence[torch.Tensor], found_inf: torch.Tensor, norm_sq: torch.Tensor) -> None:
        """Read-only check that also adds the fp32 sum of squares of ``grads`` to ``norm_sq``."""
        self._each_group(grads, found_inf, None, norm_sq)

    # -- device -----------------------------------------------------------------------
    def device(self, index: int | None = None) -> torch.device:
        """The torch device for ``index`` (the current one when None)."""
        return torch.device(self.device_type) if index is None else torch.device(self.device_type, index)

    def _device_module(self) -> Any:
        return getattr(torch, self.device_type, None)

    def synchronize(self) -> None:
        """Wait for all queued work on the device (its module's call, else ``torch.accelerator``)."""
        sync = getattr(self._device_module(), "synchronize", None)
        if callable(sync):
            sync()
        else:
            accelerator.synchronize(self.device_type)

    def max_memory_allocated(self) -> int | None:
        """Peak bytes allocated since the last reset, or None where the device does not track it."""
        query = getattr(self._device_module(), "max_memory_allocated", None)
        if callable(query):
            return int(query())
        found, value = accelerator.memory_call(self.device_type, "max_memory_allocated")
        return int(value) if found else None  # type: ignore[call-overload]

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak-memory measurement, where the device tracks one."""
        reset = getattr(self._device_module(), "reset_peak_memory_stats", None)
        if callable(reset):
            reset()
        else:
            accelerator.memory_call(self.device_type, "reset_peak_memory_stats")

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} name={self.name!r} device_type={self.device_type!r} "
            f"default_dtype={_dtype_name(self.default_dtype)}>"
        )
