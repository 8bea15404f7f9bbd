"""Terminal output of the CLI, on rich: tables, and a progress bar that becomes plain lines
when the stream is not a terminal (logs, CI, pipes)."""

from __future__ import annotations

import io
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

__all__ = ["ProgressBar", "render_table"]


def _is_tty(stream: TextIO) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def render_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False, right: Sequence[int] = ()
) -> str:
    """A table as text: aligned columns, or a Markdown table (``markdown=True``) to paste into docs.

    Columns whose index is in ``right`` are right-aligned. Styled only when stdout is a terminal.
    """
    table = Table(box=box.MARKDOWN if markdown else box.SIMPLE_HEAD, show_edge=markdown, pad_edge=markdown,
                  header_style="bold" if _is_tty(sys.stdout) else "")
    for i, header in enumerate(headers):
        table.add_column(header, justify="right" if i in right else "left", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    out = io.StringIO()
    Console(file=out, width=1000, force_terminal=_is_tty(sys.stdout), highlight=False).print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()).strip("\n")


class ProgressBar:
    """Progress over ``total`` steps: a live rich bar on a terminal, else one plain line per
    ``line()`` call (the demo calls it once per epoch). ``fields`` is only called when shown,
    so a caller's device reads (``loss.item()``) happen only then."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.live = enabled and _is_tty(self.stream)
        self._last = 0.0
        self._progress: Progress | None = None
        if self.live:
            self._progress = Progress(
                TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
                console=Console(file=self.stream), transient=False,
            )
            self._task = self._progress.add_task("train", total=max(total, 1), info="")
            self._progress.start()

    def update(self, done: int, fields: Callable[[], dict[str, Any]]) -> None:
        """Move the live bar to ``done`` (its text refreshed at most 10 times a second)."""
        if not self.live:
            return
        assert self._progress is not None
        now = time.perf_counter()
        info = None
        if now - self._last >= 0.1:
            self._last = now
            info = " ".join(f"{k}={v}" for k, v in fields().items())
        self._progress.update(self._task, completed=done, **({} if info is None else {"info": info}))

    def line(self, fields: Callable[[], dict[str, Any]]) -> None:
        """Off a terminal, print one ``key=value`` line."""
        if self.enabled and not self.live:
            print(" ".join(f"{k}={v}" for k, v in fields().items()), file=self.stream, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
