"""Exceptions raised by amp_backends; each message says what went wrong and what to do."""

from __future__ import annotations


class AmpBackendsError(Exception):
    """Base class of every error amp_backends raises."""


class UnknownBackendError(AmpBackendsError, LookupError):
    """No backend of that name is registered."""

    def __str__(self) -> str:  # LookupError would repr() the message
        return str(self.args[0]) if self.args else ""


class BackendUnavailableError(AmpBackendsError, RuntimeError):
    """The backend is registered but cannot run on this machine."""


class PluginLoadError(BackendUnavailableError):
    """The plugin that provides a backend failed to import or to register."""


class DuplicateBackendError(AmpBackendsError, ValueError):
    """Two plugins registered a backend under the same name."""


class UnsupportedDtypeError(AmpBackendsError, ValueError):
    """An autocast dtype the backend does not support."""


class StateDictError(AmpBackendsError, ValueError):
    """A GradScaler state_dict that cannot be loaded."""


class PerformanceWarning(UserWarning):
    """Mixed precision that will run slower here than float32 (an emulated dtype)."""


def first_line(text: object) -> str:
    """The first line of ``text`` (an exception's message), stripped; "" where it has none."""
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""
