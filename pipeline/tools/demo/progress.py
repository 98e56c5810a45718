"""What the demo says while it runs: step lines and a progress bar, both on stderr.

stdout is kept for the summary (and with ``--json`` for the JSON document alone). The
bar is a single ``\\r``-rewritten line, drawn only when stderr is a terminal.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from typing import TextIO

BAR_WIDTH = 24


@dataclass
class Snapshot:
    total: int
    placed: int
    charged: int
    reserved: int
    confirmed: int
    dead: int
    duplicates: int
    elapsed: float


class Console:
    def __init__(self, quiet: bool, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.bar = not quiet and self.stream.isatty()
        self._drawn = False
        self._last_line = 0.0

    def step(self, message: str) -> None:
        """A line about what the demo does now (silent with --json)."""
        if not self.quiet:
            self._clear()
            self.stream.write(f"demo: {message}\n")
            self.stream.flush()

    def warn(self, message: str) -> None:
        """A line that is shown even with --json (stderr only)."""
        self._clear()
        self.stream.write(f"demo: {message}\n")
        self.stream.flush()

    def progress(self, snap: Snapshot) -> None:
        if self.bar:
            self._draw(snap)
        elif not self.quiet and time.monotonic() - self._last_line >= 5.0:
            self._last_line = time.monotonic()  # no terminal: a plain line every 5 s
            self.stream.write(f"demo: {self._text(snap)}\n")
            self.stream.flush()

    def done(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

    def _draw(self, snap: Snapshot) -> None:
        width = shutil.get_terminal_size((100, 20)).columns - 1
        line = self._text(snap)[:width]
        self.stream.write("\r" + line.ljust(width))
        self.stream.flush()
        self._drawn = True

    @staticmethod
    def _text(snap: Snapshot) -> str:
        done = snap.confirmed + snap.dead
        filled = int(BAR_WIDTH * done / snap.total) if snap.total else BAR_WIDTH
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        return (
            f"[{bar}] {done}/{snap.total} orders done  placed {snap.placed}  "
            f"charged {snap.charged}  reserved {snap.reserved}  confirmed {snap.confirmed}  "
            f"dead-lettered {snap.dead}  duplicates sent {snap.duplicates}  {snap.elapsed:.1f}s"
        )

    def _clear(self) -> None:
        if self._drawn:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self.stream.write("\r" + " " * width + "\r")
            self._drawn = False
