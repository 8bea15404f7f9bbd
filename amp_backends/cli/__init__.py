"""The ``amp-backends`` command and the tools behind it: ``demo``, ``bench``, ``info``, ``check``.

Owns the command line (:mod:`.main`) and each command's module.

May import: :mod:`amp_backends.inspector`, :mod:`amp_backends.memory`, :mod:`amp_backends.precision`,
:mod:`amp_backends.checkpoint`, :mod:`amp_backends.backend`, :mod:`amp_backends.extension`, :mod:`amp_backends.registry`,
:mod:`amp_backends.devices`, :mod:`amp_backends.console`, :mod:`amp_backends.errors`,
:mod:`amp_backends.patches`, :mod:`amp_backends.torch_private` and torch (application code: nothing in the
package imports it).
"""

from __future__ import annotations

from .main import main

__all__ = ["main"]
