"""The backends plugins registered, and the rules for a name taken twice.

A name is unique across plugins: a second plugin registering it makes both unusable (``get()`` names
the two packages) unless one passes ``override=True``. A third-party backend under a built-in's name
is ignored (with a warning at ``get()``) unless it overrides. A fallback backend (the generic one on
``torch.accelerator``) is kept only while no other backend serves its device type or takes its name.
"""

from __future__ import annotations

import warnings

import torch

from ..devices.contract import Device
from ..devices.old_contract import BACKEND_METHODS, BACKEND_SPELLINGS, deprecations, missing_overflow_methods, refusal
from .records import PluginRecord

__all__ = ["BackendTable", "check_fields"]

#: Names ``get()`` gives a meaning of its own: no backend may take them.
_RESERVED_NAMES = ("auto",)


def check_fields(backend: Device) -> None:
    """The declared fields a backend is ranked and used by: refused at registration (the plugin
    then fails to load, named in ``info``), never a raw error later in ``get()``."""
    cls = type(backend).__name__
    for attr in ("name", "device_type"):
        value = getattr(backend, attr, None)
        if not isinstance(value, str) or not value or value != value.strip() or any(c.isspace() for c in value):
            raise ValueError(f"{cls}.{attr} must be a non-empty string without spaces, got {value!r}")
    if backend.name.lower() in _RESERVED_NAMES:
        raise ValueError(f"{cls}.name {backend.name!r} is reserved (get({backend.name!r}) means the best "
                         "available backend): choose another name")
    priority = getattr(backend, "priority", None)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"{cls}.priority must be an int (built-in accelerators 100, cpu 0), got "
                        f"{type(priority).__name__} {priority!r}")
    if backend.default_dtype not in (torch.float16, torch.bfloat16):  # autocast runs in one of them
        raise TypeError(f"{cls}.default_dtype must be torch.float16 or torch.bfloat16 (autocast's dtypes), got "
                        f"{type(backend.default_dtype).__name__} {backend.default_dtype!r}")
    built = getattr(backend, "built_for_torch", None)
    if built is not None and not isinstance(built, str):
        raise TypeError(f"{cls}.built_for_torch must be the torch version the extension was built for as a str "
                        f"(e.g. '2.4.0') or None, got {type(built).__name__} {built!r}")
    _check_fused_declarations(backend)
    for problem in (refusal(backend, BACKEND_METHODS, "backend"), missing_overflow_methods(backend)):
        if problem is not None:
            raise TypeError(problem)


#: The kinds a ``fused_found_inf`` key names besides a vendor optimizer's qualified class name.
_FUSED_KINDS = ("*", "adam", "adamw", "sgd", "adagrad")


def _check_fused_declarations(backend: Device) -> None:
    """A plain dict of ``fused_found_inf`` checked at registration: each key a kind or a qualified class
    name, each status one :mod:`amp_backends.devices.fused` knows (a ComputedMapping is read at use)."""
    from ..devices.fused import status_of

    declared = getattr(backend, "fused_found_inf", None)
    if not isinstance(declared, dict):
        return
    cls = type(backend).__name__
    for key, value in declared.items():
        if not isinstance(key, str) or (key not in _FUSED_KINDS and "." not in key):
            raise ValueError(f"{cls}.fused_found_inf: key {key!r} is neither a kind ({', '.join(_FUSED_KINDS)}, "
                             "lower case) nor a vendor optimizer's qualified class name (module.Class)")
        status = value[0] if isinstance(value, tuple) and len(value) == 2 else value
        try:
            status_of(status)
        except ValueError as exc:
            raise ValueError(f"{cls}.fused_found_inf[{key!r}]: {exc}") from None


class BackendTable:
    """Name -> (backend, the plugin that registered it, whether it overrides), with the names taken
    twice, the fallbacks waiting to be placed, and the third-party registrations under built-in names."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[Device, PluginRecord, bool]] = {}
        self.duplicates: dict[str, list[PluginRecord]] = {}
        #: backends registered with fallback=True: kept only while no other backend serves their device type
        self.fallbacks: list[tuple[Device, PluginRecord]] = []
        #: third-party registrations under a built-in's name: (name, plugin, overrides?)
        self.shadowing: list[tuple[str, PluginRecord, bool]] = []

    def add(self, record: PluginRecord, backend: Device, override: bool = False, fallback: bool = False) -> None:
        """A plugin's ``register(backend, override=..., fallback=...)``: the older spellings it uses are
        warned about (DeprecationWarning, pointing at the plugin's call) and honoured."""
        if not isinstance(backend, Device):  # Device's abstract methods are Backend's: only a Backend is one
            raise TypeError(f"register() takes an amp_backends.Backend instance, got {type(backend).__name__}: "
                            "subclass amp_backends.Backend (amp_backends.ExtensionBackend for a device a PyTorch "
                            "extension registers as PrivateUse1) and register an instance of it")
        check_fields(backend)
        for message in deprecations(backend, Device, BACKEND_SPELLINGS):
            warnings.warn(message, DeprecationWarning, stacklevel=3)
        if fallback:
            if override:
                raise ValueError("register(backend, override=True, fallback=True): a fallback never overrides; "
                                 "pass one of them")
            self.fallbacks.append((backend, record))  # placed by settle_fallbacks, after every plugin
            return
        key = backend.name.lower()
        if key in record.backends:
            raise ValueError(f"register(): this plugin registers a backend named {backend.name!r} twice: register "
                             "each backend once, each under a name of its own")
        record.backends.append(key)
        if key in self.duplicates:
            self.duplicates[key].append(record)
            return
        existing = self.entries.get(key)
        if existing is not None and any(existing[0] is b for b, _ in self.fallbacks):
            del self.entries[key]  # a fallback yields to any backend of its name
            existing[1].backends.remove(key)
            existing = None
        if existing is not None and existing[1].builtin and not record.builtin:
            self.shadowing.append((key, record, override))
            if not override:
                return  # the built-in stays; get() and info name the plugin that tried
        if existing is None or override:
            self.entries[key] = (backend, record, override)
        elif existing[2]:
            return  # the one already here explicitly overrides
        else:
            self.duplicates[key] = [existing[1], record]
            del self.entries[key]

    def settle_fallbacks(self, records: list[PluginRecord]) -> None:
        """Keep a fallback backend only where no other backend serves its device type or takes its
        name, and no plugin of that name was switched off (AMP_BACKENDS_DISABLE_PLUGINS=cuda means no
        cuda, not a generic one)."""
        fallbacks = {id(b) for b, _ in self.fallbacks}
        for backend, record in self.fallbacks:
            key = backend.name.lower()
            switched_off = any(  # its own plugin is installed but disabled or broken: not taken over
                r.status != "loaded" and r.name.lower() in (key, backend.device_type) for r in records
            )
            claimed = switched_off or key in self.duplicates or any(
                id(b) not in fallbacks and (b.device_type == backend.device_type or k == key)
                for k, (b, _, _) in self.entries.items()
            )
            if claimed:
                if self.entries.get(key, (None,))[0] is backend:
                    del self.entries[key]
                if key in record.backends:
                    record.backends.remove(key)
            elif key not in self.entries:
                self.entries[key] = (backend, record, False)
                record.backends.append(key)

    def snapshot(self) -> tuple[dict, dict, list, list]:
        """The table as it is, before a plugin's hook runs (:meth:`restore` puts it back)."""
        return (dict(self.entries), {k: list(v) for k, v in self.duplicates.items()}, list(self.fallbacks),
                list(self.shadowing))

    def restore(self, saved: tuple[dict, dict, list, list], record: PluginRecord) -> None:
        """The table as :meth:`snapshot` saw it: ``record``'s plugin failed, so nothing it registered
        stays, nor what it displaced (a built-in it overrode, a name it made a duplicate)."""
        entries, duplicates, fallbacks, shadowing = saved
        self.entries, self.duplicates, self.fallbacks, self.shadowing = (
            dict(entries), {k: list(v) for k, v in duplicates.items()}, list(fallbacks), list(shadowing))
        self.drop(record)

    def drop(self, record: PluginRecord) -> None:
        """Forget what ``record``'s plugin registered (its later hook, the kernels', failed: its backends go
        too; what they displaced stays displaced, which :meth:`restore` undoes within the hook that failed)."""
        self.fallbacks = [(b, r) for b, r in self.fallbacks if r is not record]
        for key in [k for k, (_, rec, _) in self.entries.items() if rec is record]:
            del self.entries[key]
        record.backends.clear()

    def is_fallback(self, backend: Device) -> bool:
        return any(b is backend for b, _ in self.fallbacks)

    def all_devices(self) -> list[Device]:
        """Every backend registered, placed or waiting as a fallback."""
        return [b for b, _, _ in self.entries.values()] + [b for b, _ in self.fallbacks]
