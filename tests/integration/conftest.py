"""Fixtures for tests that run the relay in-process against a small set of routes."""

from __future__ import annotations

import random
from collections.abc import Iterator

import psycopg
import pytest

from pipeline import Settings, configure
from pipeline.registry import Registry
from pipeline.relay.drain import Drainer
from pipeline.runtime import Runtime, build_runtime
from pipeline.transport.publisher import Publisher


@pytest.fixture
def relay_settings(settings: Settings) -> Iterator[Settings]:
    fast = settings.replace(poll_interval_min=0.05, poll_interval_max=0.5, lease_seconds=2.0)
    configure(fast)
    yield fast
    configure(settings)


@pytest.fixture
def consumers() -> Registry:
    """Routes only: "audit" takes every event type, "billing" two of them."""
    registry = Registry()
    registry.subscribe("audit", ["*"])
    registry.subscribe("billing", ["order.placed", "order.paid"])
    return registry


@pytest.fixture
def runtime(relay_settings: Settings, consumers: Registry) -> Iterator[Runtime]:
    value = build_runtime(relay_settings, consumers)
    yield value
    value.close()


@pytest.fixture(params=["redis", "amqp"])
def any_runtime(request: pytest.FixtureRequest, consumers: Registry) -> Iterator[Runtime]:
    """The runtime of :func:`runtime`, once on Redis and once on RabbitMQ (skipped where no
    RabbitMQ answers); the same database as the ``engine`` fixture."""
    base: Settings = request.getfixturevalue("settings")
    if request.param == "amqp":
        base = request.getfixturevalue("amqp_settings")
    fast = base.replace(poll_interval_min=0.05, poll_interval_max=0.5, lease_seconds=2.0)
    configure(fast)
    value = build_runtime(fast, consumers)
    yield value
    value.close()
    configure(base)


def drainer_for(runtime: Runtime, publisher: Publisher | None = None, seed: int = 7) -> Drainer:
    """A Drainer on its own autocommit connection (the test closes nothing: the DB is dropped)."""
    conn = psycopg.connect(runtime.settings.require_database_url(), autocommit=True)
    return Drainer(
        runtime.settings,
        publisher or runtime.publisher,
        runtime.registry,
        "test",
        conn,
        rng=random.Random(seed),
    )
