"""How ``pipeline demo`` undoes what it did, in bounded time, also on Ctrl-C.

Everything the demo starts registers its own undo on a :class:`Cleanup` stack the moment
it exists, so an error or Ctrl-C at any step undoes exactly what was done. Undoing has
one time budget, :data:`SHUTDOWN_BUDGET_SECONDS`: every step that waits (threads,
relay and workers, servers) waits at most what is left of it, and then kills instead.
Should the demo itself be killed, its watchdog process (:mod:`pipeline.tools.harness.watchdog`)
kills what it started and deletes its temporary files.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

SHUTDOWN_BUDGET_SECONDS = 8.0


class Cleanup:
    """A stack of undo actions, run newest first, that a second Ctrl-C cannot cut short.

    While :meth:`close` runs, SIGINT and SIGTERM only set :attr:`hurry`: waiting steps
    then stop waiting and kill, so the demo never leaves servers or temp dirs behind.
    """

    def __init__(
        self, report: Callable[[str], None], budget: float = SHUTDOWN_BUDGET_SECONDS
    ) -> None:
        self._actions: list[tuple[str, Callable[[], None]]] = []
        self._report = report
        self._budget = budget
        self._deadline: float | None = None
        self.hurry = threading.Event()

    def push(self, what: str, action: Callable[[], None]) -> None:
        self._actions.append((what, action))

    def remaining(self, cap: float) -> float:
        """Seconds a step may still wait: at most ``cap``, 0 once hurried or out of budget."""
        if self.hurry.is_set():
            return 0.0
        if self._deadline is None:
            return cap
        return max(0.0, min(cap, self._deadline - time.monotonic()))

    def close(self) -> None:
        self._deadline = time.monotonic() + self._budget
        previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous[signum] = signal.signal(signum, self._on_interrupt)
        try:
            while self._actions:
                what, action = self._actions.pop()
                try:
                    action()
                except Exception as exc:  # keep undoing the rest; say what was left over
                    self._report(f"could not {what}: {type(exc).__name__}: {exc}")
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        if not self.hurry.is_set():
            self._report("cleaning up; Ctrl-C again is ignored, processes are now killed")
        self.hurry.set()
