"""The device contract: what a device declares so that mixed precision runs on it.

A :class:`Device` is a record of facts (class attributes a plugin sets: dtypes, the limits of its
unscale op, its collective library, what its fused optimizer kernels do) and one availability probe,
:meth:`Device.unavailable_reason`. Everything else has a torch-generic default; optional capabilities
are mixins (:mod:`.capabilities`). The work that uses these facts lives elsewhere: the gradient op in
:mod:`amp_backends.gradients`, the scaler's policy in :mod:`amp_backends.scaler`.

Vendors never subclass Device: they subclass :class:`amp_backends.Backend` (or
:class:`amp_backends.ExtensionBackend`), its one implementation. Device is how the layers below the
backend (the gradient op, the registry, the scaler) name it; its two abstract methods are the
Backend's, so the registry's ``isinstance(backend, Device)`` accepts exactly the Backends.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ..errors import PerformanceWarning, UnsupportedDtypeError
from . import accelerator
from . import autocast_lists as autocast_lists_
from .autocast_lists import AutocastLists
from .capabilities import overflow_status
from .collectives import Collectives
from .old_contract import BACKEND_METHODS, Removed

__all__ = ["EVERY_KIND", "FP8_RECIPES", "MX_FORMATS", "ComputedMapping", "Device", "dtype_name"]

#: torchao's float8 training recipes (``Float8LinearConfig.from_recipe_name``): per-tensor dynamic
#: scaling (fastest), per-row scaling with power-of-two scales, and per-row with the weight gradient
#: kept in high precision (most accurate).
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: The microscaling formats a device may declare (:meth:`Device.mx_formats`): MXFP8, trained through
#: torchao's MX layer (e4m3 elements, one power-of-two e8m0 scale per block of 32 along each matmul's
#: reduction dimension).
MX_FORMATS = ("mxfp8",)
#: The key of :attr:`Device.fused_found_inf` that declares every kind of fused optimizer at once.
EVERY_KIND = "*"


class ComputedMapping(Mapping[str, Any]):
    """A declared mapping whose entries depend on the running torch or the environment, computed by
    ``build()`` each time it is read (``fused_found_inf = ComputedMapping(_fused_kernels)``): declared as a
    class attribute like any other mapping, and as current as a property."""

    def __init__(self, build: Callable[[], Mapping[str, Any]]) -> None:
        self.build = build

    def __getitem__(self, key: str) -> Any:
        return self.build()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.build())

    def __len__(self) -> int:
        return len(self.build())

    def __repr__(self) -> str:
        return f"ComputedMapping({self.build()!r})"


class Device(ABC):
    """What a device is, for mixed precision. Declare the facts; implement :meth:`unavailable_reason`.

    A device that already works with ``torch.autocast(device_type)`` and torch's own unscale op needs
    only ``name``, ``device_type``, ``default_dtype`` and :meth:`unavailable_reason`. Vendors subclass
    :class:`amp_backends.Backend`, which implements the two abstract methods.
    """

    # -- identity -------------------------------------------------------------------------
    #: Registry key, e.g. ``"cuda"``.
    name: str = ""
    #: The torch device type tensors live on, e.g. ``"cuda"``.
    device_type: str = ""
    #: Autocast dtype used when none is given.
    default_dtype: torch.dtype = torch.float16
    #: Automatic choice picks the available backend with the highest priority.
    priority: int = 50
    #: The torch release the device extension was built for, e.g. ``"2.4.0"``; ``info`` warns on
    #: a mismatch with the running torch.
    built_for_torch: str | None = None

    # -- the collective library -----------------------------------------------------------
    #: ``torch.distributed`` process-group backend that reduces this device's tensors ("" where none
    #: can: ``init_process_group`` then refuses, naming :attr:`dist_install_hint`).
    dist_backend: str = "gloo"
    #: What to install for a process-group backend where :attr:`dist_backend` is "".
    dist_install_hint: str = ""
    #: What :attr:`dist_backend`'s library reduces and moves (dtypes, reduce ops, how it computes AVG):
    #: a :class:`amp_backends.devices.collectives.Collectives`, e.g. one of its presets (``NCCL``,
    #: ``CNCL``, ``GAUDI_HCCL`` ...), from the library's torch bindings. None: the preset for
    #: :attr:`dist_backend`'s name where that name says which library it is (gloo, nccl, cncl, mccl,
    #: xccl); low-precision communication (:mod:`amp_backends.distributed`) refuses a library it cannot look up.
    collectives: Collectives | None = None

    # -- the device's unscale op (the executor applies these limits, with torch's results) --
    #: Gradient dtypes the device's unscale/check op accepts (None: every dtype). Gradients of
    #: other dtypes go through a float32 copy, with the results of torch's op (which computes
    #: in float32 too). torch_mlu's op and CUDA's (reused by torch_musa) take float32 and float16.
    unscale_dtypes: tuple[torch.dtype, ...] | None = None
    #: Most elements one tensor may have in the device's op (torch_mlu: 2**31 - 1); larger
    #: gradients are handed over in slices. None: no limit.
    max_tensor_elements: int | None = None
    #: False where the device has no float64: the scaler computes 1/scale in float32.
    has_fp64: bool = True
    #: True where overflow comes from a device-wide status register: declared by subclassing
    #: :class:`~.capabilities.OverflowStatus`, which sets it (read it; do not set it here).
    global_overflow_status: bool = False

    # -- autocast, fused optimizers, checkpoints -------------------------------------------
    #: What the device's autocast does with each op (:mod:`amp_backends.devices.autocast_lists`):
    #: torch's CUDA lists unless declared (torch_mlu and torch_musa reuse them). The precision policy
    #: runs the modules of banned ops in float32; the inspector labels ops from these lists.
    autocast_lists: AutocastLists = autocast_lists_.CUDA
    #: Ops that must run in float32 under this device's autocast beyond its lists' bans (names from
    #: :data:`amp_backends.precision.OP_MODULES`, e.g. ``"binary_cross_entropy"``): a precision
    #: policy built with this backend runs the modules calling them in float32.
    fp32_ops: tuple[str, ...] = ()
    #: What the device's fused optimizer kernels (``Adam/AdamW/SGD/Adagrad(fused=True)``) do with the
    #: scaler's ``grad_scale`` and ``found_inf``, per kind (``"adam"``, ``"adamw"``, ``"sgd"``,
    #: ``"adagrad"``, or a vendor optimizer's qualified class name): a status of
    #: :mod:`amp_backends.devices.fused` (honours: skips on found_inf and divides by grad_scale;
    #: scale_blind: skips but does not divide; ignores; rejects; absent; refused) or
    #: ``(status, "the source it is known from")``. A kind not declared is probed once on the device
    #: (both questions asked); None probes every kind. The key ``"*"`` (:data:`EVERY_KIND`)
    #: declares every kind at once, ahead of the others. A class attribute: a plain dict, or a
    #: :class:`ComputedMapping` where it depends on the torch release or the environment.
    fused_found_inf: Mapping[str, str | tuple[str, str]] | None = None
    #: Whether the scaler's ``state_dict`` carries ``"dynamic"``: torch_npu's scaler requires the key
    #: to load a checkpoint (``npu/amp/grad_scaler.py``), torch's ignores it.
    state_dict_dynamic: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass declaring ``fused_steps_honour_found_inf`` (the older spelling) gets it as
        ``fused_found_inf``: False is ``{"*": ignores}``. The registry warns (DeprecationWarning)."""
        super().__init_subclass__(**kwargs)
        if vars(cls).get("fused_steps_honour_found_inf", True) is False:
            cls.fused_found_inf = {**(cls.fused_found_inf or {}),
                                   EVERY_KIND: ("ignores", "fused_steps_honour_found_inf = False")}

    @property
    def fused_steps_honour_found_inf(self) -> bool:
        """Deprecated, removed in amp-backends 0.3.0: False where :attr:`fused_found_inf` declares every kind
        ``"ignores"``. Read ``fused_found_inf`` instead."""
        warnings.warn("fused_steps_honour_found_inf is deprecated and is removed in amp-backends 0.3.0: read "
                      'fused_found_inf (its "*" entry declares every kind)', DeprecationWarning, stacklevel=2)
        every = (self.fused_found_inf or {}).get(EVERY_KIND)
        return (every if isinstance(every, str) else every[0]) != "ignores" if every is not None else True

    # -- what the backend adds: its scaler and its kernel ------------------------------------
    @abstractmethod
    def grad_scaler(self, dtype: torch.dtype | str | None = None, **kwargs: Any) -> Any:
        """A GradScaler for training under ``autocast(dtype)`` (:class:`amp_backends.Backend`)."""

    @property
    @abstractmethod
    def kernel(self) -> Any:
        """The kernel the gradient ops run on (:class:`amp_backends.Backend`)."""

    # -- availability: the one probe ----------------------------------------------------------
    def unavailable_reason(self) -> str | None:
        """Why the device cannot be used here, precisely (not installed; installed but failing to
        import, with the error; no device visible, naming the variable that decides), or None when it
        can. The one availability probe: implement it (the registry runs it once, with a timeout)."""
        if type(self).is_available is not Device.is_available:  # an older plugin implementing is_available()
            ok = self.is_available()
            if not isinstance(ok, bool):
                return f"{type(self).__name__}.is_available() returned {type(ok).__name__} {ok!r}, not True or False"
            return None if ok else f"{type(self).__name__}.is_available() returned False"
        raise NotImplementedError(f"{type(self).__name__} must implement unavailable_reason() (None where the "
                                  "device can be used, else why not)")

    def is_available(self) -> bool:
        """Whether the device can be used on this machine (:meth:`unavailable_reason` is None). Derived:
        implement :meth:`unavailable_reason`, not this (an override is the older contract's spelling)."""
        return self.unavailable_reason() is None

    # -- optional facts for info and the precision policy ---------------------------------
    def describe(self) -> str | None:
        """What the device is, in one line for ``info`` (model, runtime version), or None."""
        return None

    def fp32_note(self) -> str | None:
        """Where float32 compute on this device may not be float32 (Ascend's precision mode), what
        runs instead and the way to keep float32; None where float32 is float32."""
        return None

    # -- dtypes and autocast ----------------------------------------------------------------
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

    def emulation_reason(self, dtype: torch.dtype) -> str:
        """What the device lacks for ``dtype`` to be native (shown in the warning and ``info``)."""
        return f"backend {self.name!r} reports no native {dtype_name(dtype)} math on this device"

    def warn_if_emulated(self, dtype: torch.dtype, enabled: bool = True) -> None:
        """Warn once per process (per backend and dtype) when ``dtype`` runs emulated here."""
        warn_if_emulated(self, dtype, enabled)

    def resolve_dtype(self, dtype: torch.dtype | str | None = None) -> torch.dtype:
        """Return ``dtype`` (or the default) after checking the backend supports it."""
        return resolve_dtype(self, dtype)

    def autocast(self, dtype: torch.dtype | str | None = None, enabled: bool = True,
                 cache_enabled: bool | None = None) -> torch.autocast:
        """Autocast for this device; a context manager that also works as a decorator.

        Warns once (:class:`PerformanceWarning`) when the dtype is emulated on this device.
        """
        memo = self.__dict__.setdefault("_autocast_dtypes", {})
        try:
            resolved = memo.get(dtype) if enabled else None
        except TypeError:  # unhashable: certainly no dtype; resolve_dtype says what is wrong
            resolved = None
        if resolved is None:
            resolved = self.resolve_dtype(dtype)
            self.warn_if_emulated(resolved, enabled)
            if enabled:  # validated (and warned about) once: a training step asks again every time
                memo[dtype] = resolved  # hashable: resolve_dtype took it
        return torch.autocast(self.device_type, dtype=resolved, enabled=enabled, cache_enabled=cache_enabled)

    # -- fp8 (declare; a precision policy's fp8= uses it) ----------------------------------
    def fp8_dtypes(self) -> tuple[torch.dtype, ...]:
        """The fp8 dtypes the device's matmuls take natively (``torch._scaled_mm`` or the vendor's own),
        e.g. ``(torch.float8_e4m3fn, torch.float8_e5m2)``; () where it has none (the default)."""
        return ()

    def fp8_recipes(self) -> tuple[str, ...]:
        """The fp8 training recipes (:data:`FP8_RECIPES`) the device runs: all of them
        where it has fp8 matmuls, else none."""
        return FP8_RECIPES if self.fp8_dtypes() else ()

    def fp8_unavailable_reason(self) -> str | None:
        """Why fp8 training cannot run on this device, in the vendor's terms (what the chip or its
        extension lacks, or the fp8 stack it has instead), or None: the generic reason is used."""
        return None

    def fp8_linear(self, linear: torch.nn.Linear, config: Any) -> torch.nn.Module | None:
        """A vendor's own fp8 layer replacing ``linear`` (``config``: torchao's ``Float8LinearConfig``),
        or None (the default) for torchao's ``Float8Linear``. A vendor layer must keep ``linear``'s
        parameter objects under the same names (``weight``, ``bias``) and set ``is_fp8 = True`` on its
        class."""
        return None

    # -- MX formats (declare; a precision policy's fp8_recipe="mxfp8" uses it) ----------------
    def mx_formats(self) -> tuple[str, ...]:
        """The microscaling formats (:data:`MX_FORMATS`) the device trains in natively through torchao's
        MX layer: ``("mxfp8",)`` where its matmuls take MXFP8 (e4m3 elements, one e8m0 scale per 32)
        and the installed torch and torchao run them; () where none (the default)."""
        return ()

    def mx_unavailable_reason(self) -> str | None:
        """Why MXFP8 training cannot run on this device, naming what the chip or the installed torch and
        torchao lack, or None: the generic reason is used."""
        return None

    # -- an iteration's start ---------------------------------------------------------------
    def on_scale(self, scaler: Any) -> None:
        """Run by the first ``GradScaler.scale()`` of an iteration (after construction or
        ``update()``), before any backward of it; clears the overflow status where the device
        keeps one (:attr:`global_overflow_status`). Later ``scale()`` calls of the same iteration
        (gradient accumulation, several losses) do not run it: an overflow in an early
        micro-batch must survive until the step reads it."""
        if self.global_overflow_status:
            overflow_status(self).clear_overflow_status()

    # -- the device -------------------------------------------------------------------------
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

    def _memory_call(self, name: str) -> tuple[bool, Any]:
        """``torch.<device>.<name>()`` where the device module has it, else ``torch.accelerator``'s:
        (True, its answer), or (False, None) where neither keeps allocator statistics."""
        call = getattr(self._device_module(), name, None)
        if callable(call):
            return True, call()
        return accelerator.memory_call(self.device_type, name)

    def max_memory_allocated(self) -> int | None:
        """Peak bytes allocated since the last reset, or None where the device does not track it."""
        found, value = self._memory_call("max_memory_allocated")
        return int(value) if found else None

    def memory_allocated(self) -> int | None:
        """Bytes the device's allocator holds for tensors now, or None where the device does not track it."""
        found, value = self._memory_call("memory_allocated")
        return int(value) if found else None

    def empty_cache(self) -> None:
        """Give the allocator's cached, unused blocks back to the device, where it keeps such a cache."""
        self._memory_call("empty_cache")

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak-memory measurement, where the device tracks one."""
        self._memory_call("reset_peak_memory_stats")

    # -- the earlier contract's gradient op (the kernel's grad_op_ now): named where read, refused where overridden
    unscale_and_check_ = Removed(BACKEND_METHODS)
    check_ = Removed(BACKEND_METHODS)
    unscale_check_norm_ = Removed(BACKEND_METHODS)
    check_norm_ = Removed(BACKEND_METHODS)

    #: Instance attributes (dicts) where a device keeps what it asked the device once;
    #: :meth:`forget_probes` empties them. A device with caches of its own names them here.
    probe_caches: tuple[str, ...] = ("_probed", "_autocast_dtypes")

    def forget_probes(self) -> None:
        """Forget what was asked of the device (``amp_backends.reprobe()`` calls it on every backend)."""
        for attr in self.probe_caches:
            cache = self.__dict__.get(attr)
            if isinstance(cache, dict):
                cache.clear()

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} name={self.name!r} device_type={self.device_type!r} "
                f"default_dtype={dtype_name(self.default_dtype)}>")


#: (backend name, dtype) pairs already warned about: once per process each.
_WARNED_EMULATED: set[tuple[str, torch.dtype]] = set()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def resolve_dtype(device: Device, dtype: torch.dtype | str | None) -> torch.dtype:
    """``dtype`` (or the device's default) after checking the device supports it."""
    if dtype is None:
        return device.default_dtype
    supported = device.supported_dtypes()
    names = ", ".join(dtype_name(d) for d in supported)
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.replace("torch.", ""), None)
        if not isinstance(resolved, torch.dtype):
            raise UnsupportedDtypeError(f"{dtype!r} is not a torch dtype; backend {device.name!r} supports: {names}")
        dtype = resolved
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedDtypeError(
            f"dtype must be a torch dtype or None, got {type(dtype).__name__} {dtype!r}; "
            f"backend {device.name!r} supports: {names}"
        )
    if dtype not in supported:
        raise UnsupportedDtypeError(
            f"backend {device.name!r} does not support autocast dtype {dtype_name(dtype)}; "
            f"supported: {names}. Pass one of those, or dtype=None for the default "
            f"({dtype_name(device.default_dtype)})."
        )
    return dtype


def warn_if_emulated(device: Device, dtype: torch.dtype, enabled: bool = True) -> None:
    """Warn once per process (per device name and dtype) when ``dtype`` runs emulated on ``device``."""
    if not enabled or (device.name, dtype) in _WARNED_EMULATED or dtype in device.native_dtypes():
        return
    _WARNED_EMULATED.add((device.name, dtype))
    name = dtype_name(dtype)
    warnings.warn(
        f"{name} autocast on {device.name} is emulated: {device.emulation_reason(dtype)}. Matrix math in "
        f"{name} will run slower than float32 here (often many times slower); what it saves in memory depends on the "
        f"model (`amp-backends bench --memory` counts it). To train faster, use float32 (autocast(enabled=False), `amp-backends demo --no-amp`) "
        f"or a dtype this device runs natively ({', '.join(map(dtype_name, device.native_dtypes())) or 'none'}). "
        "Silence with warnings.filterwarnings('ignore', category=amp_backends.PerformanceWarning).",
        PerformanceWarning,
        stacklevel=4,
    )
