"""Consumer policy: how often, how late and for how long a consumer sees an event.

A consumer declares what it needs (``@consumer(..., max_retries=, min_backoff=,
max_backoff=, time_limit=)``) and the ``PIPELINE_CONSUMER_*`` settings fill in what it
leaves out. :class:`ConsumerPolicy` is that result, worked out here and nowhere else, so
that the inbox that schedules retries, the worker that sets the actor's time limit and
every check of the retention rule agree on one set of numbers.

The redelivery horizon (``PIPELINE_REDELIVERY_HORIZON_SECONDS``) is what "owed" means: a
delivery with no outcome for that long is sent again by the relay's ledger sweep, and
reported owed by ``pipeline status``, ``pipeline trace`` and the doctor. Everything reads
it through :func:`redelivery_horizon`.

The retention rule. A copy of an event can reach a consumer as late as its *retry
horizon* after the first attempt: every retry at its longest backoff, then the
redelivery horizon. An inbox key pruned before that would let the late copy run the
handler a second time, so an inbox retention shorter than the longest retry horizon is
refused, in the same words, by everything that acts on it: workers and relays refuse to
start, ``pipeline prune`` refuses to run, and ``pipeline doctor`` reports the problem.
Nothing quietly keeps keys longer instead: a setting that does not mean what it says is
worse than a process that will not start.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

from pipeline.backoff import full_jitter
from pipeline.config import Settings
from pipeline.errors import ConfigurationError


def redelivery_horizon(settings: Settings) -> float:
    """Seconds without an outcome after which a delivery is owed and sent again."""
    return settings.redelivery_horizon_seconds


@dataclass(frozen=True)
class ConsumerPolicy:
    """One consumer's retries, backoff bounds and time limit, declared or defaulted."""

    consumer: str
    retries: int
    min_backoff: float
    max_backoff: float
    time_limit: float | None
    """Seconds a handler may run; None leaves Dramatiq's own limit."""
    redelivery_horizon: float
    declared: bool = True
    """False when this process routes to the consumer but has not imported its handler:
    its declaration is unknown here, so the settings' defaults stand in for it."""

    @classmethod
    def resolve(
        cls,
        settings: Settings,
        consumer: str,
        *,
        max_retries: int | None = None,
        min_backoff: float | None = None,
        max_backoff: float | None = None,
        time_limit: float | None = None,
        declared: bool = True,
    ) -> ConsumerPolicy:
        """The declaration's values, the settings' where it has none (None)."""
        low = settings.consumer_backoff_min if min_backoff is None else min_backoff
        high = settings.consumer_backoff_max if max_backoff is None else max_backoff
        return cls(
            consumer=consumer,
            retries=settings.consumer_max_retries if max_retries is None else max_retries,
            min_backoff=low,
            max_backoff=max(low, high),
            time_limit=time_limit,
            redelivery_horizon=redelivery_horizon(settings),
            declared=declared,
        )

    @property
    def retry_horizon(self) -> float:
        """The latest a copy of one event can come after its first attempt (seconds)."""
        return self.retries * self.max_backoff + self.redelivery_horizon

    @property
    def time_limit_ms(self) -> int | None:
        return None if self.time_limit is None else int(self.time_limit * 1000)

    def retry_delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds before retry ``attempt`` (1-based): full jitter, never under the minimum."""
        return max(self.min_backoff, full_jitter(attempt, self.min_backoff, self.max_backoff, rng))


@dataclass(frozen=True)
class RetentionProblem:
    """An inbox retention shorter than one consumer's retry horizon."""

    inbox_retention: int
    policy: ConsumerPolicy

    @property
    def needed(self) -> int:
        """The shortest ``PIPELINE_INBOX_RETENTION_SECONDS`` that covers this consumer."""
        return math.ceil(self.policy.retry_horizon)

    @property
    def summary(self) -> str:
        p = self.policy
        defaults = (
            ""
            if p.declared
            else ", by the PIPELINE_CONSUMER_* defaults as its handler is not imported here"
        )
        return (
            f"PIPELINE_INBOX_RETENTION_SECONDS={self.inbox_retention} is shorter than the retry "
            f"horizon of consumer {p.consumer!r} ({p.retry_horizon:g} s = {p.retries} retries "
            f"x {p.max_backoff:g} s max backoff + {p.redelivery_horizon:g} s "
            f"PIPELINE_REDELIVERY_HORIZON_SECONDS{defaults}): a late copy of an event could "
            "be processed twice"
        )

    @property
    def fix(self) -> str:
        return f"set PIPELINE_INBOX_RETENTION_SECONDS to at least {self.needed}"

    def __str__(self) -> str:
        return f"{self.summary}; {self.fix}"


def retention_problems(
    settings: Settings, consumers: Iterable[ConsumerPolicy]
) -> list[RetentionProblem]:
    """The consumers whose retry horizon the inbox retention does not cover, longest first.

    The first problem's :attr:`~RetentionProblem.fix` covers them all.
    """
    retention = settings.inbox_retention_seconds
    short = sorted((p for p in consumers if retention < p.retry_horizon), key=_longest_first)
    return [RetentionProblem(retention, p) for p in short]


def require_retention(settings: Settings, consumers: Iterable[ConsumerPolicy]) -> None:
    """Refuse (:class:`ConfigurationError`, one line) when :func:`retention_problems` finds any."""
    problems = retention_problems(settings, consumers)
    if problems:
        raise ConfigurationError(str(problems[0]))


def consumer_with_longest_horizon(consumers: Iterable[ConsumerPolicy]) -> ConsumerPolicy | None:
    """The consumer a copy of an event may reach latest; None when there are none."""
    return min(consumers, key=_longest_first, default=None)


def _longest_first(policy: ConsumerPolicy) -> tuple[float, str]:
    return -policy.retry_horizon, policy.consumer
