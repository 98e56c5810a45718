"""A token bucket that paces a replay to a number of events per second.

Replaying a backlog of dead letters at full speed could flood a consumer (or a payment
API) that has only just recovered; the bucket lets the operator choose the pace.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """``rate`` tokens per second, at most ``capacity`` saved up; ``None`` rate: no limit.

    :meth:`acquire` sleeps until the tokens are there. Taking more than the capacity at
    once (a message that carries several events) is allowed: the debt delays the next.
    """

    def __init__(
        self,
        rate: float | None,
        capacity: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate is not None and rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self.capacity = capacity
        self.clock = clock
        self.sleep = sleep
        self.tokens = capacity
        self.updated = clock()

    def acquire(self, tokens: float = 1.0) -> float:
        """Take ``tokens``; returns the seconds slept."""
        if self.rate is None:
            return 0.0
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        self.tokens -= tokens
        if self.tokens >= 0:
            return 0.0
        wait = -self.tokens / self.rate
        self.sleep(wait)
        self.tokens = 0.0
        self.updated = self.clock()
        return wait
