"""Test-only hooks, for fault tests that need a process stopped at an exact point.

Nothing here runs unless its environment variable is set; never set one in production.

``PIPELINE_TEST_PAUSE_BEFORE_COMMIT`` names a trigger file. While it is set, a relay
settles every batch as one explicit transaction (as it does whenever a batch has more
than one outcome), and when the trigger file exists right after the sent mark has run,
the process removes the file and stops itself with ``SIGSTOP``: it holds the sent
events' row locks, its connection ``active``, until someone sends it ``SIGCONT``. One
trigger file, one pause; the test creates the file when it wants the pause.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

PAUSE_BEFORE_COMMIT = "PIPELINE_TEST_PAUSE_BEFORE_COMMIT"


def pause_before_commit() -> Callable[[], None] | None:
    """The pause hook when the test variable is set, else None (the normal path)."""
    trigger = os.environ.get(PAUSE_BEFORE_COMMIT)
    if not trigger:
        return None

    def pause() -> None:
        try:
            os.unlink(trigger)  # atomic: of several threads, one pauses
        except FileNotFoundError:
            return
        os.kill(os.getpid(), signal.SIGSTOP)

    return pause
