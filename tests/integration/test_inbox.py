"""Inbox: effectively-once handlers, idempotency keys, retries, dead letters, ordered consumers.

Against real Postgres and Redis; workers run as real processes (``pipeline worker``) where
the test is about them (metrics of several processes, a worker killed mid-handler), else
in this process with the relay (same broker, same actors, no process start-up to wait for).
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence

import psycopg
import pytest
import redis
from sqlalchemy import text

from pipeline import NewEvent, Settings
from pipeline.registry import Registry
from pipeline.relay.drain import Drainer
from pipeline.runtime import build_runtime
from pipeline.tools.harness.payment_api import PaymentServer
from pipeline.transport.publisher import Delivery
from pipeline.transport.redis.encoding import REDIS_MESSAGE_ID
from pipeline.transport.redis.keys import messages_key, queue_key
from tests.chaos.orders import APP, TABLES, scalar, stage_counts, wait_all_notified
from tests.support import (
    QUICK_FAULTS,
    app_registry,
    installed_settings,
    multiprocess_metric,
    produce,
    running_pipeline,
    running_worker,
    soak,
    start_worker,
    stop_process,
    wait_until,
)


@pytest.fixture
def inbox_settings(settings: Settings, engine) -> Iterator[Settings]:
    with installed_settings(settings, engine, TABLES, **QUICK_FAULTS) as value:
        yield value


class RepeatingPublisher:
    """Delivers every message ``times`` times: what broker redelivery and replays look like."""

    def __init__(self, inner, times: int) -> None:
        self.inner, self.times = inner, times

    def deliver(self, deliveries: Sequence[Delivery]):
        outcomes = self.inner.deliver(list(deliveries) * self.times)
        return outcomes[: len(deliveries)]

    def close(self) -> None:
        pass


def publish_repeated(settings: Settings, times: int) -> None:
    """Publish every pending outbox event ``times`` times to its consumers' queues."""
    routes = Registry()
    routes.subscribe("ledger", ["entry.booked"])
    runtime = build_runtime(settings, routes, set_global_broker=False)
    try:
        conn = psycopg.connect(settings.require_database_url(), autocommit=True)
        drainer = Drainer(settings, RepeatingPublisher(runtime.publisher, times), routes, "t", conn)
        while drainer.run_batch().claimed:
            pass
        conn.close()
    finally:
        runtime.close()


@pytest.mark.parametrize(("processes", "threads"), [(1, 1), (2, 4)], ids=["serial", "concurrent"])
def test_every_message_delivered_three_times_takes_effect_once(
    engine, inbox_settings, tmp_path, processes, threads
):
    orders = [f"o{i}" for i in range(200)]
    produce(engine, [NewEvent("entry.booked", {"order_id": o}, aggregate_id=o) for o in orders])
    publish_repeated(inbox_settings.replace(max_events_per_message=10), times=3)
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    worker = start_worker(
        inbox_settings,
        APP,
        tmp_path / "worker.log",
        processes,
        threads,
        PROMETHEUS_MULTIPROC_DIR=str(metrics_dir),
    )
    try:
        wait_until(
            lambda: (
                multiprocess_metric(
                    metrics_dir, "pipeline_inbox_duplicates_total", consumer="ledger"
                )
                >= 400
            ),
            timeout=60,
        )
    finally:
        stop_process(worker)
    assert stage_counts(engine, "ledger") == Counter({o: 1 for o in orders})
    assert (
        multiprocess_metric(metrics_dir, "pipeline_inbox_processed_total", consumer="ledger") == 200
    )
    assert (
        multiprocess_metric(metrics_dir, "pipeline_inbox_duplicates_total", consumer="ledger")
        == 400
    )
    assert scalar(engine, "SELECT count(*) FROM pipeline.inbox WHERE status = 'processed'") == 200


def test_retried_handler_commits_rows_once_and_charges_once(engine, inbox_settings, monkeypatch):
    api = PaymentServer().start()
    monkeypatch.setattr(f"{APP}.PAYMENT_API", api.url)
    monkeypatch.setattr(f"{APP}.FAIL_RATE", 0.6)
    orders = [f"pay-{i}" for i in range(30)]
    try:
        with running_pipeline(inbox_settings, APP, threads=2):
            produce(
                engine,
                [
                    NewEvent("order.placed", {"order_id": o, "amount": 5}, aggregate_id=o)
                    for o in orders
                ],
            )
            wait_until(
                lambda: len(stage_counts(engine, "notifications")) == 30,
                timeout=60,
                progress=lambda: scalar(engine, "SELECT count(*) FROM pipeline.attempts"),
            )
    finally:
        api.stop()
    assert stage_counts(engine, "payments") == Counter({o: 1 for o in orders})
    charged = Counter(c["request"]["order_id"] for c in api.ledger.charges)
    assert charged == Counter({o: 1 for o in orders})  # one charge per order
    retried = scalar(engine, "SELECT count(*) FROM pipeline.attempts WHERE consumer = 'payments'")
    assert retried > 0, "the failure injection never fired"
    # every attempt of one order sent the same key: as many distinct keys as orders
    assert len({r["key"] for r in api.ledger.requests}) == 30
    # each failed attempt called the API; so did a handler run again because a neighbour in
    # its message failed (the fast way's roll-back): the API replayed those, charging nothing
    assert len(api.ledger.requests) >= 30 + retried
    outcomes = Counter(r["outcome"] for r in api.ledger.requests)
    assert outcomes["created"] == 30
    assert outcomes["created"] + outcomes["replayed"] == len(api.ledger.requests)


def test_worker_killed_mid_handler_processes_the_event_once(engine, inbox_settings, tmp_path):
    # The killed worker's message goes back to the queue once its heartbeat is this old.
    inbox_settings = inbox_settings.replace(broker_heartbeat_timeout_ms=1000)
    blocker = psycopg.connect(inbox_settings.require_database_url())
    blocker.execute("SELECT pg_advisory_lock(42)")  # the slow handler will wait on it
    produce(engine, [NewEvent("entry.booked", {"order_id": "k1", "slow": 0.1})])
    publish_repeated(inbox_settings, times=1)
    worker = start_worker(inbox_settings, APP, tmp_path / "worker1.log", 1, 1)
    try:
        wait_until(
            lambda: (
                scalar(
                    engine,
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
                )
                == 1
            ),
            timeout=30,
        )  # the handler is inside its transaction, waiting
        stop_process(worker, signal.SIGKILL)
        blocker.execute("SELECT pg_advisory_unlock(42)")
        blocker.commit()
        assert scalar(engine, "SELECT count(*) FROM effects") == 0
        worker = start_worker(inbox_settings, APP, tmp_path / "worker2.log", 1, 1)
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM effects") == 1, timeout=60)
        time.sleep(1.0)
    finally:
        stop_process(worker)
        blocker.close()
    assert scalar(engine, "SELECT count(*) FROM effects") == 1
    assert scalar(engine, "SELECT status FROM pipeline.inbox") == "processed"


def test_a_duplicate_meeting_its_twins_open_claim_in_a_worker_process_is_no_outage(
    engine, inbox_settings, tmp_path
):
    """Two copies of one message in a real worker: while the first copy's handler holds its
    claim open (waiting on a lock the test holds), the second copy's claim gives it back.
    That is one INFO line per try and no infrastructure retry; once the first commits, the
    second is a duplicate and the effect happens once."""
    blocker = psycopg.connect(inbox_settings.require_database_url())
    blocker.execute("SELECT pg_advisory_lock(42)")  # the slow handler will wait on it
    produce(engine, [NewEvent("entry.booked", {"order_id": "twin", "slow": 0.01})])
    publish_repeated(inbox_settings, times=2)
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    log = tmp_path / "worker.log"
    worker = start_worker(inbox_settings, APP, log, 1, 2, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir))
    given_back = "another copy of the message is being handled"
    outage = "failed outside its handlers"

    def counted(name: str) -> float:
        return multiprocess_metric(metrics_dir, name, consumer="ledger")

    try:
        # the second copy's claim gave up on the first's open one: logged either way
        wait_until(
            lambda: log.exists() and any(line in log.read_text() for line in (given_back, outage)),
            timeout=60,
        )
        blocker.execute("SELECT pg_advisory_unlock(42)")
        blocker.commit()
        wait_until(lambda: counted("pipeline_inbox_duplicates_total") == 1, timeout=60)
    finally:
        stop_process(worker)
        blocker.close()
    assert stage_counts(engine, "ledger") == Counter({"twin": 1})
    assert counted("pipeline_inbox_processed_total") == 1
    assert counted("pipeline_inbox_infrastructure_retries_total") == 0
    text_logged = log.read_text()
    assert given_back in text_logged
    assert outage not in text_logged
    assert "Traceback" not in text_logged


@pytest.mark.soak
def test_three_stage_workflow_with_random_failures_runs_each_stage_once(
    engine, inbox_settings, monkeypatch
):
    monkeypatch.setattr(f"{APP}.FAIL_RATE", 0.1)
    orders = [f"wf-{i}" for i in range(soak(300, 1000))]
    # Placed before the pipeline runs: the test's 50-order transactions and the handlers'
    # follow-ups take key locks in different orders, and can deadlock each other.
    produce(
        engine,
        [
            NewEvent("order.placed", {"order_id": o}, aggregate_type="order", aggregate_id=o)
            for o in orders
        ],
        per_transaction=50,
    )
    with running_pipeline(inbox_settings, APP, threads=8):
        wait_all_notified(engine, orders, interval=0.2)
        time.sleep(0.5)  # a late duplicate would show now
    for stage in ("payments", "inventory", "notifications"):
        assert stage_counts(engine, stage) == Counter({o: 1 for o in orders}), stage
    assert scalar(engine, "SELECT count(*) FROM pipeline.attempts WHERE stage = 'consume'") > 0
    assert scalar(engine, "SELECT count(*) FROM pipeline.dead_letters") == 0
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT id, event_type, headers->>'causation_id', headers->>'correlation_id'"
                " FROM pipeline.outbox"
            )
        ).all()
    by_id = {str(r[0]): r for r in rows}
    chains = 0
    for row in rows:
        if row[1] == "stock.reserved":
            charged = by_id[row[2]]
            placed = by_id[charged[2]]
            assert (charged[1], placed[1]) == ("payment.charged", "order.placed")
            assert row[3] == charged[3] == placed[3] == str(placed[0])  # one correlation id
            chains += 1
    assert chains == len(orders)


@pytest.mark.soak
def test_ordered_consumer_processes_each_key_in_sequence(engine, inbox_settings, monkeypatch):
    monkeypatch.setattr(f"{APP}.FAIL_RATE", 0.05)
    keys, steps = soak(40, 100), soak(25, 50)
    with running_pipeline(inbox_settings.replace(max_events_per_message=5), APP, threads=8):
        events = [
            NewEvent("seq.step", {"n": n}, ordering_key=f"key-{k}")
            for n in range(steps)
            for k in range(keys)
        ]
        produce(engine, events, per_transaction=100)
        wait_until(
            lambda: scalar(engine, "SELECT count(*) FROM seq_log") == keys * steps,
            timeout=60,
            interval=0.2,
            progress=lambda: scalar(engine, "SELECT count(*) FROM seq_log"),
        )
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT ordering_key, seq, n FROM seq_log ORDER BY id")).all()
    seen: dict[str, list[int]] = {}
    for key, _, n in rows:
        seen.setdefault(key, []).append(n)
    assert len(seen) == keys
    for key, ns in seen.items():
        assert ns == list(range(steps)), f"{key} processed out of order: {ns[:20]}"


def test_garbage_and_unknown_consumer_messages_are_dead_lettered(engine, inbox_settings):
    client = redis.Redis.from_url(inbox_settings.require_redis_url())
    ns, queue = inbox_settings.redis_namespace, "pipeline.ledger"
    bodies, ids = messages_key(ns, queue), queue_key(ns, queue)
    client.hset(bodies, "garbage-1", b"\xff\xfenot json at all")
    client.rpush(ids, "garbage-1")
    ghost = {
        "queue_name": queue,
        "actor_name": "pipeline_inbox_ghost",
        "args": [[]],
        "kwargs": {},
        "options": {REDIS_MESSAGE_ID: "ghost-1"},
        "message_id": str(uuid.uuid4()),
        "message_timestamp": int(time.time() * 1000),
    }
    client.hset(bodies, "ghost-1", json.dumps(ghost))
    client.rpush(ids, "ghost-1")
    bad_args = dict(
        ghost,
        actor_name="pipeline_inbox_ledger",
        args=[{"not": "a list"}],
        options={REDIS_MESSAGE_ID: "bad-1"},
        message_id=str(uuid.uuid4()),
    )
    client.hset(bodies, "bad-1", json.dumps(bad_args))
    client.rpush(ids, "bad-1")
    runtime = build_runtime(inbox_settings, app_registry(APP), set_global_broker=False)
    try:
        with running_worker(runtime, threads=2) as worker:
            wait_until(
                lambda: scalar(engine, "SELECT count(*) FROM pipeline.dead_letters") == 3, 30
            )
            produce(engine, [NewEvent("entry.booked", {"order_id": "after-garbage"})])
            publish_repeated(inbox_settings, times=1)
            wait_until(lambda: scalar(engine, "SELECT count(*) FROM effects") == 1, timeout=30)
            threads = [*worker.consumers.values(), *worker.workers]
            assert all(thread.is_alive() for thread in threads)  # still consuming
    finally:
        runtime.close()
        client.close()
    with engine.connect() as conn:
        reasons = [
            r[0] for r in conn.execute(text("SELECT reason FROM pipeline.dead_letters ORDER BY id"))
        ]
    assert any(r.startswith("undecodable message") for r in reasons), reasons
    assert any("pipeline_inbox_ghost" in r and "unknown consumer" in r for r in reasons), reasons
    assert any("not a non-empty list" in r for r in reasons), reasons
    raw = scalar(
        engine, "SELECT raw_message FROM pipeline.dead_letters WHERE raw_message IS NOT NULL"
    )
    assert "not json at all" in raw


def test_a_dead_lettered_envelope_does_not_block_its_key_for_an_ordered_consumer(
    engine, inbox_settings
):
    from pipeline.inbox.consumer import consumer

    routes = Registry()
    handled: list[int] = []
    consumer("seq", ["step"], ordered=True, registry=routes)(
        lambda event, ctx: handled.append(event.seq)
    )
    resent: list = []
    processor = direct_processor(engine, inbox_settings, routes, resent)
    first, second = uuid.uuid4(), uuid.uuid4()
    with engine.begin() as conn:  # what the relay records when it delivers the key's events
        conn.execute(
            text(
                "INSERT INTO pipeline.inbox"
                " (consumer, event_id, event_type, ordering_key, seq, status)"
                " VALUES ('seq', :a, 'step', 'k', 1, 'pending'),"
                " ('seq', :b, 'step', 'k', 2, 'pending')"
            ),
            {"a": first, "b": second},
        )
    broken = {"specversion": "1.0", "id": str(first), "type": "step", "source": "/t"}  # no data
    good = dict(broken, id=str(second), data={}, pipelineseq=2, pipelineorderingkey="k")
    outcome = processor.handle([broken, good])
    assert (outcome.dead, outcome.processed, outcome.deferred) == (1, 1, 0)
    assert handled == [2] and resent == []
    with engine.connect() as conn:
        statuses = dict(
            conn.execute(
                text("SELECT event_id, status FROM pipeline.inbox WHERE consumer = 'seq'")
            ).all()
        )
        reason = conn.execute(text("SELECT reason FROM pipeline.dead_letters")).scalar()
    assert statuses == {first: "dead", second: "processed"}
    assert reason == "invalid envelope: envelope has no data"


def test_a_lost_database_connection_is_redelivered_not_counted_as_a_handler_failure(
    engine, inbox_settings
):
    """A one-event message has no savepoint; if its connection dies, the message must go
    back to Dramatiq (infrastructure retry), not spend one of the handler's attempts."""
    from sqlalchemy.exc import DBAPIError

    from pipeline.inbox.consumer import consumer

    routes = Registry()
    calls: list[int] = []

    def handler(event, ctx):
        calls.append(1)
        if len(calls) == 1:
            ctx.session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))

    consumer("fragile", ["step"], max_retries=0, registry=routes)(handler)
    processor = direct_processor(engine, inbox_settings, routes)
    envelope = {"specversion": "1.0", "id": str(uuid.uuid4()), "type": "step", "source": "/t"}
    envelope["data"] = {}
    with pytest.raises(DBAPIError):
        processor.handle([envelope])
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT count(*) FROM pipeline.inbox")).scalar()
        dead = conn.execute(text("SELECT count(*) FROM pipeline.dead_letters")).scalar()
    assert (rows, dead) == (0, 0)
    assert processor.handle([envelope]).processed == 1  # the redelivery runs normally
    assert len(calls) == 2


def direct_processor(engine, settings: Settings, routes: Registry, resent: list | None = None):
    """An InboxProcessor for the registry's only consumer, outside any worker."""
    from pipeline.inbox.consumer import definitions
    from pipeline.inbox.processor import InboxProcessor

    subscription, definition = definitions(routes)[0]
    sink = resent if resent is not None else []
    return InboxProcessor(
        settings,
        subscription,
        definition,
        lambda: engine,
        lambda envelopes, delay, deferrals: sink.append([e["id"] for e in envelopes]),
    )


def step_envelope(number: int) -> dict:
    return {
        "specversion": "1.0",
        "id": str(uuid.UUID(int=number)),
        "type": "step",
        "source": "/t",
        "data": {"n": number},
    }


def _received(number: int):
    from pipeline.envelope import decode_envelope

    return decode_envelope(step_envelope(number))


def test_a_batch_without_failures_claims_once_and_uses_no_savepoint(engine, inbox_settings):
    from sqlalchemy import event as sa_event

    from pipeline.inbox.consumer import consumer
    from pipeline.observability import metrics

    routes = Registry()
    consumer("batcher", ["step"], registry=routes)(
        lambda event, ctx: ctx.session.execute(
            text("INSERT INTO effects (stage, order_id, event_id) VALUES ('b', :n, :id)"),
            {"n": str(event.data["n"]), "id": event.id},
        )
    )
    processor = direct_processor(engine, inbox_settings, routes)
    processor.handle([step_envelope(1)])  # already processed: a duplicate in the batch
    before = metrics.inbox_duplicates.labels("batcher", "step")._value.get()
    statements: list[str] = []

    def record(conn, cursor, statement, *args) -> None:
        code = [line for line in statement.splitlines() if not line.startswith("--")]
        statements.append(" ".join(code).split()[0].upper())

    sa_event.listen(engine, "before_cursor_execute", record)
    try:
        batch = [step_envelope(n) for n in (1, 2, 3, 4, 2)]  # 2 twice in one message
        outcome = processor.handle(batch)
    finally:
        sa_event.remove(engine, "before_cursor_execute", record)
    assert (outcome.processed, outcome.duplicates, outcome.retried) == (3, 2, 0)
    assert metrics.inbox_duplicates.labels("batcher", "step")._value.get() == before + 2
    assert stage_counts(engine, "b") == Counter({"1": 1, "2": 1, "3": 1, "4": 1})
    # one claim for the message (an INSERT in a WITH that bounds its lock wait), one
    # INSERT per handler, one recording the two duplicates (delivery_log, for
    # `pipeline status`), and no SAVEPOINT / RELEASE
    assert Counter(statements) == Counter({"WITH": 1, "INSERT": 4})
    with engine.connect() as conn:
        logged = conn.execute(
            text(
                "SELECT kind, count(*) FROM pipeline.delivery_log"
                " WHERE consumer = 'batcher' GROUP BY kind"
            )
        ).all()
    assert logged == [("duplicate", 2)]


@pytest.mark.parametrize(
    ("events", "held"),
    [(1, 1), (3, 1), (3, 3)],
    ids=["one-event", "batch-first-held", "batch-last-held"],
)
def test_a_claim_held_by_another_open_transaction_gives_the_message_back(
    engine, inbox_settings, events, held
):
    """A stuck worker's open claim must not hold another worker's thread for the whole
    lock timeout (here 60 s): the claim waits briefly, then fails as ClaimHeld (Dramatiq
    retries the message later). The holder commits 3 s later; a claim that waited the
    usual timeout would have seen that outcome and reported a duplicate instead."""
    import threading

    from pipeline.db.connect import make_engine
    from pipeline.db.stores.inbox import ClaimHeld
    from pipeline.inbox.consumer import consumer

    patient = inbox_settings.replace(lock_timeout_ms=60_000)
    patient_engine = make_engine(patient)
    routes = Registry()
    handled: list[int] = []
    consumer("claimer", ["step"], registry=routes)(
        lambda event, ctx: handled.append(event.data["n"])
    )
    processor = direct_processor(patient_engine, patient, routes)
    holder = engine.connect()
    holder.execute(
        text(
            "INSERT INTO pipeline.inbox (consumer, event_id, event_type, ordering_key, seq,"
            " status, attempts, processed_at) VALUES ('claimer', :id, 'step', NULL, NULL,"
            " 'processed', 1, now())"
        ),
        {"id": uuid.UUID(int=held)},
    )  # open: the claim of a worker that stopped mid-handler (the last one locked too)
    release = threading.Timer(3.0, holder.commit)
    release.start()
    try:
        with pytest.raises(Exception) as raised:
            processor.handle([step_envelope(n) for n in range(1, events + 1)])
    finally:
        release.join()
        holder.close()
    assert isinstance(raised.value, ClaimHeld), repr(raised.value)
    assert isinstance(raised.value.__cause__.orig, psycopg.errors.LockNotAvailable)
    assert handled == []  # the whole message was given back, its neighbours too
    # Given again once the holder has committed: the rest is handled, the held one is a
    # duplicate; and after a claim the transaction's lock waits are the usual ones.
    outcome = processor.handle([step_envelope(n) for n in range(1, events + 1)])
    assert (outcome.processed, outcome.duplicates) == (events - 1, 1)
    assert handled == [n for n in range(1, events + 1) if n != held]
    with patient_engine.connect() as conn, conn.begin():
        assert processor.store.claim_many(conn, "claimer", [_received(99), _received(98)])
        assert processor.store.claim(conn, "claimer", _received(97)) == 1
        assert conn.exec_driver_sql("SHOW lock_timeout").scalar_one() == "1min"
        conn.rollback()
    patient_engine.dispose()


def test_a_claim_waiting_on_the_table_lock_stays_an_outage(engine, inbox_settings):
    """Only a wait on a copy's claimed row is ClaimHeld: a claim that times out on the
    inbox table's own lock (a migration, LOCK TABLE) is an outage, counted as one."""
    from sqlalchemy.exc import OperationalError

    from pipeline.db.connect import make_engine
    from pipeline.db.stores.inbox import ClaimHeld, InboxStore

    brief = make_engine(inbox_settings.replace(lock_timeout_ms=200))
    holder = engine.connect()
    holder.execute(text("LOCK TABLE pipeline.inbox IN ACCESS EXCLUSIVE MODE"))
    try:
        with brief.connect() as conn, conn.begin():
            with pytest.raises(OperationalError) as raised:
                InboxStore("pipeline").claim(conn, "locked", _received(1))
    finally:
        holder.rollback()
        holder.close()
        brief.dispose()
    assert not isinstance(raised.value, ClaimHeld)
    assert isinstance(raised.value.orig, psycopg.errors.LockNotAvailable)


def test_a_failing_handler_in_a_batch_keeps_its_neighbours_and_runs_once(engine, inbox_settings):
    from pipeline.inbox.consumer import consumer
    from pipeline.observability import metrics

    routes = Registry()
    calls: Counter = Counter()

    def handler(event, ctx) -> None:
        n = event.data["n"]
        calls[n] += 1
        ctx.session.execute(
            text("INSERT INTO effects (stage, order_id, event_id) VALUES ('f', :n, :id)"),
            {"n": str(n), "id": event.id},
        )
        if n == 3:
            raise RuntimeError("payment provider said no")

    consumer("fragile_batch", ["step"], max_retries=2, registry=routes)(handler)
    resent: list = []
    processor = direct_processor(engine, inbox_settings, routes, resent)
    processed_before = metrics.inbox_processed.labels("fragile_batch", "step")._value.get()
    outcome = processor.handle([step_envelope(n) for n in range(1, 6)])
    assert (outcome.processed, outcome.retried, outcome.dead) == (4, 1, 0)
    # 1 and 2 ran before 3 failed and were redone after the roll-back; 3 did not run again
    assert calls == Counter({1: 2, 2: 2, 3: 1, 4: 1, 5: 1})
    assert stage_counts(engine, "f") == Counter({"1": 1, "2": 1, "4": 1, "5": 1})
    assert resent == [[str(uuid.UUID(int=3))]]
    assert metrics.inbox_processed.labels("fragile_batch", "step")._value.get() == (
        processed_before + 4
    )
    with engine.connect() as conn:
        failed = conn.execute(
            text(
                "SELECT status, attempts, last_error_class FROM pipeline.inbox"
                " WHERE consumer = 'fragile_batch' AND event_id = :id"
            ),
            {"id": uuid.UUID(int=3)},
        ).one()
    assert tuple(failed) == ("failed", 1, "RuntimeError")
    # the retry is attempt 2 with the same idempotency key; it fails for good at attempt 3
    assert processor.handle([step_envelope(3)]).retried == 1
    assert processor.handle([step_envelope(3)]).dead == 1
    assert stage_counts(engine, "f")["3"] == 0


def test_a_time_limit_in_a_batch_resends_the_neighbours_instead_of_running_them_again(
    engine, inbox_settings
):
    from dramatiq.middleware import TimeLimitExceeded

    from pipeline.inbox.consumer import consumer

    routes = Registry()
    calls: Counter = Counter()

    def handler(event, ctx) -> None:
        calls[event.data["n"]] += 1
        if event.data["n"] == 2:
            raise TimeLimitExceeded()

    consumer("slow_batch", ["step"], max_retries=3, registry=routes)(handler)
    resent: list = []
    processor = direct_processor(engine, inbox_settings, routes, resent)
    outcome = processor.handle([step_envelope(n) for n in (1, 2, 3)])
    assert (outcome.processed, outcome.retried) == (0, 1)
    assert calls == Counter({1: 1, 2: 1})  # 1 is not run again past the limit, 3 never ran
    assert sorted(resent) == sorted(
        [[str(uuid.UUID(int=2))], [str(uuid.UUID(int=n)) for n in (1, 3)]]
    )
    assert scalar(engine, "SELECT count(*) FROM pipeline.inbox WHERE consumer = 'slow_batch'") == 1


def test_an_ordered_message_of_many_events_commits_without_deep_savepoint_nesting(
    engine, inbox_settings
):
    """A message of 400 events (deferred events of a key travel together, and grow) is
    handled in one transaction: savepoints are released every so often, so its COMMIT
    does not recurse once per event (a RecursionError past ~300 events)."""
    from pipeline.inbox.consumer import consumer

    routes = Registry()
    consumer("many", ["step"], ordered=True, registry=routes)(
        lambda event, ctx: ctx.session.execute(
            text("INSERT INTO effects (stage, order_id, event_id) VALUES ('m', :n, :id)"),
            {"n": str(event.data["n"]), "id": event.id},
        )
    )
    processor = direct_processor(engine, inbox_settings, routes)
    outcome = processor.handle([step_envelope(n) for n in range(1, 401)])
    assert outcome.processed == 400
    assert len(stage_counts(engine, "m")) == 400
