"""The contract's methods before the package's layout, and what replaced each.

Before it, a Backend (and a Kernel) ran the gradient op through four methods of its own
(``unscale_and_check_``, ``check_``, ``unscale_check_norm_``, ``check_norm_``; a Kernel also
``flat_op_``). The scaler now calls one method of the kernel, :meth:`Kernel.grad_op_`, per group of
gradients sharing a device and a dtype, within the limits the device declares. A plugin overriding an
old method would train with its override never called, so registration refuses it, naming the new
spelling; code calling one gets an AttributeError naming its replacement. ``is_available()`` is still
honoured: a device implementing it instead of ``unavailable_reason()`` is asked it.
"""

from __future__ import annotations

from typing import Any, NoReturn

from ..errors import AmpBackendsError

__all__ = ["BACKEND_METHODS", "KERNEL_METHODS", "Removed", "RemovedMethodError", "overridden", "refusal"]

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
