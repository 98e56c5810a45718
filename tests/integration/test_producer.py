"""The producer joins the caller's transaction: rows and notifications iff it commits."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

from pipeline import EventValidationError, NewEvent, Settings, add_event, add_events
from pipeline.outbox import add_event_async, add_events_async

CHANNEL = "pipeline_outbox"


class Listener:
    """A session LISTENing on the outbox channel that counts what has arrived so far.

    Notifications from different transactions reach a listener in commit order, so a
    marker notified after the code under test has committed arrives after all of its
    notifications: counting up to the marker is exact and waits for nothing more.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute(f"LISTEN {CHANNEL}")

    def drain(self) -> int:
        """The notifications committed since the last drain (the marker's excluded)."""
        marker = f"test-marker-{uuid.uuid4()}"
        with psycopg.connect(self.url, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, %s)", (CHANNEL, marker))
        for received, notification in enumerate(self.conn.notifies(timeout=60)):
            if notification.payload == marker:
                return received
        raise AssertionError("the marker notification did not arrive within 60 s")


@pytest.fixture
def listener(settings: Settings) -> Iterator[Listener]:
    value = Listener(settings.require_database_url())
    try:
        yield value
    finally:
        value.conn.close()


@pytest.fixture
def business_table(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE orders (id text PRIMARY KEY, total int NOT NULL)"))


def count(engine: Engine, sql: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql)).scalar_one())


def test_rolled_back_event_leaves_no_row_and_no_notification(engine, listener, business_table):
    with Session(engine) as session, session.begin():
        session.execute(text("INSERT INTO orders VALUES ('o1', 10)"))
        add_event(
            session, "order.placed", {"order": "o1"}, aggregate_type="order", aggregate_id="o1"
        )
        session.rollback()
    assert count(engine, "SELECT count(*) FROM pipeline.outbox") == 0
    assert count(engine, "SELECT count(*) FROM orders") == 0
    assert listener.drain() == 0


def test_committed_event_gives_one_row_and_one_notification(engine, listener, business_table):
    with Session(engine) as session, session.begin():
        session.execute(text("INSERT INTO orders VALUES ('o1', 10)"))
        event_id = add_event(
            session,
            "order.placed",
            {"order": "o1", "total": 10},
            aggregate_type="order",
            aggregate_id="o1",
        )
    assert listener.drain() == 1
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT id, event_type, ordering_key, payload, status, headers FROM pipeline.outbox"
            )
        ).one()
    assert row.id == event_id and event_id.version == 7
    assert row.event_type == "order.placed"
    assert row.ordering_key == "order:o1"
    assert row.payload == {"order": "o1", "total": 10}
    assert row.status == "pending"
    assert row.headers["correlation_id"] == str(event_id)


def test_thousand_events_in_one_transaction_fold_into_one_notification(engine, listener):
    events = [NewEvent("item.added", {"n": i}, aggregate_id=str(i % 10)) for i in range(1000)]
    with Session(engine) as session, session.begin():
        ids = add_events(session, events)
    assert len(set(ids)) == 1000
    assert count(engine, "SELECT count(*) FROM pipeline.outbox") == 1000
    assert listener.drain() == 1
    # within each ordering key, seq follows the order the events were given in
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, ordering_key FROM pipeline.outbox ORDER BY seq")).all()
    for key in {k for _, k in rows}:
        given = [i for i, e in zip(ids, events, strict=True) if f":{e.aggregate_id}" == key]
        assert [i for i, k in rows if k == key] == given


def test_separate_transactions_notify_separately(engine, listener):
    for i in range(3):
        with Session(engine) as session, session.begin():
            add_event(session, "ping", {"i": i})
    assert listener.drain() == 3


@pytest.mark.parametrize(
    ("payload", "fields", "message"),
    [
        ({"when": object()}, {}, "not JSON-serialisable"),
        ({"x": float("nan")}, {}, "not JSON-serialisable"),
        ({"blob": "x" * 300_000}, {}, "over the limit of 262144"),
        ({"ok": 1}, {"event_version": 0}, "event_version must be a positive integer"),
        ({"ok": 1}, {"headers": {"traceparent": "x"}}, "reserved"),
    ],
)
def test_invalid_event_is_rejected_and_transaction_stays_usable(
    engine, listener, business_table, payload, fields, message
):
    with Session(engine) as session, session.begin():
        session.execute(text("INSERT INTO orders VALUES ('o1', 10)"))
        with pytest.raises(EventValidationError, match=message):
            add_event(session, "order.placed", payload, **fields)
        session.execute(text("INSERT INTO orders VALUES ('o2', 20)"))
    assert count(engine, "SELECT count(*) FROM orders") == 2
    assert count(engine, "SELECT count(*) FROM pipeline.outbox") == 0
    assert listener.drain() == 0


def test_invalid_event_type_is_rejected(engine):
    with Session(engine) as session, session.begin():
        with pytest.raises(EventValidationError, match="event_type"):
            add_event(session, "bad type with spaces", {})


def test_batch_with_one_bad_event_writes_nothing(engine):
    events = [NewEvent("ok", {"i": 1}), NewEvent("ok", {"bad": {1, 2}})]
    with Session(engine) as session, session.begin():
        with pytest.raises(EventValidationError, match="event 1"):
            add_events(session, events)
    assert count(engine, "SELECT count(*) FROM pipeline.outbox") == 0


def test_ordering_rules(engine, settings):
    with Session(engine) as session, session.begin():
        add_event(session, "a", {}, aggregate_type="cart", aggregate_id="7")
        add_event(session, "b", {}, aggregate_type="cart", aggregate_id="7", ordered=False)
        add_event(session, "c", {}, ordering_key="tenant-1")
        add_event(session, "d", {})
    with engine.connect() as conn:
        keys = dict(
            conn.execute(text("SELECT event_type, ordering_key FROM pipeline.outbox")).all()
        )
    assert keys == {"a": "cart:7", "b": None, "c": "tenant-1", "d": None}


def test_trace_context_and_causation_are_captured(engine):
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    cause = uuid.uuid4()
    with tracer.start_as_current_span("business") as span, Session(engine) as session:
        with session.begin():
            add_event(session, "x", {}, causation_id=cause, correlation_id=cause)
        trace_id = format(span.get_span_context().trace_id, "032x")
    with engine.connect() as conn:
        headers = conn.execute(text("SELECT headers FROM pipeline.outbox")).scalar_one()
    assert headers["traceparent"].split("-")[1] == trace_id
    assert headers["causation_id"] == str(cause)
    assert headers["correlation_id"] == str(cause)


async def test_async_session_commit_and_rollback(settings, listener):
    from sqlalchemy.ext.asyncio import AsyncSession

    engine = create_async_engine(settings.sqlalchemy_url())
    try:
        async with AsyncSession(engine) as session, session.begin():
            await add_event_async(session, "a", {"n": 1})
            await session.rollback()
        assert listener.drain() == 0
        async with AsyncSession(engine) as session, session.begin():
            await add_events_async(session, [NewEvent("a", {"n": i}) for i in range(1000)])
        assert listener.drain() == 1
        async with AsyncSession(engine) as session, session.begin():
            with pytest.raises(EventValidationError, match="over the limit"):
                await add_event_async(session, "a", {"blob": "y" * 300_000})
            await add_event_async(session, "a", {"n": "after error"})
        async with engine.connect() as conn:
            total = (await conn.execute(text("SELECT count(*) FROM pipeline.outbox"))).scalar_one()
        assert total == 1001
    finally:
        await engine.dispose()


def test_core_connection_joins_its_transaction_and_autocommit_is_refused(
    engine, listener, business_table
):
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO orders VALUES ('o1', 10)"))
        add_event(conn, "order.placed", {"order": "o1"}, aggregate_id="o1")
        conn.rollback()
    assert count(engine, "SELECT count(*) FROM pipeline.outbox") == 0
    assert count(engine, "SELECT count(*) FROM orders") == 0
    assert listener.drain() == 0
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO orders VALUES ('o2', 20)"))
        ids = add_events(conn, [NewEvent("order.placed", {"n": i}) for i in range(3)])
    assert listener.drain() == 1
    with engine.connect() as conn:  # "commit as you go": the event waits for the commit
        late = add_event(conn, "order.placed", {"n": "autobegun"})
        assert count(engine, "SELECT count(*) FROM pipeline.outbox") == 3
        conn.commit()
    with engine.connect() as conn:
        autocommit = conn.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(EventValidationError, match="AUTOCOMMIT"):
            add_event(autocommit, "order.placed", {"n": "autocommit"})
    with Session(engine.execution_options(isolation_level="AUTOCOMMIT")) as session:
        with pytest.raises(EventValidationError, match="AUTOCOMMIT"):
            add_event(session, "order.placed", {"n": "autocommit session"})
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT id FROM pipeline.outbox")).scalars().all()
    assert sorted(stored) == sorted([*ids, late])


async def test_async_core_connection_commits_with_its_transaction_and_autocommit_is_refused(
    settings, listener
):
    engine = create_async_engine(settings.sqlalchemy_url())
    try:
        async with engine.begin() as conn:
            await add_event_async(conn, "a", {"n": 1})
        async with engine.connect() as conn:
            autocommit = await conn.execution_options(isolation_level="AUTOCOMMIT")
            with pytest.raises(EventValidationError, match="AUTOCOMMIT"):
                await add_events_async(autocommit, [NewEvent("a", {"n": 2})])
        async with engine.connect() as conn:
            total = (await conn.execute(text("SELECT count(*) FROM pipeline.outbox"))).scalar_one()
        assert total == 1
        assert listener.drain() == 1
    finally:
        await engine.dispose()


def test_ordered_inserts_find_their_key_by_index_even_after_an_empty_table_was_planned(
    engine, database_url
):
    """The sequence trigger's lookup must not cache a sequential-scan plan (it made every
    insert scan all unsent rows on connections that first saw an empty, vacuumed outbox)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("VACUUM pipeline.outbox")  # reltuples = 0: the planner trusts "empty"
    with Session(engine) as session, session.begin():
        for n in range(30):
            add_event(session, "order.placed", {"n": n}, aggregate_id=str(n % 3))
        seq_scans, index_scans = session.execute(
            text(
                "SELECT seq_scan, idx_scan FROM pg_stat_xact_user_tables "
                "WHERE schemaname = 'pipeline' AND relname = 'outbox'"
            )
        ).one()
    assert seq_scans == 0
    assert index_scans >= 29


def test_twenty_thousand_keys_in_one_transaction_commit_with_bounded_locks(engine):
    """One advisory lock per key ran out of shared memory at ~13,000 keys (64 locks per
    connection by default); keys share a bounded set of locks now."""
    events = [NewEvent("order.placed", {"n": n}, aggregate_id=f"k{n}") for n in range(20_000)]
    with Session(engine) as session, session.begin():
        ids = add_events(session, events)
        held = session.execute(
            text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                " AND pid = pg_backend_pid()"
            )
        ).scalar_one()
    assert len(ids) == 20_000
    assert 0 < held <= 1024
    with engine.connect() as conn:
        keys, seqs = conn.execute(
            text("SELECT count(DISTINCT ordering_key), count(DISTINCT seq) FROM pipeline.outbox")
        ).one()
    assert (keys, seqs) == (20_000, 20_000)


def test_concurrent_many_key_batches_neither_deadlock_nor_reorder_a_key(engine):
    """Batches sharing keys in random orders all commit, and for every key its events'
    seq order is the order in which their transactions committed: two transactions that
    share keys are ordered the same way on every one of them."""
    import random
    import threading

    pool = [f"key-{n}" for n in range(3000)]
    errors: list[BaseException] = []

    def producer(worker: int) -> None:
        rng = random.Random(worker)
        try:
            for batch in range(4):
                keys = rng.sample(pool, 1000)
                with Session(engine) as session, session.begin():
                    add_events(
                        session,
                        [
                            NewEvent("order.placed", {"txn": f"{worker}-{batch}"}, ordering_key=k)
                            for k in keys
                        ],
                    )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=producer, args=(n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors[0]
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT ordering_key, payload->>'txn', seq FROM pipeline.outbox ORDER BY seq")
        ).all()
    assert len(rows) == 12 * 1000
    first_seen: dict[tuple[str, str], int] = {}
    by_key: dict[str, list[str]] = {}
    for key, txn, _ in rows:
        by_key.setdefault(key, []).append(txn)
    for txns in by_key.values():
        for position, earlier in enumerate(txns):
            for later in txns[position + 1 :]:
                pair = (earlier, later)
                assert (later, earlier) not in first_seen, f"{pair} ordered both ways"
                first_seen[pair] = 1
