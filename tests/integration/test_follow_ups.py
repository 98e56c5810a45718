"""A handler's follow-up events: held back until the inbox transaction commits.

The insert of an ordered event locks its key until COMMIT. A handler's follow-ups are
therefore inserted only just before the inbox transaction commits, so a handler that
waits (on another service, or frozen with its worker) never makes a producer wait.
Against real Postgres; each handler runs in an :class:`InboxProcessor` of this process.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from pipeline import Settings, add_event, configure
from pipeline.db.ordering import ORDERING_LOCK_CLASS, ordering_lock_bucket
from pipeline.inbox.consumer import consumer, definitions
from pipeline.inbox.processor import InboxProcessor
from pipeline.registry import Registry
from tests.support import wait_until

SECONDS = 30  # how long a waiting handler may be held before the test gives up


@pytest.fixture
def follow_up_settings(settings: Settings) -> Iterator[Settings]:
    configure(settings)
    yield settings


def processor_for(engine, settings: Settings, routes: Registry) -> InboxProcessor:
    subscription, definition = definitions(routes)[0]
    return InboxProcessor(settings, subscription, definition, lambda: engine, lambda *args: None)


def envelope(number: int, **data: object) -> dict:
    return {
        "specversion": "1.0",
        "id": str(uuid.UUID(int=number)),
        "type": "step",
        "source": "/t",
        "data": {"n": number, **data},
    }


def ordering_locks_held(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND classid = :lock_class"
            ),
            {"lock_class": ORDERING_LOCK_CLASS},
        ).scalar_one()


def waiting_on_advisory_lock(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND wait_event = 'advisory' AND datname = current_database()"
            )
        ).scalar_one()


def produce_one(engine, key: str, lock_timeout: str = "5s") -> uuid.UUID:
    """A producer's transaction of one event of ``key``, refusing to wait past the timeout."""
    with Session(engine) as session, session.begin():
        session.execute(text(f"SET LOCAL lock_timeout = '{lock_timeout}'"))
        return add_event(session, "order.noted", {"by": "producer"}, ordering_key=key)


def seqs(engine) -> dict[uuid.UUID, int]:
    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT id, seq FROM pipeline.outbox")).all())


class Held:
    """A handler that publishes and then waits for the test, in its own thread."""

    def __init__(self, engine, settings: Settings, keys: list[str]) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.published: list[uuid.UUID] = []
        self.error: BaseException | None = None
        routes = Registry()

        def handler(event, ctx) -> None:
            for key in keys:
                self.published.append(ctx.publish("order.followed", {}, ordering_key=key))
            self.entered.set()
            assert self.release.wait(SECONDS), "the test never released the handler"

        consumer("holder", ["step"], registry=routes)(handler)
        self.processor = processor_for(engine, settings, routes)
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        try:
            self.processor.handle([envelope(1)])
        except BaseException as exc:  # reported by join()
            self.error = exc

    def start(self) -> None:
        self.thread.start()
        assert self.entered.wait(SECONDS), "the handler never ran"

    def join(self) -> None:
        self.release.set()
        self.thread.join(SECONDS)
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error


def test_a_waiting_handler_holds_no_ordering_lock_and_producers_commit(engine, follow_up_settings):
    """The handler published a follow-up of key K and waits: no ordering lock is held, a
    producer of K commits at once, and the follow-up, committed later, comes after it."""
    held = Held(engine, follow_up_settings, ["order:K"])
    held.start()
    try:
        assert ordering_locks_held(engine) == 0
        produced = produce_one(engine, "order:K")  # raises LockNotAvailable if it waited
        with engine.connect() as conn:
            visible = conn.execute(text("SELECT count(*) FROM pipeline.outbox")).scalar_one()
        assert visible == 1  # the follow-up is not inserted while the handler runs
    finally:
        held.join()
    numbers = seqs(engine)
    assert set(numbers) == {produced, *held.published}
    assert numbers[held.published[0]] > numbers[produced]  # key order is commit order


def test_follow_ups_of_several_keys_take_their_locks_in_one_order(engine, follow_up_settings):
    """A producer holds key A and then adds key B; the handler published B, then A. Were
    the handler's locks taken as it published (B, then A) the two would deadlock; taken
    in lock order at commit (A first), the handler waits for the producer, then commits."""
    a, b = "order:A", "order:B"
    if ordering_lock_bucket(a) > ordering_lock_bucket(b):
        a, b = b, a
    assert ordering_lock_bucket(a) < ordering_lock_bucket(b)
    held = Held(engine, follow_up_settings, [b, a])
    with Session(engine) as producer, producer.begin():
        producer.execute(text("SET LOCAL lock_timeout = '10s'"))
        first = add_event(producer, "order.noted", {}, ordering_key=a)
        held.start()
        held.release.set()  # the handler returns; its insert waits for A
        wait_until(lambda: waiting_on_advisory_lock(engine) == 1, timeout=SECONDS)
        second = add_event(producer, "order.noted", {}, ordering_key=b)
    held.join()
    numbers = seqs(engine)
    assert len(numbers) == 4
    followed_b, followed_a = held.published
    assert numbers[first] < numbers[second] < numbers[followed_a]
    assert numbers[second] < numbers[followed_b]


def test_follow_ups_of_a_failed_handler_are_dropped_with_its_work(engine, follow_up_settings):
    """In a batch, handler 3 raises after publishing: its follow-up is rolled back, the
    neighbours' follow-ups (redone after the roll-back) are inserted once each."""
    routes = Registry()

    def handler(event, ctx) -> None:
        n = event.data["n"]
        ctx.publish("step.done", {"n": n}, ordering_key=f"step:{n}")
        if n == 3:
            raise RuntimeError("no")

    consumer("batch_follow", ["step"], max_retries=2, registry=routes)(handler)
    processor = processor_for(engine, follow_up_settings, routes)
    outcome = processor.handle([envelope(n) for n in range(1, 6)])
    assert (outcome.processed, outcome.retried) == (4, 1)
    with engine.connect() as conn:
        keys = Counter(conn.execute(text("SELECT ordering_key FROM pipeline.outbox")).scalars())
    assert keys == Counter({"step:1": 1, "step:2": 1, "step:4": 1, "step:5": 1})


def test_a_follow_up_refused_at_commit_fails_the_handler_that_published_it(
    engine, follow_up_settings, caplog
):
    """A follow-up whose id is taken is refused by the insert before COMMIT: the message is
    handled again with events inserted as published, so the error fails its handler (a
    retry recorded in the inbox) and the neighbour still commits with its follow-up."""
    taken = uuid.uuid4()
    with Session(engine) as session, session.begin():
        add_event(session, "order.noted", {}, event_id=taken)
    routes = Registry()

    def handler(event, ctx) -> None:
        n = event.data["n"]
        ctx.publish("step.done", {"n": n}, event_id=taken if n == 2 else None)

    consumer("refused_follow", ["step"], max_retries=2, registry=routes)(handler)
    processor = processor_for(engine, follow_up_settings, routes)
    with caplog.at_level(logging.WARNING, logger="pipeline.inbox"):
        outcome = processor.handle([envelope(1), envelope(2)])
    assert (outcome.processed, outcome.retried) == (1, 1)
    assert any("follow-up events refused at commit" in r.getMessage() for r in caplog.records)
    with engine.connect() as conn:
        inbox = dict(
            conn.execute(
                text(
                    "SELECT event_id, last_error_class FROM pipeline.inbox"
                    " WHERE consumer = 'refused_follow'"
                )
            ).all()
        )
        events = conn.execute(text("SELECT count(*) FROM pipeline.outbox")).scalar_one()
    assert inbox == {uuid.UUID(int=1): None, uuid.UUID(int=2): "IntegrityError"}
    assert events == 2  # the taken one and event 1's follow-up
