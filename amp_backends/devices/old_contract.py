"""The contract's older spellings, and what replaced each.

Before it, a Backend (and a Kernel) ran the gradient op through four methods of its own
(``unscale_and_check_``, ``check_``, ``unscale_check_norm_``, ``check_norm_``; a Kernel also
``flat_op_``). The scaler now calls one method of the kernel, :meth:`Kernel.grad_op_`, per group of
gradients sharing a device and a dtype, within the limits the device declares. A plugin overriding an
old method would train with its override never called, so registration refuses it, naming the new
spelling; code calling one gets an AttributeError naming its replacement.

Other facts had two spellings; the older one is still honoured until :data:`REMOVED_IN`, with a
DeprecationWarning at registration naming the one spelling (:func:`deprecations`): ``is_available()``
for ``unavailable_reason()``, ``fused_steps_honour_found_inf`` for ``fused_found_inf``,
``global_overflow_status = True`` for the :class:`~.capabilities.OverflowStatus` mixin, ``fused_found_inf``
as a property for a class attribute, and a Kernel's
``supports()`` and ``auto_select()`` for ``unavailable_reason(device_type)`` and ``auto_device_types``.
"""

from __future__ import annotations

import inspect
from typing import Any, NoReturn

from ..errors import AmpBackendsError
from .capabilities import OverflowStatus

__all__ = ["BACKEND_METHODS", "BACKEND_SPELLINGS", "KERNEL_METHODS", "KERNEL_SPELLINGS", "REMOVED_IN", "Removed",
           "RemovedMethodError", "defines", "deprecations", "missing_overflow_methods", "overridden", "refusal"]

#: The release that stops accepting the older spellings of :data:`BACKEND_SPELLINGS` and :data:`KERNEL_SPELLINGS`.
REMOVED_IN = "0.3.0"

_GRAD_OP = "amp_backends.Kernel.grad_op_(group, found_inf, inv_scale=None, norm_sq=None)"
_RUN = ("to run it on a list of gradients as training does (grouped by device and dtype, the device's limits "
        "applied): amp_backends.testing.grad_op_(backend, grads, found_inf, inv_scale=None, norm_sq=None)")
_DECLARE = ("a device whose own op differs declares it (unscale_dtypes, max_tensor_elements, "
            "global_overflow_status) and a faster op is a Kernel subclass overriding grad_op_, registered from "
            "the plugin's amp_backends_register_kernels hook (docs/kernels.md)")

#: A Backend's (Device's) methods of the earlier contract -> their replacement.
BACKEND_METHODS = {
    "unscale_and_check_": f"backend.kernel.grad_op_(group, found_inf, inv_scale) ({_GRAD_OP}); {_RUN}",
    "check_": f"backend.kernel.grad_op_(group, found_inf) (inv_scale None: check only; {_GRAD_OP}); {_RUN}",
    "unscale_check_norm_": f"backend.kernel.grad_op_(group, found_inf, inv_scale, norm_sq) ({_GRAD_OP}); {_RUN}",
    "check_norm_": f"backend.kernel.grad_op_(group, found_inf, None, norm_sq) ({_GRAD_OP}); {_RUN}",
}
#: A Kernel's methods of the earlier contract -> their replacement.
KERNEL_METHODS = {
    "unscale_and_check_": f"grad_op_(group, found_inf, inv_scale) ({_GRAD_OP})",
    "check_": f"grad_op_(group, found_inf) (inv_scale None: check only; {_GRAD_OP})",
    "unscale_check_norm_": f"grad_op_(group, found_inf, inv_scale, norm_sq) ({_GRAD_OP})",
    "check_norm_": f"grad_op_(group, found_inf, None, norm_sq) ({_GRAD_OP})",
    "flat_op_": f"grad_op_(group, ...) on the arena's FlatGroup itself ({_GRAD_OP}: a FlatGroup may be run as its "
                "whole buffer)",
}


class RemovedMethodError(AmpBackendsError, AttributeError):
    """A method of the earlier contract was called: the message names its replacement."""


class Removed:
    """A method of the earlier contract, on the base class: reading it raises :class:`RemovedMethodError`
    naming the replacement (``hasattr`` answers False, as for any missing attribute)."""

    def __init__(self, methods: dict[str, str]) -> None:
        self.methods = methods
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> NoReturn:
        holder = owner.__name__ if obj is None and owner is not None else type(obj).__name__
        raise RemovedMethodError(f"{holder}.{self.name}() was removed with the earlier contract: use "
                                 f"{self.methods[self.name]}", name=self.name, obj=obj)


def overridden(cls: type, methods: dict[str, str]) -> list[str]:
    """The methods of the earlier contract ``cls`` (or a class it inherits from) still defines."""
    return [name for name in methods
            if any(name in vars(klass) and not isinstance(vars(klass)[name], Removed) for klass in cls.__mro__)]


def refusal(obj: object, methods: dict[str, str], what: str) -> str | None:
    """Why ``obj`` (a Backend or a Kernel being registered) is refused: it overrides methods nothing calls
    any more (named, with their replacement); None where it overrides none."""
    names = overridden(type(obj), methods)
    if not names:
        return None
    each = "; ".join(f"{name}() -> {methods[name]}" for name in names)
    return (f"{type(obj).__name__} overrides {', '.join(n + '()' for n in names)} of the earlier {what} contract, "
            f"which the scaler no longer calls (the override would never run): {each}. "
            + (_DECLARE if what == "backend" else "override grad_op_ instead (docs/kernels.md)"))


#: A Backend's older spellings, still honoured -> the one spelling.
BACKEND_SPELLINGS = {
    "is_available": "implement unavailable_reason() (None where the device can be used, else why not); "
                    "is_available() is derived from it",
    "fused_steps_honour_found_inf": "declare fused_found_inf = {\"*\": \"ignores\"} (every kind; or per kind, citing "
                                    "the source); True is what an undeclared kind is probed for: drop the line",
    "fused_found_inf": "declare fused_found_inf as a class attribute, not a property: a dict, or "
                       "amp_backends.ComputedMapping(function) where it depends on the torch release or the environment",
    "global_overflow_status": "subclass amp_backends.OverflowStatus next to amp_backends.Backend "
                              "(class MyBackend(OverflowStatus, Backend)): it sets global_overflow_status and requires "
                              "clear_overflow_status() and read_overflow_status_(found_inf)",
}
#: A Kernel's older spellings, still honoured -> the one spelling.
KERNEL_SPELLINGS = {
    "supports": "implement unavailable_reason(device_type) (None where it can run, else why not)",
    "auto_select": "declare auto_device_types = (\"cuda\", ...), the device types it is chosen for automatically "
                   "where unavailable_reason(device_type) is None (None: every one)",
}


def defines(cls: type, name: str, base: type) -> bool:
    """Whether ``cls``, or a class it inherits from below ``base``, defines ``name``."""
    for klass in cls.__mro__:
        if klass is base:
            return False
        if name in vars(klass):
            return True
    return False


def _old_overflow_status(obj: object) -> bool:
    """``global_overflow_status`` declared true (or a property) without the OverflowStatus mixin."""
    declared = inspect.getattr_static(obj, "global_overflow_status", False)  # a property is not asked now
    return not isinstance(obj, OverflowStatus) and (declared is True or isinstance(declared, property))


def deprecations(obj: object, base: type, spellings: dict[str, str]) -> list[str]:
    """The DeprecationWarning messages for the older spellings ``obj`` (a Backend or a Kernel being
    registered; ``base`` the class it subclasses: Device or Kernel) still uses."""
    cls = type(obj).__name__
    static = {"fused_found_inf", "global_overflow_status"}  # spelled differently, not by being defined
    used = [name for name in spellings if name not in static and defines(type(obj), name, base)]
    if "fused_found_inf" in spellings and isinstance(inspect.getattr_static(obj, "fused_found_inf", None), property):
        used.append("fused_found_inf")
    if "global_overflow_status" in spellings and _old_overflow_status(obj):
        used.append("global_overflow_status")
    return [f"{cls}.{name}: the contract's older spelling, honoured until amp-backends {REMOVED_IN}: "
            f"{spellings[name]}" for name in used]


def missing_overflow_methods(obj: object) -> str | None:
    """Why ``obj``, declaring the overflow status in the older spelling, is refused: a method missing."""
    if not _old_overflow_status(obj) or all(callable(getattr(type(obj), m, None))
                                            for m in ("clear_overflow_status", "read_overflow_status_")):
        return None
    return (f"{type(obj).__name__} sets global_overflow_status but does not implement clear_overflow_status() and "
            f"read_overflow_status_(found_inf): {BACKEND_SPELLINGS['global_overflow_status']}")
