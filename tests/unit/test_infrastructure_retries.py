"""An expected outage in an inbox actor: one warning line, retried, no traceback at INFO.

Runs Dramatiq's own worker and Retries middleware on its in-memory StubBroker (no server):
what is checked is how Dramatiq logs and retries what the inbox actor raises.
"""

from __future__ import annotations

import logging

import dramatiq
import psycopg
import pytest
import redis
from dramatiq.brokers.stub import StubBroker
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from pipeline.db.stores.inbox import ClaimHeld
from pipeline.driver_errors import is_outage
from pipeline.inbox.actors import (
    INFRASTRUCTURE_MAX_BACKOFF_MS,
    CountInfrastructureRetries,
    infrastructure_delay_ms,
    quiet_dramatiq_retries,
    retry_outages,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("exc", "outage"),
    [
        (psycopg.OperationalError("connection refused"), True),
        (OperationalError("SELECT 1", {}, psycopg.OperationalError("too many clients")), True),
        (DBAPIError("SELECT 1", {}, Exception("gone"), connection_invalidated=True), True),
        (redis.ConnectionError("refused"), True),
        (redis.TimeoutError("timed out"), True),
        (IntegrityError("INSERT", {}, psycopg.errors.UniqueViolation("taken")), False),
        (ValueError("a bug"), False),
    ],
)
def test_what_counts_as_an_expected_outage(exc: BaseException, outage: bool) -> None:
    assert is_outage(exc) is outage


def test_the_wait_doubles_from_the_minimum_and_is_capped() -> None:
    assert 50 <= infrastructure_delay_ms(0) <= 100
    assert 100 <= infrastructure_delay_ms(1) <= 200
    assert infrastructure_delay_ms(40) >= INFRASTRUCTURE_MAX_BACKOFF_MS / 2
    assert infrastructure_delay_ms(40) <= INFRASTRUCTURE_MAX_BACKOFF_MS


def run_actor(
    caplog: pytest.LogCaptureFixture, failure: BaseException, name: str = "unit"
) -> list[int]:
    """An inbox actor that fails once with ``failure``, then succeeds; its calls."""
    broker = StubBroker()
    broker.add_middleware(CountInfrastructureRetries())
    quiet_dramatiq_retries()
    calls: list[int] = []

    def work() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise failure

    def run() -> None:
        retry_outages(work)

    actor = dramatiq.Actor(
        run,
        broker=broker,
        actor_name=f"pipeline_inbox_{name}",
        queue_name="pipeline.unit",
        priority=0,
        options={"min_backoff": 10, "max_backoff": 20},
    )
    worker = dramatiq.Worker(broker, worker_timeout=50)
    worker.start()
    try:
        with caplog.at_level(logging.INFO):
            actor.send()
            broker.join(actor.queue_name)
            worker.join()
    finally:
        worker.stop()
    return calls


def test_an_outage_is_one_warning_and_a_retry_without_traceback(caplog) -> None:
    calls = run_actor(caplog, psycopg.OperationalError("too many clients already"))
    assert len(calls) == 2  # retried
    records = [r for r in caplog.records if r.levelno >= logging.INFO]
    warnings = [r for r in records if "failed outside its handlers" in r.getMessage()]
    assert len(warnings) == 1
    (line,) = warnings
    assert line.__dict__["error_class"] == "OperationalError"
    assert line.__dict__["actor"] == "pipeline_inbox_unit"
    assert line.__dict__["message_id"]
    assert line.__dict__["reason"] == "too many clients already"
    assert 0 < line.__dict__["retry_in"] <= 0.1
    assert not [r for r in records if r.exc_info], "a traceback was logged at INFO or above"
    assert not [r for r in records if "Retrying message" in r.getMessage()]
    assert not [r for r in records if r.levelno >= logging.ERROR]


def test_a_bug_keeps_dramatiq_error_line_with_its_traceback(caplog) -> None:
    calls = run_actor(caplog, ZeroDivisionError("a bug"))
    assert len(calls) == 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None
    warnings = [r for r in caplog.records if "failed outside its handlers" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].__dict__["error_class"] == "ZeroDivisionError"


def test_a_copy_in_flight_is_retried_quietly_and_not_counted_as_an_outage(caplog) -> None:
    """A duplicate delivery that meets its twin's open claim is no infrastructure trouble:
    retried, one INFO line, no warning, and the infrastructure-retry counter stays put."""
    from pipeline.observability import metrics

    held = ClaimHeld("held")
    held.__cause__ = OperationalError("INSERT", {}, psycopg.errors.LockNotAvailable("lock"))
    before = {
        tuple(s.labels.values()): s.value
        for family in metrics.inbox_infrastructure_retries.collect()
        for s in family.samples
    }
    calls = run_actor(caplog, held, name="held")
    assert len(calls) == 2  # given back, then handled
    after = {
        tuple(s.labels.values()): s.value
        for family in metrics.inbox_infrastructure_retries.collect()
        for s in family.samples
    }
    assert {k: v for k, v in after.items() if k[0] == "held"} == {
        k: v for k, v in before.items() if k[0] == "held"
    }
    lines = [r for r in caplog.records if "another copy of the message" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert lines[0].__dict__["consumer"] == "held" and 0 < lines[0].__dict__["retry_in"] <= 0.1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
