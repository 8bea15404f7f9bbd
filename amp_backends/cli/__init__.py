"""The ``amp-backends`` command and the tools behind it: ``demo``, ``bench``, ``info``, ``check``.

Owns the command line (:mod:`.main`) and each command's module.

May import: anything in the package (it is application code); nothing in the package imports it.
"""

from __future__ import annotations

from .main import main

__all__ = ["main"]
