"""Python-level calls counted by the interpreter's profiler, for the tests of host cost: work done per
parameter or per tensor in Python shows as a count that grows with them, on any machine and load."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Any


def python_events(fn: Callable[[], Any]) -> int:
    """The calls ``fn()`` makes: Python frames entered and builtins called from Python. The collector is
    run first and kept off during the count: a collection would run other objects' finalizers and weakref
    callbacks (an earlier test's garbage) inside it."""
    count = [0]

    def tally(frame, event, arg):  # noqa: ANN001, ANN202
        if event in ("call", "c_call"):
            count[0] += 1

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    sys.setprofile(tally)
    try:
        fn()
    finally:
        sys.setprofile(None)
        if enabled:
            gc.enable()
    return count[0]
