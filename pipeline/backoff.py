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
