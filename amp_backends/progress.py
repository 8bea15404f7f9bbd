"""A one-line progress bar on stderr (redrawn in place on a terminal, one line per update otherwise)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Shows ``done/total`` with a bar and key=value fields."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True, every: float = 0.1) -> None:
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every if self.tty else 2.0
        self._last = 0.0

    def update(self, done: int, force: bool = False, **fields: object) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < self.every and done < self.total:
            return
        self._last = now
        width = 24
        filled = int(width * done / self.total)
        bar = "#" * filled + "." * (width - filled)
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        line = f"[{bar}] {done}/{self.total} {text}"
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
