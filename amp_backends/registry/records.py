"""What became of each plugin, and the messages that name a plugin and the way out."""

from __future__ import annotations

import difflib
import traceback
from dataclasses import dataclass, field
from typing import Any

from ..errors import BackendUnavailableError, PluginLoadError, UnknownBackendError

__all__ = ["PluginRecord", "duplicate_message", "exit_error", "normalise", "plugin_error", "shadowing_message",
           "unknown_backend"]


def normalise(package: str) -> str:
    """A plugin or distribution name as names are compared (case and ``-``/``_`` alike)."""
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

    def fail(self, exc: BaseException) -> None:
        """Mark the plugin failed with ``exc`` (its traceback kept for ``info -v``)."""
        self.status = "failed"
        self.error = f"{type(exc).__name__}: {exc}"
        self.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))

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


def shadowing_message(key: str, record: PluginRecord, override: bool) -> str:
    """What a third-party registration under a built-in's name did, and how to undo it."""
    who = f"plugin {record.name!r} from {record.package} {record.version}"
    if override:
        return (f"backend {key!r} is {who}, which overrides the built-in {key!r} backend; "
                f"disable it with {record.disable_hint()} to use the built-in")
    return (f"{who} also registers a backend named {key!r} (without override=True); it was ignored and the "
            f"built-in {key!r} is used. Rename that backend, or disable the plugin with {record.disable_hint()}")


def duplicate_message(key: str, records: list[PluginRecord]) -> str:
    owners = " and ".join(f"{r.package} (plugin {r.name!r})" for r in records)
    return (
        f"backend name {key!r} is registered by both {owners}. Uninstall or disable one "
        f"(AMP_BACKENDS_DISABLE_PLUGINS={records[-1].name}), or have the replacement call "
        "register(backend, override=True)."
    )


def exit_error(exc: SystemExit, where: str) -> RuntimeError:
    error = RuntimeError(f"the plugin called sys.exit({exc.code!r}) {where}")
    error.__traceback__ = exc.__traceback__
    return error


def plugin_error(name: str, record: PluginRecord) -> BackendUnavailableError:
    """Backend ``name`` cannot be had because ``record``'s plugin is disabled or failed to load."""
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


def unknown_backend(name: str, key: str, known: list[str], records: list[PluginRecord]) -> Exception:
    """No backend ``name``: its plugin's failure where one of that name did not load, else the known
    names, the closest one, and the plugins that failed."""
    for record in records:
        if key in (record.name.lower(), normalise(record.package)) and record.status != "loaded":
            return plugin_error(name, record)
    close = difflib.get_close_matches(key, known, n=1)
    message = f"unknown backend {name!r}."
    if close:
        message += f" Did you mean {close[0]!r}?"
    message += f" Known backends: {', '.join(known) or '(none)'}."
    broken = [r for r in records if r.status == "failed"]
    if broken:
        message += " Plugins that failed to load: " + "; ".join(
            f"{r.name} ({r.package}): {r.error}" for r in broken
        ) + " (run `amp-backends info`)."
    return UnknownBackendError(message)
