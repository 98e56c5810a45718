"""Backpressure: the producer's hard limit (BacklogFull) and the relay's warning."""

from __future__ import annotations

import logging
import time

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import pipeline
from pipeline import BacklogFull, NewEvent, add_event, add_event_async, add_events, configure
from pipeline.config import Settings
from pipeline.db.connect import connect
from pipeline.outbox import BacklogGate, _gate
from pipeline.relay.backlog import BacklogMonitor
from tests.support import produce


@pytest.fixture
def limited(settings: Settings, engine: Engine):
    """A limit of 5 unsent events, with 6 already waiting (no relay runs)."""
    produce(engine, [NewEvent("order.placed", {"i": i}) for i in range(6)])
    value = settings.replace(backlog_limit=5)
    configure(value)
    _gate.forget()
    yield value
    _gate.forget()
    configure(settings)


@pytest.fixture
def notes(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE notes (body text)"))


def unsent(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM pipeline.outbox WHERE status IN ('pending', 'publishing')"
                )
            ).scalar_one()
        )


def test_backlog_full_is_exported():
    assert "BacklogFull" in pipeline.__all__
    assert issubclass(BacklogFull, pipeline.PipelineError)


def test_hard_limit_raises_before_any_write_and_the_transaction_stays_usable(
    limited, engine, notes
):
    with Session(engine) as session, session.begin():
        session.execute(text("INSERT INTO notes VALUES ('before')"))
        with pytest.raises(
            BacklogFull, match=r"more than 5 events are waiting .*PIPELINE_BACKLOG_LIMIT"
        ):
            add_event(session, "order.placed", {"i": 99})
        with pytest.raises(BacklogFull):  # a batch too, from the cached count (no query)
            add_events(session, [NewEvent("order.placed", {"i": 100})])
        session.execute(text("INSERT INTO notes VALUES ('after')"))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT body FROM notes ORDER BY body")).scalars().all() == [
            "after",
            "before",
        ]
    assert unsent(engine) == 6  # nothing of the refused events was written


def test_under_the_limit_events_are_written(settings, engine):
    produce(engine, [NewEvent("order.placed", {"i": i}) for i in range(3)])
    configure(settings.replace(backlog_limit=5))
    _gate.forget()
    try:
        with Session(engine) as session, session.begin():
            add_event(session, "order.placed", {"i": 3})
        assert unsent(engine) == 4
    finally:
        _gate.forget()
        configure(settings)


def test_the_count_is_refreshed_at_most_once_a_second(limited, engine):
    with engine.begin() as conn:  # the backlog drains (as a relay would)
        conn.execute(text("UPDATE pipeline.outbox SET status = 'sent'"))
    with Session(engine) as session, session.begin():
        session.execute(text("SELECT 1"))
        _gate.record(limited, 6)  # a count taken just now, still over the limit
        with pytest.raises(BacklogFull):
            add_event(session, "order.placed", {"i": 1})
    time.sleep(BacklogGate.REFRESH_SECONDS)
    with Session(engine) as session, session.begin():
        add_event(session, "order.placed", {"i": 2})  # counted again: 0 unsent
    assert unsent(engine) == 1


async def test_async_producer_raises_too_and_its_transaction_stays_usable(limited, notes):
    engine = create_async_engine(limited.sqlalchemy_url())
    try:
        async with AsyncSession(engine) as session, session.begin():
            await session.execute(text("INSERT INTO notes VALUES ('async')"))
            with pytest.raises(BacklogFull):
                await add_event_async(session, "order.placed", {"i": 1})
            await session.execute(text("INSERT INTO notes VALUES ('async after')"))
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT count(*) FROM notes"))).scalar_one()
            pending = (
                await conn.execute(text("SELECT count(*) FROM pipeline.outbox"))
            ).scalar_one()
        assert rows == 2 and pending == 6
    finally:
        await engine.dispose()


def gauge() -> float | None:
    return REGISTRY.get_sample_value("pipeline_backlog_over_warning")


def test_relay_warns_above_the_threshold_and_clears_below(settings, engine, caplog):
    produce(engine, [NewEvent("order.placed", {"i": i}) for i in range(4)])
    monitor = BacklogMonitor(settings.replace(backlog_warn=3), check_interval=0.0)
    caplog.set_level(logging.INFO, logger="pipeline.relay")
    with connect(settings, autocommit=True) as conn:
        monitor.maybe_check(conn)
        assert gauge() == 1.0
        monitor.maybe_check(conn)  # still over: the warning is not repeated within a minute
        assert gauge() == 1.0
        with engine.begin() as sa:
            sa.execute(text("UPDATE pipeline.outbox SET status = 'sent'"))
        monitor.maybe_check(conn)
    assert gauge() == 0.0
    messages = [r.getMessage() for r in caplog.records if r.name == "pipeline.relay"]
    assert messages == [
        "outbox backlog above PIPELINE_BACKLOG_WARN: events are produced faster than they are "
        "published",
        "outbox backlog back under PIPELINE_BACKLOG_WARN",
    ]
