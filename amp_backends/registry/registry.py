"""Finds plugins through the ``amp_backends`` entry-point group and keeps their backends.

Environment:
- ``AMP_BACKEND``: the backend ``get()`` returns when asked for none (or ``"auto"``).
- ``AMP_BACKENDS_DISABLE_PLUGINS``: comma-separated entry-point or distribution names never
  imported (case, ``-`` and ``_`` alike); ``1`` (or ``all``) disables every third-party plugin.
- ``AMP_BACKENDS_PLUGINS``: allow-list; when set to names, only the third-party plugins it names
  are imported (built-in plugins always load unless disabled by name); set but empty, it is ignored.
A name neither variable can match to an installed plugin is warned about.
- ``AMP_BACKENDS_KERNEL``: ``torch``, ``triton`` or another kernel name forces that kernel.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
import sys
import threading
import traceback
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy
import torch

from . import hookspecs
from ..devices.accelerator import available_accelerator_type
from ..backend import Backend, provide
from ..errors import (
    AmpBackendsError,
    BackendUnavailableError,
    DuplicateBackendError,
    PluginLoadError,
    UnknownBackendError,
)
from ..gradients.kernel import TORCH_KERNEL, Kernel, kernel_self_check

__all__ = [
    "PluginRecord",
    "Registry",
    "available",
    "default_registry",
    "get",
    "kernel_for",
    "names",
    "plugins",
    "register_plugin",
    "reload",
    "resolve_backend",
]

ENTRY_POINT_GROUP = "amp_backends"
BUILTIN_PACKAGE = "amp-backends"
_TRUE = {"1", "all", "true", "yes", "*"}


def _env_list(var: str) -> set[str] | None:
    """The names in a comma-separated variable, compared as entry-point names and distribution names
    are (case and ``-``/``_`` alike); None where it is unset or holds no name (``VAR=``)."""
    value = os.environ.get(var)
    if value is None or not value.strip(" ,"):
        return None
    return {_normalise(part.strip()) for part in value.split(",") if part.strip()}


def _normalise(package: str) -> str:
    return package.lower().replace("_", "-")


@dataclass
class PluginRecord:
    """What became of one plugin: loaded, failed (with its error) or disabled."""

    name: str
    package: str
    version: str
    builtin: bool
    module: str = ""
    status: str = "loaded"
    error: str = ""
    traceback: str = ""
    backends: list[str] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)

    def disable_hint(self) -> str:
        return f"AMP_BACKENDS_DISABLE_PLUGINS={self.name}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "package": self.package,
            "version": self.version,
            "builtin": self.builtin,
            "module": self.module,
            "status": self.status,
            "error": self.error,
            "backends": list(self.backends),
            "kernels": list(self.kernels),
        }


class Registry:
    """Backends and kernels registered by plugins, loaded on first use."""

    def __init__(self, group: str = ENTRY_POINT_GROUP) -> None:
        self.group = group
        self._lock = threading.RLock()
        self._loaded = False
        self._extra: list[tuple[object, str, str, str]] = []
        self._reset()

    def _reset(self) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._records: dict[str, PluginRecord] = {}
        self._backends: dict[str, tuple[Backend, PluginRecord, bool]] = {}
        self._duplicates: dict[str, list[PluginRecord]] = {}
        self._kernels: dict[str, tuple[Kernel, PluginRecord]] = {}
        #: backends registered with fallback=True: kept only while no other backend serves their device type
        self._fallbacks: list[tuple[Backend, PluginRecord]] = []
        #: third-party registrations under a built-in's name: (name, plugin, overrides?)
        self._shadowing: list[tuple[str, PluginRecord, bool]] = []
        self._kernel_rejections: dict[tuple[str, str], str] = {}
        self._warned: set[str] = set()

    # -- loading ----------------------------------------------------------------------
    def reload(self) -> None:
        """Forget everything and discover plugins again (re-reading the environment)."""
        with self._lock:
            reprobe()
            self._reset()
            self._loaded = False
            self._ensure_loaded()

    def register_plugin(self, plugin: object, name: str | None = None, package: str = "") -> None:
        """Register an in-process plugin object or module (notebooks, tests)."""
        with self._lock:
            name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
            package = package or name
            self._extra.append((plugin, name, package, ""))
            if self._loaded:
                self._add_plugin(plugin, PluginRecord(name, package, "", builtin=False))
                self._collect([name])

    def unregister_plugin(self, name: str) -> None:
        """Remove an in-process plugin registered with :meth:`register_plugin`."""
        with self._lock:
            self._extra = [e for e in self._extra if e[1] != name]
            self.reload()

    def _ensure_loaded(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            try:
                # a plugin that prints while it loads must not corrupt a caller's stdout (info --json)
                with contextlib.redirect_stdout(sys.stderr):
                    self._load_all()
            except BaseException:  # Ctrl-C while a plugin loads: propagate, and load afresh next time
                self._reset()
                self._loaded = False
                raise

    def _load_all(self) -> None:
        order: list[str] = []
        for ep in self._entry_points():
            record = self._record_for(ep)
            if record.name in self._records:
                continue  # the same distribution seen twice on sys.path
            self._records[record.name] = record
            if record.status == "disabled":
                continue
            try:
                plugin = ep.load()
            except SystemExit as exc:  # a plugin that exits while imported is a broken plugin, not an exit
                self._fail(record, _exit_error(exc, "while being imported"))
                continue
            except Exception as exc:  # noqa: BLE001 - a broken plugin must not break others
                self._fail(record, exc)  # (KeyboardInterrupt goes on to the caller)
                continue
            if self._add_plugin(plugin, record):
                order.append(record.name)
        for plugin, name, package, version in self._extra:
            if self._add_plugin(plugin, PluginRecord(name, package, version, builtin=False)):
                order.append(name)
        self._collect(order)
        self._warn_environment()

    def _warn_environment(self) -> None:
        """A plugin variable naming nothing installed (a typo, an import name), or set but empty, is
        said once per load: it changed nothing the user meant it to."""
        known = {_normalise(k) for r in self._records.values() for k in (r.name, r.package)}
        shown = ", ".join(sorted({r.name for r in self._records.values()}))
        for var in ("AMP_BACKENDS_DISABLE_PLUGINS", "AMP_BACKENDS_PLUGINS"):
            value = os.environ.get(var)
            if value is None:
                continue
            if not value.strip(" ,"):  # an empty allow-list is not "allow none": that is DISABLE_PLUGINS=1
                if var == "AMP_BACKENDS_PLUGINS":
                    warnings.warn(f"{var} is set but empty and is ignored; to load no third-party plugin set "
                                  "AMP_BACKENDS_DISABLE_PLUGINS=1", RuntimeWarning, stacklevel=2)
                continue
            names = _env_list(var) or set()
            unknown = sorted(names - known - (_TRUE if var == "AMP_BACKENDS_DISABLE_PLUGINS" else set()))
            if unknown:
                warnings.warn(f"{var} names {', '.join(map(repr, unknown))}, which no installed plugin is called "
                              f"(by entry-point or distribution name); plugins here: {shown}",
                              RuntimeWarning, stacklevel=2)

    def _entry_points(self) -> list[metadata.EntryPoint]:
        eps = list(metadata.entry_points(group=self.group))
        # Built-ins first, so that a third-party duplicate names the built-in it collides with.
        return sorted(eps, key=lambda ep: (not self._is_builtin(ep), ep.name))

    @staticmethod
    def _is_builtin(ep: metadata.EntryPoint) -> bool:
        dist = getattr(ep, "dist", None)
        return dist is not None and _normalise(dist.metadata["Name"] or "") == BUILTIN_PACKAGE

    def _record_for(self, ep: metadata.EntryPoint) -> PluginRecord:
        dist = getattr(ep, "dist", None)
        package = (dist.metadata["Name"] if dist is not None else None) or "?"
        version = (dist.version if dist is not None else None) or "?"
        record = PluginRecord(ep.name, package, version, self._is_builtin(ep), module=ep.value)
        keys = {_normalise(ep.name), _normalise(package)}
        disabled = _env_list("AMP_BACKENDS_DISABLE_PLUGINS") or set()
        allowed = _env_list("AMP_BACKENDS_PLUGINS")
        if keys & disabled:
            record.status, record.error = "disabled", "disabled by AMP_BACKENDS_DISABLE_PLUGINS"
        elif not record.builtin and disabled & _TRUE:
            record.status, record.error = "disabled", "third-party plugins disabled by AMP_BACKENDS_DISABLE_PLUGINS"
        elif not record.builtin and allowed is not None and not keys & allowed:
            record.status, record.error = "disabled", "not in the AMP_BACKENDS_PLUGINS allow-list"
        return record

    @staticmethod
    def _fail(record: PluginRecord, exc: BaseException) -> None:
        record.status = "failed"
        record.error = f"{type(exc).__name__}: {exc}"
        record.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))

    def _add_plugin(self, plugin: object, record: PluginRecord) -> bool:
        self._records[record.name] = record
        try:
            self._pm.register(plugin, name=record.name)
        except Exception as exc:  # noqa: BLE001
            self._fail(record, exc)
            return False
        return True

    def _collect(self, order: list[str]) -> None:
        """Call each plugin's hooks on its own, so one failing plugin affects no other."""
        for hook_name, adder in (
            ("amp_backends_register_backends", self._add_backend),
            ("amp_backends_register_kernels", self._add_kernel),
        ):
            caller = getattr(self._pm.hook, hook_name)
            impls = {impl.plugin_name: impl for impl in caller.get_hookimpls()}
            for name in order:
                impl = impls.get(name)
                record = self._records[name]
                if impl is None or record.status == "failed":
                    continue
                registrar = _Registrar(adder, record)
                timeout = probe_timeout()
                done, _, error = _bounded(lambda: impl.function(register=registrar), timeout)
                if not done:
                    registrar.closed = True
                    self._fail(record, TimeoutError(f"its {hook_name} hook did not return within {timeout:g} s "
                                                    "(set AMP_BACKENDS_PROBE_TIMEOUT=SECONDS to wait longer)"))
                    self._drop(record)
                elif isinstance(error, SystemExit):
                    self._fail(record, _exit_error(error, f"in its {hook_name} hook"))
                    self._drop(record)
                elif isinstance(error, Exception):
                    self._fail(record, error)
                    self._drop(record)
                elif error is not None:  # KeyboardInterrupt: the caller's to handle
                    raise error
        self._settle_fallbacks()

    def _settle_fallbacks(self) -> None:
        """Keep a fallback backend (the generic one on torch.accelerator) only where no other
        backend serves its device type or takes its name, and no plugin of that name was
        switched off (AMP_BACKENDS_DISABLE_PLUGINS=cuda means no cuda, not a generic one)."""
        fallbacks = {id(b) for b, _ in self._fallbacks}
        for backend, record in self._fallbacks:
            key = backend.name.lower()
            switched_off = any(  # its own plugin is installed but disabled or broken: not taken over
                r.status != "loaded" and r.name.lower() in (key, backend.device_type) for r in self._records.values()
            )
            claimed = switched_off or key in self._duplicates or any(
                id(b) not in fallbacks and (b.device_type == backend.device_type or k == key)
                for k, (b, _, _) in self._backends.items()
            )
            if claimed:
                if self._backends.get(key, (None,))[0] is backend:
                    del self._backends[key]
                if key in record.backends:
                    record.backends.remove(key)
            elif key not in self._backends:
                self._backends[key] = (backend, record, False)
                record.backends.append(key)

    def _drop(self, record: PluginRecord) -> None:
        self._fallbacks = [(b, r) for b, r in self._fallbacks if r is not record]
        for key in [k for k, (_, rec, _) in self._backends.items() if rec is record]:
            del self._backends[key]
        for key in [k for k, (_, rec) in self._kernels.items() if rec is record]:
            del self._kernels[key]
        self._pm.unregister(name=record.name)

    def _add_backend(self, record: PluginRecord, backend: Backend, override: bool = False,
                     fallback: bool = False) -> None:
        if not isinstance(backend, Backend):
            raise TypeError(
                f"register() takes an amp_backends.Backend instance, got {type(backend).__name__}"
            )
        _check_backend_fields(backend)
        if fallback:
            if override:
                raise ValueError("register(backend, override=True, fallback=True): a fallback never overrides; "
                                 "pass one of them")
            self._fallbacks.append((backend, record))  # placed by _settle_fallbacks, after every plugin
            return
        key = backend.name.lower()
        record.backends.append(key)
        if key in self._duplicates:
            self._duplicates[key].append(record)
            return
        existing = self._backends.get(key)
        if existing is not None and any(existing[0] is b for b, _ in self._fallbacks):
            del self._backends[key]  # a fallback yields to any backend of its name
            existing[1].backends.remove(key)
            existing = None
        if existing is not None and existing[1].builtin and not record.builtin:
            self._shadowing.append((key, record, override))
            if not override:
                return  # the built-in stays; get() and info name the plugin that tried
        if existing is None or override:
            self._backends[key] = (backend, record, override)
        elif existing[2]:
            return  # the one already here explicitly overrides
        else:
            self._duplicates[key] = [existing[1], record]
            del self._backends[key]

    def _add_kernel(self, record: PluginRecord, kernel: Kernel) -> None:
        if not isinstance(kernel, Kernel):
            raise TypeError(f"register() takes an amp_backends.Kernel instance, got {type(kernel).__name__}")
        key = kernel.name.lower()
        if key == TORCH_KERNEL.name or key in self._kernels:
            owner = "amp-backends" if key == TORCH_KERNEL.name else self._kernels[key][1].package
            raise DuplicateBackendError(f"kernel name {key!r} is already registered by {owner}")
        self._kernels[key] = (kernel, record)
        record.kernels.append(key)

    # -- queries ----------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every registered backend name, available or not."""
        self._ensure_loaded()
        return sorted(self._backends)

    def available(self) -> list[str]:
        """Names of the backends usable on this machine, best first."""
        self._ensure_loaded()
        usable = [b for b, _, _ in self._backends.values() if _safe_available(b)]
        return [b.name for b in sorted(usable, key=lambda b: (-b.priority, b.name))]

    def plugins(self) -> list[PluginRecord]:
        """Every plugin seen: loaded, failed or disabled."""
        self._ensure_loaded()
        return list(self._records.values())

    def backends(self) -> list[tuple[Backend, PluginRecord]]:
        """Every registered backend with the plugin that registered it."""
        self._ensure_loaded()
        return [(b, rec) for _, (b, rec, _) in sorted(self._backends.items())]

    def duplicates(self) -> dict[str, list[PluginRecord]]:
        self._ensure_loaded()
        return dict(self._duplicates)

    def kernels(self) -> dict[str, Kernel]:
        self._ensure_loaded()
        return {TORCH_KERNEL.name: TORCH_KERNEL, **{k: v for k, (v, _) in self._kernels.items()}}

    def get(self, name: str | None = None) -> Backend:
        """The backend called ``name``; the best available one for None or ``"auto"``."""
        self._ensure_loaded()
        if name is None or (isinstance(name, str) and name.strip().lower() == "auto"):
            chosen = os.environ.get("AMP_BACKEND", "").strip()
            if chosen and chosen.lower() != "auto":
                try:
                    return self.get(chosen)
                except AmpBackendsError as exc:  # the same error, naming where the name came from
                    raise type(exc)(f"AMP_BACKEND={chosen!r} cannot be used: {str(exc).rstrip('.')}. Unset "
                                    "AMP_BACKEND to use the best available backend") from None
            usable = self.available()
            if not usable:
                reasons = "; ".join(f"{n}: {probe(b)}" for n, (b, _, _) in sorted(self._backends.items()))
                raise BackendUnavailableError(f"no backend is available ({reasons or 'none registered'})")
            best = usable[0].lower()
            self._warn_shadowing(best)
            chosen_backend = self._backends[best][0]
            self._warn_stand_in(chosen_backend)
            if chosen_backend.device_type == "cpu":
                self._warn_unused_accelerator()
            return chosen_backend
        if not isinstance(name, str):
            raise TypeError(f"backend name must be a string, got {type(name).__name__}")
        key = name.strip().lower()
        if key in self._duplicates:
            raise DuplicateBackendError(_duplicate_message(key, self._duplicates[key]))
        entry = self._backends.get(key)
        if entry is None:
            raise self._missing(name, key)
        backend = entry[0]
        reason = probe(backend)
        if reason is not None:
            raise BackendUnavailableError(f"backend {backend.name!r} is not available: {reason}")
        self._warn_shadowing(key)
        self._warn_stand_in(backend)
        return backend

    def _warn_stand_in(self, backend: Backend) -> None:
        """The generic backend serving a device while a third-party plugin is switched off or broken:
        that plugin may be the device's own (its entry-point name need not be the device type), so
        say once that torch's generic path stands in, rather than replace it silently."""
        key = f"stand-in:{backend.device_type}"
        if key in self._warned or not any(b is backend for b, _ in self._fallbacks):
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
        serving = [b for _, (b, _, _) in sorted(self._backends.items()) if b.device_type == device_type]
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
        return list(self._shadowing)

    def _warn_shadowing(self, key: str) -> None:
        for name, record, override in self._shadowing:
            if name != key or key in self._warned:
                continue
            self._warned.add(key)
            warnings.warn(shadowing_message(name, record, override), RuntimeWarning, stacklevel=4)

    def for_device_type(self, device_type: str) -> Backend:
        """The backend serving torch device type ``device_type`` (the one of that name first)."""
        self._ensure_loaded()
        if device_type in self._backends or device_type in self._duplicates:
            return self.get(device_type)
        matching = [b for _, (b, _, _) in sorted(self._backends.items()) if b.device_type == device_type]
        usable = [b for b in matching if _safe_available(b)]
        if usable:
            return self.get(usable[0].name)
        if matching:
            return self.get(matching[0].name)  # raises, saying why it is unavailable
        types = sorted({b.device_type for _, (b, _, _) in self._backends.items()})
        raise UnknownBackendError(
            f"no backend serves device type {device_type!r}; backends exist for: {', '.join(types) or '(none)'}. "
            "Install the plugin for that device, or pass a backend name."
        )

    def _missing(self, name: str, key: str) -> Exception:
        for record in self._records.values():
            if key in (record.name.lower(), _normalise(record.package)) and record.status != "loaded":
                return _plugin_error(name, record)
        known = sorted(self._backends)
        close = difflib.get_close_matches(key, known, n=1)
        message = f"unknown backend {name!r}."
        if close:
            message += f" Did you mean {close[0]!r}?"
        message += f" Known backends: {', '.join(known) or '(none)'}."
        broken = [r for r in self._records.values() if r.status == "failed"]
        if broken:
            message += " Plugins that failed to load: " + "; ".join(
                f"{r.name} ({r.package}): {r.error}" for r in broken
            ) + " (run `amp-backends info`)."
        return UnknownBackendError(message)

    def kernel_for(self, backend: Backend) -> Kernel:
        """The kernel ``backend`` runs its gradient ops on."""
        self._ensure_loaded()
        device_type = backend.device_type
        forced = os.environ.get("AMP_BACKENDS_KERNEL", "").strip().lower()
        if forced and forced != "auto":
            kernels = self.kernels()
            if forced not in kernels:
                raise BackendUnavailableError(
                    f"AMP_BACKENDS_KERNEL={forced!r} names no registered kernel; "
                    f"known: {', '.join(sorted(kernels))}. Unset it to choose automatically."
                )
            kernel = kernels[forced]
            reason = kernel.unavailable_reason(device_type)
            if reason is None and kernel is not TORCH_KERNEL:
                problem = _timed_self_check(kernel, backend)
                reason = None if problem is None else f"it failed its self-check ({problem})"
            if reason is not None:
                raise BackendUnavailableError(
                    f"AMP_BACKENDS_KERNEL={forced!r} cannot run on {device_type!r}: {reason}. "
                    "Unset it, or set it to 'torch'."
                )
            return kernel
        candidates = sorted(self._kernels.values(), key=lambda kr: -kr[0].priority)
        for kernel, record in candidates:
            try:
                if not kernel.auto_select(device_type):
                    continue
            except Exception:  # noqa: BLE001 - a broken kernel falls back to torch's
                continue
            if probe(backend) is not None:
                return kernel  # no device to check it on; the backend cannot run gradient ops anyway
            if self._self_check(kernel, record, backend) is None:
                return kernel
        return TORCH_KERNEL

    def _self_check(self, kernel: Kernel, record: PluginRecord, backend: Backend) -> str | None:
        """Run the kernel's ops on small tensors of the backend's device against torch's: a kernel
        that raises, misses an inf/NaN, writes when it should only read, or gets a value wrong is
        not adopted (the reason is kept for ``info``)."""
        key = (kernel.name, backend.device_type)
        if key in self._kernel_rejections:
            return self._kernel_rejections[key]
        problem = _timed_self_check(kernel, backend)
        if problem is None:
            return None
        message = (f"kernel {kernel.name!r} from {record.package} failed its self-check on {backend.device_type} "
                   f"({problem}); torch's kernel is used instead")
        self._kernel_rejections[key] = message
        warnings.warn(message, RuntimeWarning, stacklevel=4)
        return message

    def kernel_rejections(self, device_type: str) -> list[str]:
        """Why kernels were not adopted for ``device_type`` (failed self-checks)."""
        return [m for (_, dev), m in self._kernel_rejections.items() if dev == device_type]


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


def _bounded(fn: Callable[[], Any], timeout: float) -> tuple[bool, Any, BaseException | None]:
    """Run ``fn`` in a daemon thread for at most ``timeout`` seconds: (finished, result, exception).
    Whatever it raises (KeyboardInterrupt and SystemExit too) comes back to the caller."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((fn(), None))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out.append((None, exc))

    thread = threading.Thread(target=run, name="amp-backends plugin call", daemon=True)
    thread.start()
    thread.join(timeout)
    if not out:
        return False, None, None
    return True, out[0][0], out[0][1]


#: Names ``get()`` gives a meaning of its own: no backend may take them.
_RESERVED_NAMES = ("auto",)


def _check_backend_fields(backend: Backend) -> None:
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
    if not isinstance(backend.default_dtype, torch.dtype) or not backend.default_dtype.is_floating_point:
        raise TypeError(f"{cls}.default_dtype must be a floating torch.dtype (torch.float16, torch.bfloat16), "
                        f"got {type(backend.default_dtype).__name__} {backend.default_dtype!r}")


#: Backends whose probe did not return in time: the reason, so a hang costs its wait once.
_HUNG: dict[int, str] = {}
#: Each backend's availability answer, kept for the process (per instance: reload() makes new ones).
_PROBED: weakref.WeakKeyDictionary[Backend, str | None] = weakref.WeakKeyDictionary()


#: The longest probe timeout accepted (an hour): threading's wait refuses much larger numbers.
_MAX_PROBE_TIMEOUT = 3600.0


def probe_timeout() -> float:
    """Seconds an availability probe may take (``AMP_BACKENDS_PROBE_TIMEOUT``, default 10); a
    value that is not a number of seconds in (0, 3600] is refused, naming the variable."""
    raw = os.environ.get("AMP_BACKENDS_PROBE_TIMEOUT", "").strip()
    if not raw:
        return 10.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 < value <= _MAX_PROBE_TIMEOUT):
        raise AmpBackendsError(
            f"AMP_BACKENDS_PROBE_TIMEOUT={raw!r} must be a number of seconds in (0, {_MAX_PROBE_TIMEOUT:g}]; "
            "unset it for the default (10)"
        )
    return value


def probe(backend: Backend) -> str | None:
    """Why ``backend`` cannot be used, or None when it can.

    ``is_available()`` (then ``unavailable_reason()``) runs in a daemon thread for at most
    :func:`probe_timeout` seconds: a hung driver query makes the backend unavailable, with that
    reason, instead of hanging ``get()``. It must return a bool; anything else is a reason too.
    """
    hung = _HUNG.get(id(backend))
    if hung is not None:
        return hung
    try:
        return _PROBED[backend]
    except (KeyError, TypeError):
        pass
    cls = type(backend).__name__
    answer: list[str | None] = []

    def ask() -> None:
        asking = "is_available()"
        try:
            ok = backend.is_available()
            if not isinstance(ok, bool):
                answer.append(f"{cls}.is_available() returned {type(ok).__name__} {ok!r}, not True or False")
            elif ok:
                asking = "supported_dtypes()"  # what get()'s callers use next: broken means unusable
                dtypes = backend.supported_dtypes()
                if not isinstance(dtypes, tuple) or not dtypes or not all(isinstance(d, torch.dtype) for d in dtypes):
                    answer.append(f"{cls}.supported_dtypes() returned {dtypes!r}, not a non-empty tuple of torch dtypes")
                else:
                    answer.append(None)
            else:  # the base class's unavailable_reason() would only ask is_available() again
                own = type(backend).unavailable_reason is not Backend.unavailable_reason
                reason = backend.unavailable_reason() if own else None
                answer.append(str(reason) if reason else f"{cls}.is_available() returned False")
        except Exception as exc:  # noqa: BLE001 - a failing probe is a reason, not a crash
            answer.append(f"{cls}.{asking} raised {type(exc).__name__}: {exc}")

    timeout = probe_timeout()
    thread = threading.Thread(target=ask, name=f"amp-backends probe {backend.name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if not answer:
        _HUNG[id(backend)] = (
            f"{cls}.is_available() did not return within {timeout:g} s (a hung driver or device query?); "
            "set AMP_BACKENDS_PROBE_TIMEOUT=SECONDS to wait longer"
        )
        return _HUNG[id(backend)]
    try:
        _PROBED[backend] = answer[0]  # asked once per process: amp_backends.reprobe() asks again
    except TypeError:  # an object that cannot be weakly referenced: not cached
        pass
    return answer[0]


def reprobe() -> None:
    """Forget every availability answer, so the next ``get()``/``available()`` asks the
    backends again (a device plugged in, a driver restarted, visibility variables changed), and each
    backend forgets what it cached of the device (``Backend.forget_probes``)."""
    known = [b for b, _, _ in _DEFAULT._backends.values()] + [b for b, _ in _DEFAULT._fallbacks]
    for backend in {id(b): b for b in [*_PROBED.keys(), *known]}.values():
        with contextlib.suppress(Exception):  # a plugin's broken override costs only its own cache
            backend.forget_probes()
    _PROBED.clear()
    _HUNG.clear()


def _timed_self_check(kernel: Kernel, backend: Backend) -> str | None:
    """The kernel self-check, bounded in time like a probe: a kernel op that hangs is a problem."""
    timeout = probe_timeout()
    device = backend.device()
    module = getattr(torch, device.type, None)
    if device.index is None and device.type != "cpu" and callable(getattr(module, "current_device", None)):
        with contextlib.suppress(Exception):  # the caller's current device (a DDP rank's), not the thread's default
            device = torch.device(device.type, int(module.current_device()))
    use = getattr(module, "device", None) if device.index is not None else None

    def check() -> str | None:
        with use(device.index) if callable(use) else contextlib.nullcontext():
            return kernel_self_check(kernel, device)

    done, problem, error = _bounded(check, timeout)
    if not done:
        return f"its ops did not finish within {timeout:g} s"
    if error is not None:
        if not isinstance(error, Exception):
            raise error
        return f"raised {type(error).__name__}: {error}"
    return problem


def _exit_error(exc: SystemExit, where: str) -> RuntimeError:
    error = RuntimeError(f"the plugin called sys.exit({exc.code!r}) {where}")
    error.__traceback__ = exc.__traceback__
    return error


def _safe_available(backend: Backend) -> bool:
    return probe(backend) is None



def _plugin_error(name: str, record: PluginRecord) -> BackendUnavailableError:
    if record.status == "disabled":
        return BackendUnavailableError(
            f"backend {name!r}: plugin {record.name!r} (package {record.package}) is {record.error}; "
            "remove it from that variable to load it."
        )
    return PluginLoadError(
        f"backend {name!r}: plugin {record.name!r} from package {record.package} {record.version} "
        f"failed to load: {record.error}. Fix or reinstall that package, or disable the plugin "
        f"with {record.disable_hint()} (`amp-backends info` shows the traceback)."
    )


def shadowing_message(key: str, record: PluginRecord, override: bool) -> str:
    """What a third-party registration under a built-in's name did, and how to undo it."""
    who = f"plugin {record.name!r} from {record.package} {record.version}"
    if override:
        return (f"backend {key!r} is {who}, which overrides the built-in {key!r} backend; "
                f"disable it with {record.disable_hint()} to use the built-in")
    return (f"{who} also registers a backend named {key!r} (without override=True); it was ignored and the "
            f"built-in {key!r} is used. Rename that backend, or disable the plugin with {record.disable_hint()}")


def _duplicate_message(key: str, records: list[PluginRecord]) -> str:
    owners = " and ".join(f"{r.package} (plugin {r.name!r})" for r in records)
    return (
        f"backend name {key!r} is registered by both {owners}. Uninstall or disable one "
        f"(AMP_BACKENDS_DISABLE_PLUGINS={records[-1].name}), or have the replacement call "
        "register(backend, override=True)."
    )


_DEFAULT = Registry()


def default_registry() -> Registry:
    """The process-wide registry the module-level functions use."""
    return _DEFAULT


def get(name: str | None = None) -> Backend:
    """A backend by name; the best available one for None or ``"auto"`` (``AMP_BACKEND`` overrides)."""
    return _DEFAULT.get(name)


def resolve_backend(backend: str | Backend | Any = None, device: str | Any = None) -> Backend:
    """What an API taking ``backend`` (and torch's ``device=``) means: a Backend, a backend
    name, a ``torch.device`` or device-type string, or None for the best available."""
    import torch

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
    if backend is None or isinstance(backend, Backend):
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


def kernel_for(backend: Backend) -> Kernel:
    """The kernel ``backend`` uses (``AMP_BACKENDS_KERNEL`` forces one)."""
    return _DEFAULT.kernel_for(backend)


provide("kernel", kernel_for)  # Backend.kernel asks the registry without importing it
