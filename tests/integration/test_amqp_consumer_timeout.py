"""Delayed messages on a RabbitMQ whose ``consumer_timeout`` is shorter than the delay.

Dramatiq's consumer holds a delayed message (a retry waiting out its backoff) unacknowledged
until it is due; RabbitMQ closes a channel whose delivery stays unacknowledged past its
``consumer_timeout``. The node here is started with a 5 s ``consumer_timeout`` checked
every second (``channel_tick_interval``; 60 s by default), and a handler's retry waits
8 s: the retry must still run once, on time, without a dead letter, a duplicate delivery
or a traceback, and leave nothing on the queues.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, text

from pipeline import NewEvent, Settings, configure
from pipeline.tools.harness.rabbitmq_cluster import RabbitCluster
from pipeline.transport.amqp.transport import AmqpTransport
from pipeline.transport.base import QueueDepth
from tests.chaos.orders import TABLES
from tests.conftest import RUN_ID
from tests.support import (
    engine_with_tables,
    process_metric,
    produce,
    rabbitmq_nodes,
    running_pipeline,
    wait_until,
)

APP = "tests.apps.long_backoff_app"
CONSUMER_TIMEOUT_MS = 5000
QUEUE = "pipeline.patient"


@pytest.fixture(scope="module")
def short_timeout_node() -> Iterator[RabbitCluster]:
    with rabbitmq_nodes(
        1,
        config=f"consumer_timeout = {CONSUMER_TIMEOUT_MS}",
        advanced_config="[{rabbit, [{channel_tick_interval, 1000}]}].",
    ) as cluster:
        yield cluster


@pytest.fixture
def timeout_settings(database_url: str, short_timeout_node: RabbitCluster) -> Iterator[Settings]:
    [node] = short_timeout_node.nodes
    value = Settings(
        database_url=database_url,  # type: ignore[arg-type]
        broker_url=node.url,  # type: ignore[arg-type]
        broker_management_url=node.management_url,  # type: ignore[arg-type]
        broker_consumer_timeout_ms=CONSUMER_TIMEOUT_MS,
        redis_namespace=f"t{RUN_ID}{uuid.uuid4().hex[:8]}",
        canary_interval=0,
        lease_seconds=3.0,
        poll_interval_max=0.5,
    )
    configure(value)
    try:
        yield value
    finally:
        configure(None)


@pytest.fixture
def engine(timeout_settings: Settings) -> Iterator[Engine]:
    with engine_with_tables(timeout_settings, TABLES, pool_size=2) as value:
        yield value


def scalar(engine: Engine, sql: str) -> object:
    with engine.connect() as conn:
        return conn.execute(text(sql)).scalar()


def warnings(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    "declared_ms",
    [
        pytest.param(CONSUMER_TIMEOUT_MS, id="declared"),
        pytest.param(12 * CONSUMER_TIMEOUT_MS, id="declared-too-high"),
    ],
)
def test_a_retry_delayed_past_consumer_timeout_runs_once(
    engine, timeout_settings, caplog, declared_ms
):
    """With ``PIPELINE_BROKER_CONSUMER_TIMEOUT_MS`` set to the server's value, the worker
    never holds the retry long enough for RabbitMQ to close its channel. Declared too high,
    RabbitMQ closes the channel (once or twice over the backoff): each closure is one
    warning line, the worker consumes again and the retry still runs once."""
    from tests.apps.long_backoff_app import RETRY_BACKOFF  # not at collection: conftest.py

    settings = timeout_settings.replace(broker_consumer_timeout_ms=declared_ms)
    configure(settings)
    caplog.set_level(logging.INFO)
    duplicates_before = process_metric("pipeline_inbox_duplicates_total", consumer="patient")
    started = time.monotonic()
    with running_pipeline(settings, APP, threads=2):
        produce(engine, [NewEvent("parcel.shipped", {"order_id": "p-1"}, aggregate_id="p-1")])
        wait_until(lambda: processed(engine) == 1, timeout=RETRY_BACKOFF + 30)
        waited = time.monotonic() - started
        time.sleep(3)  # a stray copy of the retry would be due with it, and run meanwhile
        transport = AmqpTransport(settings)
        try:
            depths = transport.queue_depths([QUEUE])
        finally:
            transport.close()
    assert waited >= RETRY_BACKOFF
    assert scalar(engine, "SELECT count(*) FROM effects") == 1
    assert scalar(engine, "SELECT count(*) FROM pipeline.dead_letters") == 0
    assert depths == {QUEUE: QueueDepth(0, 0, 0)}
    duplicates = process_metric("pipeline_inbox_duplicates_total", consumer="patient")
    assert duplicates == duplicates_before, "a copy of the retry was delivered again"
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info or r.exc_text]
    assert not tracebacks
    lines = warnings(caplog.records)
    closed = [line for line in lines if "consumer_timeout" in line]
    assert lines[0] == "handler failed; will retry"
    assert lines[1:] == closed
    if declared_ms == CONSUMER_TIMEOUT_MS:
        assert not closed
    else:
        assert closed, "RabbitMQ never closed the channel: the test proves nothing"


def processed(engine: Engine) -> object:
    return scalar(engine, "SELECT count(*) FROM pipeline.inbox WHERE status = 'processed'")
