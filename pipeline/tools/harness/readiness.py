"""Waiting for child processes to become ready, bounded by their progress, not by a clock.

A relay or worker that starts on a busy machine may take minutes to import its modules
and connect, and still be healthy: a fixed limit then fails a good run. So a wait goes on
while the children it waits for are alive and moving (their CPU time, their children's
included, or their logs grow), and gives up as soon as one of them died, or when none of
them moved for ``stall_seconds``. One child hung while the others keep moving (idle
workers use CPU too) would keep such a wait going, so a ceiling of ten minutes still
applies: far beyond any start seen on a loaded machine. Waiting for processes the caller
did not start (the demo's ``--external``), there is nothing to watch, and a fixed limit
of a minute applies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pipeline.tools.harness.fleet import Child

STALL_SECONDS = 60.0
UNWATCHED_LIMIT_SECONDS = 60.0
CEILING_SECONDS = 600.0
TICK = 0.1
SAMPLE_SECONDS = 1.0  # how often the children's activity is read (it walks /proc)


def wait_ready(
    ready: Callable[[], bool],
    children: Sequence[Child],
    *,
    died: Callable[[Child], BaseException],
    stalled: Callable[[str], BaseException],
    check: Callable[[], None] | None = None,
    stall_seconds: float = STALL_SECONDS,
    limit: float = UNWATCHED_LIMIT_SECONDS,
    ceiling: float = CEILING_SECONDS,
    tick: float = TICK,
) -> float:
    """Wait until ``ready()``; returns the seconds waited.

    Raises ``died(child)`` when a child exits, ``stalled(why)`` when none of
    ``children`` moved for ``stall_seconds`` (or, without children, after ``limit``), and
    after ``ceiling`` in any case.
    ``check`` runs on every tick first (a stop request raises from there).
    """
    began = time.monotonic()
    moved = sampled = began
    seen: tuple[tuple[int, int], ...] | None = None
    while True:
        if check is not None:
            check()
        for child in children:
            if not child.running():
                raise died(child)
        if ready():
            return time.monotonic() - began
        now = time.monotonic()
        if now - began > (ceiling if children else limit):
            raise stalled(f"not ready after {now - began:.0f} s")
        if children and (seen is None or now - sampled >= SAMPLE_SECONDS):
            sampled = now
            activity = tuple(child.activity() for child in children)
            if activity != seen:
                seen, moved = activity, now
            elif now - moved > stall_seconds:
                raise stalled(f"alive but nothing moved for {now - moved:.0f} s")
        time.sleep(tick)
