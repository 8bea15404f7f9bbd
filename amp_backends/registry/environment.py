"""The environment variables that steer discovery, read in one place.

- ``AMP_BACKEND``: the backend ``get()`` returns when asked for none (or ``"auto"``).
- ``AMP_BACKENDS_DISABLE_PLUGINS``: comma-separated entry-point or distribution names never
  imported (case, ``-`` and ``_`` alike); ``1`` (or ``all``) disables every third-party plugin.
- ``AMP_BACKENDS_PLUGINS``: allow-list; when set to names, only the third-party plugins it names
  are imported (built-in plugins always load unless disabled by name); set but empty, it is ignored.
  A name neither variable can match to an installed plugin is warned about.
- ``AMP_BACKENDS_KERNEL``: ``torch``, ``triton`` or another kernel name forces that kernel.
- ``AMP_BACKENDS_PROBE_TIMEOUT``: seconds an availability probe or a plugin's hook may take.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable

from ..errors import AmpBackendsError
from .records import PluginRecord, normalise

__all__ = ["chosen_backend", "disabled_reason", "forced_kernel", "probe_timeout", "warn_unmatched"]

_TRUE = {"1", "all", "true", "yes", "*"}
#: The longest probe timeout accepted (an hour): threading's wait refuses much larger numbers.
_MAX_PROBE_TIMEOUT = 3600.0


def _env_list(var: str) -> set[str] | None:
    """The names in a comma-separated variable, compared as entry-point names and distribution names
    are; None where it is unset or holds no name (``VAR=``)."""
    value = os.environ.get(var)
    if value is None or not value.strip(" ,"):
        return None
    return {normalise(part.strip()) for part in value.split(",") if part.strip()}


def disabled_reason(record: PluginRecord) -> str | None:
    """Why the variables keep ``record``'s plugin from being imported, or None."""
    keys = {normalise(record.name), normalise(record.package)}
    disabled = _env_list("AMP_BACKENDS_DISABLE_PLUGINS") or set()
    allowed = _env_list("AMP_BACKENDS_PLUGINS")
    if keys & disabled:
        return "disabled by AMP_BACKENDS_DISABLE_PLUGINS"
    if not record.builtin and disabled & _TRUE:
        return "third-party plugins disabled by AMP_BACKENDS_DISABLE_PLUGINS"
    if not record.builtin and allowed is not None and not keys & allowed:
        return "not in the AMP_BACKENDS_PLUGINS allow-list"
    return None


def warn_unmatched(records: Iterable[PluginRecord]) -> None:
    """A plugin variable naming nothing installed (a typo, an import name), or set but empty, is
    said once per load: it changed nothing the user meant it to."""
    records = list(records)
    known = {normalise(k) for r in records for k in (r.name, r.package)}
    shown = ", ".join(sorted({r.name for r in records}))
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


def chosen_backend() -> str | None:
    """The backend ``AMP_BACKEND`` names, or None (unset, empty or ``auto``)."""
    chosen = os.environ.get("AMP_BACKEND", "").strip()
    return chosen if chosen and chosen.lower() != "auto" else None


def forced_kernel() -> str | None:
    """The kernel ``AMP_BACKENDS_KERNEL`` forces (lower case), or None (unset, empty or ``auto``)."""
    forced = os.environ.get("AMP_BACKENDS_KERNEL", "").strip().lower()
    return forced if forced and forced != "auto" else None


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
