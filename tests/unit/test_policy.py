"""Consumer policy: declared values over the settings' defaults, the retry horizon, and one
retention rule that every caller enforces in the same words.

The doctor and ``pipeline prune`` against a real Postgres are in
tests/integration/test_retention.py; here the callers that need no server: a worker's
(and relay's) runtime, the relay's janitor, and prune before it connects.
"""

from __future__ import annotations

import random
import threading

import pytest

from pipeline.config import Settings
from pipeline.errors import ConfigurationError
from pipeline.inbox.consumer import consumer
from pipeline.policy import (
    ConsumerPolicy,
    consumer_with_longest_horizon,
    redelivery_horizon,
    require_retention,
    retention_problems,
)
from pipeline.registry import Registry

HORIZON = 10 * 3600 + 60  # slowpoke: 10 retries x 3600 s + the 60 s redelivery horizon

# Nothing here may reach a server: ports nobody listens on.
OFFLINE = {"database_url": "postgresql://u@127.0.0.1:1/db", "redis_url": "redis://127.0.0.1:1/0"}


def settings(**values: object) -> Settings:
    return Settings(**{**OFFLINE, "redelivery_horizon_seconds": 60.0, **values})  # type: ignore[arg-type]


def slow_registry() -> Registry:
    routes = Registry()
    consumer("slowpoke", ["order.placed"], max_retries=10, max_backoff=3600, registry=routes)(
        lambda event, ctx: None
    )
    consumer("quick", ["order.placed"], max_retries=0, registry=routes)(lambda event, ctx: None)
    routes.subscribe("elsewhere", ["order.paid"])  # a route: its handler is not here
    return routes


def test_declared_values_win_and_the_settings_fill_the_rest():
    base = settings(consumer_max_retries=3, consumer_backoff_min=0.5, consumer_backoff_max=30)
    policies = {p.consumer: p for p in slow_registry().policies(base)}

    slow = policies["slowpoke"]
    assert (slow.retries, slow.min_backoff, slow.max_backoff) == (10, 0.5, 3600)
    assert slow.retry_horizon == HORIZON and slow.declared

    quick = policies["quick"]
    assert quick.retries == 0 and quick.retry_horizon == 60.0  # only the ledger's resend

    routed = policies["elsewhere"]
    assert not routed.declared
    assert (routed.retries, routed.min_backoff, routed.max_backoff) == (3, 0.5, 30)
    assert routed.retry_horizon == 3 * 30 + 60
    assert redelivery_horizon(base) == 60.0 == routed.redelivery_horizon


def test_a_maximum_below_the_minimum_backoff_is_raised_to_it():
    policy = ConsumerPolicy.resolve(settings(), "c", min_backoff=5, max_backoff=1)
    assert (policy.min_backoff, policy.max_backoff) == (5, 5)


def test_retry_delays_stay_between_the_minimum_and_the_growing_ceiling():
    policy = ConsumerPolicy.resolve(settings(), "c", min_backoff=0.5, max_backoff=8)
    rng = random.Random(7)
    for attempt in range(1, 12):
        ceiling = min(8, 0.5 * 2 ** (attempt - 1))
        delays = [policy.retry_delay(attempt, rng) for _ in range(200)]
        assert all(0.5 <= d <= max(0.5, ceiling) for d in delays), attempt
    assert max(policy.retry_delay(10, rng) for _ in range(200)) > 4  # jitter spans the window


def test_the_time_limit_is_the_declared_one_in_milliseconds_or_none():
    assert ConsumerPolicy.resolve(settings(), "c", time_limit=2.5).time_limit_ms == 2500
    assert ConsumerPolicy.resolve(settings(), "c").time_limit_ms is None


def test_retention_problems_are_the_consumers_not_covered_longest_first():
    routes = slow_registry()
    short = settings(inbox_retention_seconds=100)
    problems = retention_problems(short, routes.policies(short))
    assert [p.policy.consumer for p in problems] == ["slowpoke", "elsewhere"]  # quick: 60 s
    assert problems[0].needed == HORIZON
    assert problems[1].needed == 8 * 60 + 60  # the default policy: 8 retries x 60 s + 60 s
    assert "by the PIPELINE_CONSUMER_* defaults" in problems[1].summary
    assert "PIPELINE_CONSUMER_*" not in problems[0].summary

    covered = settings(inbox_retention_seconds=HORIZON)  # equal is enough
    assert retention_problems(covered, routes.policies(covered)) == []
    longest = consumer_with_longest_horizon(routes.policies(covered))
    assert longest is not None and longest.consumer == "slowpoke"


def test_a_fractional_horizon_needs_the_next_whole_second():
    base = settings(inbox_retention_seconds=61, redelivery_horizon_seconds=60.5)
    policy = ConsumerPolicy.resolve(base, "c", max_retries=1, max_backoff=0.75)  # 61.25 s
    (problem,) = retention_problems(base, [policy])
    assert problem.needed == 62
    assert str(problem) == (
        "PIPELINE_INBOX_RETENTION_SECONDS=61 is shorter than the retry horizon of consumer 'c' "
        "(61.25 s = 1 retries x 0.75 s max backoff + 60.5 s "
        "PIPELINE_REDELIVERY_HORIZON_SECONDS): a late copy of an event could be processed "
        "twice; set PIPELINE_INBOX_RETENTION_SECONDS to at least 62"
    )
    require_retention(base.replace(inbox_retention_seconds=62), [policy])


# -- every caller, the same bad settings, the same refusal ------------------------------------
BAD = {"inbox_retention_seconds": HORIZON - 1}


def expected_refusal() -> str:
    bad = settings(**BAD)
    return str(retention_problems(bad, slow_registry().policies(bad))[0])


def refuse_worker_start(bad: Settings, routes: Registry) -> None:
    """What ``pipeline worker`` (and ``pipeline relay``) build first: the runtime."""
    from pipeline.runtime import build_runtime

    build_runtime(bad, routes, set_global_broker=False)


def refuse_janitor(bad: Settings, routes: Registry) -> None:
    from pipeline.relay.janitor import Janitor

    Janitor(bad, routes, threading.Event())


def refuse_prune(bad: Settings, routes: Registry) -> None:
    from pipeline.tools.ops.prune import run_prune

    run_prune(bad, routes.policies(bad), dry_run=True)


@pytest.mark.parametrize("caller", [refuse_worker_start, refuse_janitor, refuse_prune])
def test_every_caller_refuses_a_short_inbox_retention_in_the_same_words(caller):
    with pytest.raises(ConfigurationError) as refused:
        caller(settings(**BAD), slow_registry())
    assert str(refused.value) == expected_refusal()
    assert str(refused.value).endswith(
        f"set PIPELINE_INBOX_RETENTION_SECONDS to at least {HORIZON}"
    )
    assert "\n" not in str(refused.value)


def test_the_worker_refuses_before_declaring_any_consumer():
    from pipeline.inbox.actors import ProcessEngine, declare_inbox_actors
    from pipeline.transport.factory import open_transport

    bad = settings(**BAD)
    transport = open_transport(bad, middleware=[])
    with pytest.raises(ConfigurationError):
        declare_inbox_actors(transport, bad, slow_registry(), ProcessEngine(bad))
    assert transport.broker.get_declared_actors() == set()


def test_the_same_callers_start_once_the_retention_covers_the_horizon():
    from pipeline.relay.janitor import Janitor
    from pipeline.runtime import build_runtime

    good = settings(inbox_retention_seconds=HORIZON)
    runtime = build_runtime(good, slow_registry(), set_global_broker=False)
    try:
        assert {"slowpoke", "quick", "pipeline_canary"} <= set(runtime.inbox_actors)
    finally:
        runtime.close()
    Janitor(good, slow_registry(), threading.Event())
