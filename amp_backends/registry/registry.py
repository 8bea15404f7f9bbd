"""The registry: plugins found through the ``amp_backends`` entry-point group, each one's hooks called
in isolation (a plugin that fails takes only itself down), and the backends and kernels they
registered, asked for by name or as the best available.

The environment's say is read in :mod:`.environment`, the rules for names taken twice in
:mod:`.table`, probes bounded in time in :mod:`.probing`, the kernel choice in :mod:`.kernel_choice`.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from importlib import metadata
from typing import Any

import pluggy
import torch

from ..devices.accelerator import available_accelerator_type
from ..devices.contract import Device
from ..errors import AmpBackendsError, BackendUnavailableError, DuplicateBackendError, UnknownBackendError
from ..gradients.kernel import Kernel
from ..patches import stdout_to_stderr
from . import hookspecs
from .environment import chosen_backend, disabled_reason, probe_timeout, warn_unmatched
from .kernel_choice import KernelChoice
from .probing import bounded, forget, probe
from .records import PluginRecord, duplicate_message, exit_error, normalise, shadowing_message, unknown_backend
from .table import BackendTable

__all__ = [
    "PluginRecord",
    "Registry",
    "available",
    "default_registry",
    "get",
    "kernel_for",
    "names",
    "plugins",
    "probe",
    "probe_timeout",
    "register_plugin",
    "reload",
    "reprobe",
    "resolve_backend",
    "shadowing_message",
]

ENTRY_POINT_GROUP = "amp_backends"
BUILTIN_PACKAGE = "amp-backends"


class Registry:
    """Backends and kernels registered by plugins, loaded on first use."""

    def __init__(self, group: str = ENTRY_POINT_GROUP) -> None:
        self.group = group
        self._lock = threading.RLock()
        #: True once loaded; while loading, the loading thread's id
        self._loaded: bool | int = False
        self._extra: list[tuple[object, str, str, str]] = []
        self._reset()

    def _reset(self) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._records: dict[str, PluginRecord] = {}
        self._table = BackendTable()
        self._kernels = KernelChoice()
        self._warned: set[str] = set()

    # -- loading ----------------------------------------------------------------------
    def reload(self) -> None:
        """Forget everything and discover plugins again (re-reading the environment)."""
        with self._lock:
            self.reprobe()
            self._reset()
            self._loaded = False
            self._ensure_loaded()

    def register_plugin(self, plugin: object, name: str | None = None, package: str = "") -> None:
        """Register an in-process plugin object or module (notebooks, tests)."""
        with self._lock:
            name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
            package = package or name
            self._extra.append((plugin, name, package, ""))
            if self._loaded is True:  # (while loading, _load_all takes it from _extra)
                self._add_plugin(plugin, PluginRecord(name, package, "", builtin=False))
                self._collect([name])

    def unregister_plugin(self, name: str) -> None:
        """Remove an in-process plugin registered with :meth:`register_plugin`."""
        with self._lock:
            self._extra = [e for e in self._extra if e[1] != name]
            self.reload()

    def _ensure_loaded(self) -> None:
        if self._loaded is True:
            return
        with self._lock:  # another thread waits here until the plugins are loaded
            if self._loaded is True:
                return
            if self._loaded == threading.get_ident():  # a plugin asking the registry while it is imported
                raise AmpBackendsError("amp_backends was asked for its backends while its plugins are loading (a "
                                       "plugin calling amp_backends.get() at import): ask inside its hooks, or later")
            self._loaded = threading.get_ident()
            try:
                with stdout_to_stderr(cause="a plugin that prints while it loads must not corrupt a caller's stdout (info --json)"):
                    self._load_all()
                self._loaded = True
            except BaseException:  # Ctrl-C while a plugin loads: propagate, and load afresh next time
                self._reset()
                self._loaded = False
                raise

    def _load_all(self) -> None:
        order: list[str] = []
        for ep, record in _entry_points(self.group):
            if record.name in self._records:
                continue  # the same distribution seen twice on sys.path
            self._records[record.name] = record
            if record.status == "disabled":
                continue
            try:
                plugin = ep.load()
            except SystemExit as exc:  # a plugin that exits while imported is a broken plugin, not an exit
                record.fail(exit_error(exc, "while being imported"))
                continue
            except Exception as exc:  # noqa: BLE001 - a broken plugin must not break others
                record.fail(exc)  # (KeyboardInterrupt goes on to the caller)
                continue
            if self._add_plugin(plugin, record):
                order.append(record.name)
        for plugin, name, package, version in self._extra:
            if self._add_plugin(plugin, PluginRecord(name, package, version, builtin=False)):
                order.append(name)
        self._collect(order)
        warn_unmatched(self._records.values())

    def _add_plugin(self, plugin: object, record: PluginRecord) -> bool:
        self._records[record.name] = record
        try:
            self._pm.register(plugin, name=record.name)
        except Exception as exc:  # noqa: BLE001 - a plugin pluggy refuses fails alone, recorded
            record.fail(exc)
            return False
        return True

    def _collect(self, order: list[str]) -> None:
        """Call each plugin's hooks on its own, so one failing plugin affects no other."""
        for hook_name, adder in (
            ("amp_backends_register_backends", self._table.add),
            ("amp_backends_register_kernels", self._kernels.add),
        ):
            caller = getattr(self._pm.hook, hook_name)
            impls = {impl.plugin_name: impl for impl in caller.get_hookimpls()}
            for name in order:
                impl = impls.get(name)
                record = self._records[name]
                if impl is None or record.status == "failed":
                    continue
                registrar, saved = _Registrar(adder, record), self._table.snapshot()
                timeout = probe_timeout()
                done, _, error = bounded(lambda: impl.function(register=registrar), timeout)
                if not done:
                    registrar.closed = True
                    record.fail(TimeoutError(f"its {hook_name} hook did not return within {timeout:g} s "
                                             "(set AMP_BACKENDS_PROBE_TIMEOUT=SECONDS to wait longer)"))
                    self._drop(record, saved)
                elif isinstance(error, SystemExit):
                    record.fail(exit_error(error, f"in its {hook_name} hook"))
                    self._drop(record, saved)
                elif isinstance(error, Exception):
                    record.fail(error)
                    self._drop(record, saved)
                elif error is not None:  # KeyboardInterrupt: the caller's to handle
                    raise error
        self._table.settle_fallbacks(list(self._records.values()))

    def _drop(self, record: PluginRecord, saved: tuple[dict, dict, list, list]) -> None:
        self._table.restore(saved, record)
        self._kernels.drop(record)
        self._pm.unregister(name=record.name)

    # -- queries ----------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every registered backend name, available or not."""
        self._ensure_loaded()
        return sorted(self._table.entries)

    def available(self) -> list[str]:
        """Names of the backends usable on this machine, best first."""
        self._ensure_loaded()
        usable = [b for b, _, _ in self._table.entries.values() if probe(b) is None]
        return [b.name for b in sorted(usable, key=lambda b: (-b.priority, b.name))]

    def plugins(self) -> list[PluginRecord]:
        """Every plugin seen: loaded, failed or disabled."""
        self._ensure_loaded()
        return list(self._records.values())

    def backends(self) -> list[tuple[Device, PluginRecord]]:
        """Every registered backend with the plugin that registered it."""
        self._ensure_loaded()
        return [(b, rec) for _, (b, rec, _) in sorted(self._table.entries.items())]

    def duplicates(self) -> dict[str, list[PluginRecord]]:
        self._ensure_loaded()
        return dict(self._table.duplicates)

    def kernels(self) -> dict[str, Kernel]:
        self._ensure_loaded()
        return self._kernels.by_name()

    def get(self, name: str | None = None) -> Device:
        """The backend called ``name``; the best available one for None or ``"auto"``."""
        self._ensure_loaded()
        if name is None or (isinstance(name, str) and name.strip().lower() == "auto"):
            chosen = chosen_backend()
            if chosen is not None:
                try:
                    return self.get(chosen)
                except AmpBackendsError as exc:  # the same error, naming where the name came from
                    raise type(exc)(f"AMP_BACKEND={chosen!r} cannot be used: {str(exc).rstrip('.')}. Unset "
                                    "AMP_BACKEND to use the best available backend") from None
            usable = self.available()
            if not usable:
                reasons = "; ".join(f"{n}: {probe(b)}" for n, (b, _, _) in sorted(self._table.entries.items()))
                raise BackendUnavailableError(f"no backend is available ({reasons or 'none registered'})")
            best = usable[0].lower()
            self._warn_shadowing(best)
            best_backend = self._table.entries[best][0]
            self._warn_stand_in(best_backend)
            if best_backend.device_type == "cpu":
                self._warn_unused_accelerator()
            return best_backend
        if not isinstance(name, str):
            raise TypeError(f"backend name must be a string, got {type(name).__name__}")
        key = name.strip().lower()
        if key in self._table.duplicates:
            raise DuplicateBackendError(duplicate_message(key, self._table.duplicates[key]))
        entry = self._table.entries.get(key)
        if entry is None:
            raise self._missing(name, key)
        backend = entry[0]
        reason = probe(backend)
        if reason is not None:
            raise BackendUnavailableError(f"backend {backend.name!r} is not available: {reason}")
        self._warn_shadowing(key)
        self._warn_stand_in(backend)
        return backend

    def _warn_stand_in(self, backend: Device) -> None:
        """The generic backend serving a device while a third-party plugin is switched off or broken:
        that plugin may be the device's own (its entry-point name need not be the device type), so
        say once that torch's generic path stands in, rather than replace it silently."""
        key = f"stand-in:{backend.device_type}"
        if key in self._warned or not self._table.is_fallback(backend):
            return
        off = sorted(f"{r.name} ({r.status})" for r in self._records.values() if not r.builtin and r.status != "loaded")
        if not off:
            return
        self._warned.add(key)
        warnings.warn(f"{backend.device_type!r} runs on the generic backend (torch's own APIs) while the plugin(s) "
                      f"{', '.join(off)} are not loaded; if one of them is the {backend.device_type!r} device's "
                      "plugin, it is not in use (see `amp-backends info`)", RuntimeWarning, stacklevel=4)

    def _warn_unused_accelerator(self) -> None:
        """Never cpu silently: when torch reports a usable accelerator that no backend can serve,
        say why once (unless its plugin was switched off on purpose)."""
        device_type = available_accelerator_type()
        key = f"accelerator:{device_type}"
        if device_type in (None, "cpu") or key in self._warned:
            return
        serving = [b for _, (b, _, _) in sorted(self._table.entries.items()) if b.device_type == device_type]
        if serving:
            why = "; ".join(f"backend {b.name!r}: {probe(b)}" for b in serving)
        elif any(r.status == "disabled" for r in self._records.values()):
            return  # AMP_BACKENDS_DISABLE_PLUGINS / AMP_BACKENDS_PLUGINS chose this
        else:
            why = "no registered backend serves it"
        self._warned.add(key)
        warnings.warn(
            f"torch reports a usable {device_type!r} accelerator, but amp_backends trains on cpu: {why}. "
            "Run `amp-backends info` for details, or pass a backend name to get().",
            RuntimeWarning,
            stacklevel=4,
        )

    def shadowing(self) -> list[tuple[str, PluginRecord, bool]]:
        """Third-party registrations under a built-in backend's name: (name, plugin, whether it overrides)."""
        self._ensure_loaded()
        return list(self._table.shadowing)

    def _warn_shadowing(self, key: str) -> None:
        for name, record, override in self._table.shadowing:
            if name != key or key in self._warned:
                continue
            self._warned.add(key)
            warnings.warn(shadowing_message(name, record, override), RuntimeWarning, stacklevel=4)

    def for_device_type(self, device_type: str) -> Device:
        """The backend serving torch device type ``device_type`` (the one of that name first)."""
        self._ensure_loaded()
        if device_type in self._table.entries or device_type in self._table.duplicates:
            return self.get(device_type)
        matching = [b for _, (b, _, _) in sorted(self._table.entries.items()) if b.device_type == device_type]
        usable = [b for b in matching if probe(b) is None]
        if usable:
            return self.get(usable[0].name)
        if matching:
            return self.get(matching[0].name)  # raises, saying why it is unavailable
        types = sorted({b.device_type for _, (b, _, _) in self._table.entries.items()})
        raise UnknownBackendError(
            f"no backend serves device type {device_type!r}; backends exist for: {', '.join(types) or '(none)'}. "
            "Install the plugin for that device, or pass a backend name."
        )

    def _missing(self, name: str, key: str) -> Exception:
        return unknown_backend(name, key, sorted(self._table.entries), list(self._records.values()))

    def kernel_for(self, device: Device) -> Kernel:
        """The kernel ``device`` runs its gradient ops on (:class:`~.kernel_choice.KernelChoice`)."""
        self._ensure_loaded()
        return self._kernels.for_device(device)

    def kernel_rejections(self, device_type: str) -> list[str]:
        """Why kernels were not adopted for ``device_type`` (failed self-checks)."""
        return self._kernels.rejections_for(device_type)

    def reprobe(self) -> None:
        """Forget every availability answer, and what each backend cached of its device."""
        forget(self._table.all_devices())

def _entry_points(group: str) -> list[tuple[metadata.EntryPoint, PluginRecord]]:
    """Each entry point with its record; built-ins first, so that a third-party duplicate names the
    built-in it collides with. A distribution's metadata is read once (parsing it is the cost)."""
    read: dict[int, tuple[str, str]] = {}
    found = []
    for ep in metadata.entry_points(group=group):
        dist = getattr(ep, "dist", None)
        if dist is None:
            package, version = "?", "?"
        else:
            if id(dist) not in read:
                meta = dist.metadata
                read[id(dist)] = (meta["Name"] or "?", meta["Version"] or "?")
            package, version = read[id(dist)]
        builtin = dist is not None and normalise(package) == BUILTIN_PACKAGE
        record = PluginRecord(ep.name, package, version, builtin, module=ep.value)
        why = disabled_reason(record)
        if why is not None:
            record.status, record.error = "disabled", why
        found.append((ep, record))
    return sorted(found, key=lambda item: (not item[1].builtin, item[0].name))


class _Registrar:
    """The ``register`` callable handed to one plugin's hook."""

    def __init__(self, adder: Callable[..., None], record: PluginRecord) -> None:
        self._adder = adder
        self._record = record
        self.closed = False

    def __call__(self, obj: Any, **kwargs: Any) -> None:
        if self.closed:  # a hook that overran its time and registers late: ignored
            raise RuntimeError(f"plugin {self._record.name!r} registered after its hook timed out: ignored")
        self._adder(self._record, obj, **kwargs)



_DEFAULT = Registry()


def default_registry() -> Registry:
    """The process-wide registry the module-level functions use."""
    return _DEFAULT


def get(name: str | None = None) -> Device:
    """A backend by name; the best available one for None or ``"auto"`` (``AMP_BACKEND`` overrides)."""
    return _DEFAULT.get(name)


def resolve_backend(backend: str | Device | Any = None, device: str | Any = None) -> Device:
    """What an API taking ``backend`` (and torch's ``device=``) means: a Backend, a backend
    name, a ``torch.device`` or device-type string, or None for the best available."""
    if device is not None:
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a device type string or a torch.device, got {type(device).__name__}")
        device_type = torch.device(device).type
        if backend is None:
            return _DEFAULT.for_device_type(device_type)
        chosen = resolve_backend(backend)
        if chosen.device_type != device_type:
            raise ValueError(
                f"backend {chosen.name!r} runs on device type {chosen.device_type!r}, but device={device!r} "
                "was also given: pass one of them."
            )
        return chosen
    if backend is None or isinstance(backend, Device):
        return get() if backend is None else backend
    if isinstance(backend, torch.device):
        return _DEFAULT.for_device_type(backend.type)
    if isinstance(backend, str):
        if ":" in backend:  # "cuda:0", as torch.device spells it
            return _DEFAULT.for_device_type(torch.device(backend).type)
        return get(backend)
    raise TypeError(
        f"backend must be a backend name, a Backend, a torch.device or None, got {type(backend).__name__} "
        f"{backend!r}; known backends: {', '.join(names())}"
    )


def registered(backend: Any = None, device: Any = None) -> Device | None:
    """The registered backend ``backend``/``device`` name as :func:`resolve_backend` takes them, whether or
    not it is usable here (a disabled scaler for a device this machine lacks); None where none is."""
    if isinstance(device, (str, torch.device)):
        key = torch.device(device).type
    elif isinstance(backend, torch.device):
        key = backend.type
    elif isinstance(backend, str):
        key = torch.device(backend).type if ":" in backend else backend.strip().lower()
    else:
        return None
    _DEFAULT._ensure_loaded()
    entries = _DEFAULT._table.entries
    if key in entries:
        return entries[key][0]
    return next((b for _, (b, _, _) in sorted(entries.items()) if b.device_type == key), None)


def names() -> list[str]:
    """Every registered backend name."""
    return _DEFAULT.names()


def available() -> list[str]:
    """Backends usable on this machine, best first."""
    return _DEFAULT.available()


def plugins() -> list[PluginRecord]:
    """Every plugin seen, with its status and error."""
    return _DEFAULT.plugins()


def register_plugin(plugin: object, name: str | None = None) -> None:
    """Register an in-process plugin (a module or object with hook implementations)."""
    _DEFAULT.register_plugin(plugin, name)


def reload() -> None:
    """Discover plugins again, re-reading the environment variables."""
    _DEFAULT.reload()


def reprobe() -> None:
    """Forget every availability answer, so the next ``get()``/``available()`` asks the
    backends again (a device plugged in, a driver restarted, visibility variables changed), and each
    backend forgets what it cached of the device (``Backend.forget_probes``)."""
    _DEFAULT.reprobe()


def kernel_for(backend: Device) -> Kernel:
    """The kernel ``backend`` uses (``AMP_BACKENDS_KERNEL`` forces one)."""
    return _DEFAULT.kernel_for(backend)
