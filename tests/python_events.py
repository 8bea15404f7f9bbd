"""Python-level calls counted by the interpreter's profiler, for the tests of host cost: work done per
parameter or per tensor in Python shows as a count that grows with them, on any machine and load."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def python_events(fn: Callable[[], Any]) -> int:
    """The calls ``fn()`` makes: Python frames entered and builtins called from Python."""
    count = [0]

    def tally(frame, event, arg):  # noqa: ANN001, ANN202
        if event in ("call", "c_call"):
            count[0] += 1

    sys.setprofile(tally)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]
