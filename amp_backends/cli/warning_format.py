"""How the command prints warnings: the package's own in its own words, everyone else's as Python does.

``amp-backends: warning: MESSAGE`` is for a warning the package itself issues (a ``warnings.warn`` call in
amp_backends' code). Other libraries' warnings, including the ones they issue while the package imports
or calls them (a SyntaxWarning from compiling their source, a torch op's C++ warning), keep Python's
format, which names their file and category.
"""

from __future__ import annotations

import linecache
import sys
import warnings
from types import FrameType

__all__ = ["format_warning", "is_own_warning"]

#: Python's own formatter, as it was when the command started.
_PYTHON_FORMAT = warnings.formatwarning
_PACKAGE = __name__.split(".")[0]
#: The warnings machinery between a ``warnings.warn`` call and the formatter (and this module).
_MACHINERY = ("warnings", "logging", __name__)


def _issuer(frame: FrameType | None) -> FrameType | None:
    """The frame that issued the warning being formatted: the first one outside the machinery."""
    while frame is not None and frame.f_globals.get("__name__") in _MACHINERY:
        frame = frame.f_back
    return frame


def _calls_warn(frame: FrameType) -> bool:
    """Whether ``frame`` is in a ``warnings.warn(...)`` call of its own source (rather than in a call into
    a library, or an import, whose C code issued the warning)."""
    positions = list(frame.f_code.co_positions())
    index = frame.f_lasti // 2
    line, _, column, _ = positions[index] if 0 <= index < len(positions) else (None, None, None, None)
    if line is None:
        return False
    text = linecache.getline(frame.f_code.co_filename, line)[column or 0:]
    return text.startswith(("warnings.warn(", "warn("))


def is_own_warning(frame: FrameType | None = None) -> bool:
    """Whether the warning being formatted was issued by amp_backends' own code (from inside the
    formatter: ``frame`` defaults to its caller's)."""
    issuer = _issuer(frame if frame is not None else sys._getframe(1))
    if issuer is None:
        return False
    module = str(issuer.f_globals.get("__name__", ""))
    return (module == _PACKAGE or module.startswith(_PACKAGE + ".")) and _calls_warn(issuer)


def format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                   line: str | None = None) -> str:
    """``warnings.formatwarning`` for the command: the package's own warnings as one line of its words
    (no source line of the package's code), anyone else's in Python's format."""
    if is_own_warning(sys._getframe(1)):
        return f"amp-backends: warning: {message}\n"
    return _PYTHON_FORMAT(message, category, filename, lineno, line)
