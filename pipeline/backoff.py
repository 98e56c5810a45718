"""Exponential backoff with full jitter (AWS Architecture Blog, "Exponential Backoff and Jitter").

Full jitter spreads retries of many failing events uniformly over the window, so a
recovering dependency is not hit by synchronized waves of retries.
"""

from __future__ import annotations

import random


def backoff_ceiling(attempt: int, base: float, cap: float) -> float:
    """The upper bound of the delay after ``attempt`` failures (1-based): min(cap, base*2^(n-1))."""
    exponent = min(max(attempt - 1, 0), 62)
    return min(cap, base * (2.0**exponent))


def full_jitter(attempt: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """A delay drawn uniformly from [0, backoff_ceiling(attempt)]."""
    return (rng or random).uniform(0.0, backoff_ceiling(attempt, base, cap))


class Backoff:
    """Growing waits between tries of a dependency that is down: ``first``, doubling, capped.

    No jitter, so that an operator reading the log sees each wait grow; a process has one
    of these per dependency, which keeps retries of a fleet to one per process per step.
    """

    def __init__(self, first: float, cap: float) -> None:
        self.first = first
        self.cap = max(cap, first)
        self.failures = 0

    def next_delay(self) -> float:
        """Count a failed try and return how long to wait before the next one."""
        self.failures += 1
        return backoff_ceiling(self.failures, self.first, self.cap)

    def reset(self) -> bool:
        """Forget past failures; returns whether there were any (a recovery to report)."""
        failed, self.failures = self.failures > 0, 0
        return failed
