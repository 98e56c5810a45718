"""Relay: notify and poll wake-ups, claim/lease/fencing, retries, dead letters, per-key order."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from pipeline import NewEvent, add_event
from pipeline.backoff import backoff_ceiling, full_jitter
from pipeline.db.stores.outbox import Settlement
from pipeline.observability import metrics
from pipeline.relay.drain import Drainer
from pipeline.runtime import build_runtime
from pipeline.transport.publisher import Delivery, PublisherUnavailable
from tests.integration.conftest import drainer_for
from tests.support import produce, queue_envelopes, queue_messages, running_relay, wait_until


def statuses(engine) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(
            conn.execute(text("SELECT status, count(*) FROM pipeline.outbox GROUP BY 1")).all()
        )


def counter(metric, *labels: str) -> float:
    return metric.labels(*labels)._value.get() if labels else metric._value.get()


def test_batch_is_delivered_to_every_subscriber_and_marked_sent(engine, any_runtime):
    ids = produce(engine, [NewEvent("order.placed", {"n": i}, aggregate_id="o1") for i in range(3)])
    produce(engine, [NewEvent("user.signed_up", {"u": 1})])
    unrouted_before = counter(metrics.events_unrouted, "user.signed_up")
    any_runtime.registry.remove("audit")
    result = drainer_for(any_runtime).run_batch()
    assert (result.claimed, result.sent, result.unrouted) == (4, 4, 1)
    assert counter(metrics.events_unrouted, "user.signed_up") == unrouted_before + 1
    messages = queue_messages(any_runtime.settings, "pipeline.billing")
    assert len(messages) == 1  # one key's run travels as one message
    envelopes = messages[0]["args"][0]
    assert [e["id"] for e in envelopes] == [str(i) for i in ids]
    first = envelopes[0]
    assert first["specversion"] == "1.0" and first["type"] == "order.placed"
    assert first["data"] == {"n": 0} and first["subject"] == "o1"
    assert first["pipelineorderingkey"] == ":o1"
    assert messages[0]["actor_name"] == "pipeline_inbox_billing"
    assert statuses(engine) == {"sent": 4}


def test_a_key_is_published_in_commit_order_even_with_concurrent_producers(engine, any_runtime):
    drainer = drainer_for(any_runtime)
    early = Session(engine)
    early.begin()
    early_id = add_event(early, "order.placed", {"step": 1}, aggregate_id="k")
    early.flush()  # holds key k's sequence lock until it commits
    later_ids: list = []
    blocked = threading.Thread(
        target=lambda: later_ids.extend(
            produce(engine, [NewEvent("order.placed", {"step": 2}, aggregate_id="k")])
        )
    )
    blocked.start()
    free_id = produce(engine, [NewEvent("order.placed", {"free": True}, aggregate_id="f")])[0]
    blocked.join(0.5)
    assert blocked.is_alive()  # the second producer of key k queues behind the first
    # other keys flow, even while a transaction stays open (no global xmin gate)
    assert [e.id for e in drainer.claim()[1]] == [free_id]
    early.commit()
    early.close()
    blocked.join(10)
    with engine.connect() as conn:
        seqs = dict(conn.execute(text("SELECT id, seq FROM pipeline.outbox")).all())
    assert seqs[early_id] < seqs[later_ids[0]]  # numbered under the lock: seq = commit order
    drainer.conn.execute("UPDATE pipeline.outbox SET status='pending' WHERE status='publishing'")
    while drainer.run_batch().claimed:
        pass
    seen = [e["id"] for e in queue_envelopes(any_runtime.settings, "pipeline.billing")]
    assert seen.index(str(early_id)) < seen.index(str(later_ids[0]))


def test_fencing_token_stops_a_publisher_whose_lease_expired(engine, runtime):
    produce(engine, [NewEvent("order.placed", {"n": 1})])
    slow, fast = drainer_for(runtime), drainer_for(runtime)
    token, events = slow.claim()
    assert len(events) == 1
    slow.conn.execute("UPDATE pipeline.outbox SET lease_expires_at = now() - interval '1 s'")
    assert fast.run_batch().sent == 1  # the expired lease was reclaimed
    settlement = Settlement(token, sent=[events[0].id], routes=slow._routes(events))
    rows = slow.store.settle(slow.conn, settlement)
    assert rows == []  # the stale publisher's write is fenced off
    attempts = slow.conn.execute("SELECT attempts FROM pipeline.outbox").fetchone()
    assert attempts == (2,)


class FlakyPublisher:
    """Fails every delivery containing a poison event; passes the rest to the real one."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def deliver(self, deliveries: Sequence[Delivery]):
        outcomes = self.inner.deliver(
            [d for d in deliveries if not any(e.event_type == "poison" for e in d.events)]
        )
        it = iter(outcomes)
        return [
            RuntimeError("downstream rejected it")
            if any(e.event_type == "poison" for e in d.events)
            else next(it)
            for d in deliveries
        ]

    def close(self) -> None:
        pass


def test_poison_event_is_retried_with_jitter_then_dead_lettered_while_others_flow(
    engine, runtime, consumers
):
    consumers.subscribe("quarantine", ["poison"])
    settings = runtime.settings.replace(
        publish_max_attempts=4, publish_backoff_base=0.02, publish_backoff_max=0.1
    )
    drainer = drainer_for(runtime, FlakyPublisher(runtime.publisher))
    drainer.settings = settings
    poison_id = produce(engine, [NewEvent("poison", {"x": 1}, aggregate_id="bad")])[0]
    blocked_id = produce(engine, [NewEvent("order.placed", {"x": 2}, aggregate_id="bad")])[0]
    produce(
        engine, [NewEvent("order.placed", {"i": i}, aggregate_id=str(i % 50)) for i in range(1000)]
    )
    delays = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        drainer.run_batch()
        row = drainer.conn.execute(
            "SELECT status, attempts, next_attempt_at - now() FROM pipeline.outbox WHERE id = %s",
            [poison_id],
        ).fetchone()
        if row[0] == "dead":
            break
        if row[0] == "pending" and row[1] and (not delays or delays[-1][0] != row[1]):
            delays.append((row[1], row[2].total_seconds()))
        time.sleep(0.005)
    while drainer.run_batch().claimed:
        pass
    counts = statuses(engine)
    assert counts == {"sent": 1001, "dead": 1}
    # each retry waited within [0, min(cap, base * 2^(n-1))]
    assert [a for a, _ in delays] == [1, 2, 3]
    for attempt, delay in delays:
        assert delay <= backoff_ceiling(attempt, 0.02, 0.1) + 0.01
    dead = drainer.conn.execute(
        "SELECT stage, reason, error_class, error, attempts FROM pipeline.dead_letters"
    ).fetchall()
    assert dead == [
        (
            "publish",
            "gave up after 4 attempts",
            "RuntimeError",
            "RuntimeError: downstream rejected it",
            4,
        )
    ]
    history = drainer.conn.execute(
        "SELECT attempt FROM pipeline.attempts WHERE event_id = %s ORDER BY attempt", [poison_id]
    ).fetchall()
    assert history == [(1,), (2,), (3,), (4,)]
    # the event behind the poison in its key was held back until the poison was dead-lettered
    billing = [e["id"] for e in queue_envelopes(runtime.settings, "pipeline.billing")]
    assert str(blocked_id) in billing


def test_full_jitter_stays_within_bounds_and_spreads():
    rng = random.Random(1)
    for attempt in range(1, 30):
        ceiling = backoff_ceiling(attempt, 0.5, 300)
        samples = [full_jitter(attempt, 0.5, 300, rng) for _ in range(200)]
        assert all(0 <= s <= ceiling for s in samples)
        assert max(samples) > ceiling * 0.8 and min(samples) < ceiling * 0.2
    assert backoff_ceiling(1, 0.5, 300) == 0.5 and backoff_ceiling(4, 0.5, 300) == 4.0
    assert backoff_ceiling(100, 0.5, 300) == 300


def test_notify_path_delivers_without_waiting_for_a_poll(engine, relay_settings, consumers):
    slow_poll = relay_settings.replace(poll_interval_min=60.0, poll_interval_max=60.0)
    runtime = build_runtime(slow_poll, consumers)
    try:
        with running_relay(runtime, consumers, mode="inline") as relay:
            time.sleep(0.3)  # let the start-up sweep finish; the relay is now idle
            notified = counter(metrics.relay_wakeups, "notify")
            with Session(engine) as session, session.begin():
                event_id = add_event(session, "order.placed", {"n": 1})
            wait_until(lambda: queue_envelopes(slow_poll, "pipeline.audit"), timeout=10)
            assert queue_envelopes(slow_poll, "pipeline.audit")[0]["id"] == str(event_id)
            assert counter(metrics.relay_wakeups, "notify") > notified
            assert relay.cycles <= 3  # start-up sweep + the notification, no polling
    finally:
        runtime.close()


def test_polling_fallback_without_listen(engine, runtime, consumers):
    with running_relay(runtime, consumers, mode="inline", listen=False):
        produce(engine, [NewEvent("order.paid", {"n": i}) for i in range(5)])
        wait_until(lambda: len(queue_envelopes(runtime.settings, "pipeline.audit")) == 5, 5)
    assert statuses(engine) == {"sent": 5}


def test_listener_reconnects_after_its_backend_is_terminated(engine, runtime, consumers):
    reconnects = counter(metrics.relay_listener_reconnects)
    with running_relay(runtime, consumers, mode="inline") as relay:
        assert relay.listener is not None
        pid = relay.listener.backend_pid()
        with psycopg.connect(runtime.settings.require_database_url(), autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        produce(engine, [NewEvent("order.paid", {"during": "outage"})])
        wait_until(lambda: queue_envelopes(runtime.settings, "pipeline.audit"), timeout=5)
        wait_until(lambda: relay.listener.connections >= 2, timeout=10)
        assert relay.listener.backend_pid() != pid
        produce(engine, [NewEvent("order.paid", {"after": "reconnect"})])
        wait_until(lambda: len(queue_envelopes(runtime.settings, "pipeline.audit")) == 2, 5)
    assert counter(metrics.relay_listener_reconnects) >= reconnects + 1


def test_busy_relay_suppresses_notify_and_hands_off_when_idle(engine, runtime, consumers):
    """While the relay drains a backlog producers skip NOTIFY; afterwards they notify again."""
    conn = psycopg.connect(runtime.settings.require_database_url(), autocommit=True)
    conn.execute("LISTEN pipeline_outbox")
    conn.execute(
        "INSERT INTO pipeline.relay_state (relay_id, busy, host, pid) VALUES ('x', true, 'h', 1)"
    )
    produce(engine, [NewEvent("a", {})])
    assert list(conn.notifies(timeout=0.3)) == []  # a fresh busy relay: no NOTIFY
    conn.execute("UPDATE pipeline.relay_state SET heartbeat_at = now() - interval '10 s'")
    produce(engine, [NewEvent("a", {})])
    assert len(list(conn.notifies(timeout=1, stop_after=1))) == 1  # stale busy flag: NOTIFY
    conn.execute("DELETE FROM pipeline.relay_state")
    with running_relay(runtime, consumers, mode="inline") as relay:
        produce(engine, [NewEvent("a", {"i": i}) for i in range(3000)], per_transaction=50)
        wait_until(lambda: statuses(engine) == {"sent": 3002}, timeout=30)
        wait_until(lambda: not relay.busy, timeout=10)
        busy = conn.execute("SELECT busy FROM pipeline.relay_state").fetchall()
        assert busy == [(False,)]
        produce(engine, [NewEvent("a", {"after": "idle"})])
        wait_until(lambda: statuses(engine) == {"sent": 3003}, timeout=5)
    conn.close()


def test_a_slow_stream_keeps_the_relay_on_notify_and_a_fast_one_makes_it_busy(
    engine, runtime, consumers
):
    """Busy polling pays off only above one wake-up per ``poll_interval_busy`` (200/s)."""
    with running_relay(runtime, consumers, mode="inline") as relay:
        time.sleep(0.3)  # let the start-up sweep finish; the relay is now idle
        for n in range(20):  # 50 transactions/s: every one NOTIFYs, every one is found
            produce(engine, [NewEvent("order.placed", {"n": n})])
            time.sleep(0.02)
        wait_until(lambda: statuses(engine) == {"sent": 20}, timeout=10)
        assert relay.busy_spells == 0

        def burst() -> None:
            # ten events a transaction: 400 events/s needs only 40 commits/s across eight
            # threads, which a slow, shared CI machine still manages (one event a commit
            # did not always reach 200 events/s there)
            produce(engine, [NewEvent("order.placed", {"n": n}) for n in range(250)], 10)

        threads = [threading.Thread(target=burst) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wait_until(lambda: statuses(engine) == {"sent": 2020}, timeout=30)
        assert relay.busy_spells >= 1


def test_redis_outage_keeps_events_pending_and_resumes(
    engine, relay_settings, consumers, private_redis
):
    settings = relay_settings.replace(redis_url=private_redis.url)
    runtime = build_runtime(settings, consumers)
    try:
        with running_relay(runtime, consumers, mode="inline"):
            produce(engine, [NewEvent("order.placed", {"n": 0})])
            wait_until(lambda: statuses(engine) == {"sent": 1}, timeout=10)
            private_redis.kill()
            produce(
                engine,
                [
                    NewEvent("order.placed", {"n": i}, aggregate_id=str(i % 7))
                    for i in range(1, 101)
                ],
            )
            time.sleep(2.0)  # several failed delivery rounds; between them nothing is leased
            wait_until(lambda: statuses(engine) == {"sent": 1, "pending": 100}, timeout=15)
            with engine.connect() as c:  # an outage is not the events' fault
                assert (
                    c.execute(
                        text("SELECT max(attempts) FROM pipeline.outbox WHERE status = 'pending'")
                    ).scalar()
                    == 0
                )
            private_redis.start()
            wait_until(lambda: statuses(engine) == {"sent": 101}, timeout=30)
        ids = [e["id"] for e in queue_envelopes(settings, "pipeline.audit")]
        assert len(ids) == len(set(ids)) == 100  # Redis restarted empty: the 100 are there
    finally:
        runtime.close()


def test_publisher_unavailable_releases_the_batch_without_counting_attempts(engine, runtime):
    class Down:
        def deliver(self, deliveries):
            raise PublisherUnavailable("down")

        def close(self) -> None:
            pass

    produce(engine, [NewEvent("a", {"n": 1})])
    with pytest.raises(PublisherUnavailable):
        drainer_for(runtime, Down()).run_batch()
    with engine.connect() as c:
        row = c.execute(text("SELECT status, attempts, lease_token FROM pipeline.outbox")).one()
    assert tuple(row) == ("pending", 0, None)


def test_many_threads_claiming_never_double_deliver_and_keep_key_order(engine, any_runtime):
    produce(
        engine,
        [NewEvent("order.placed", {"i": i}, aggregate_id=str(i % 40)) for i in range(4000)],
        per_transaction=200,
    )
    drainers = [drainer_for(any_runtime) for _ in range(4)]
    for d in drainers:
        d.settings = any_runtime.settings.replace(batch_size=97)

    def work(d: Drainer) -> None:
        while d.run_batch().claimed or statuses(engine).get("pending"):
            pass

    threads = [threading.Thread(target=work, args=(d,)) for d in drainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    envelopes = queue_envelopes(any_runtime.settings, "pipeline.billing")
    ids = [e["id"] for e in envelopes]
    assert len(ids) == len(set(ids)) == 4000
    last: dict[str, int] = {}
    for env in envelopes:
        key, seq = env["pipelineorderingkey"], env["pipelineseq"]
        assert seq > last.get(key, -1), f"key {key} out of order"
        last[key] = seq


def test_a_blocked_key_does_not_crowd_other_keys_out_of_the_claim(engine, runtime):
    """Events queued behind a head that waits for a retry must not fill the scan window."""
    drainer = drainer_for(runtime)
    drainer.settings = runtime.settings.replace(batch_size=10)  # scan window: 40 rows
    produce(engine, [NewEvent("order.placed", {"n": 0}, aggregate_id="stuck")])
    with engine.begin() as conn:  # its head failed and waits an hour for its next attempt
        conn.execute(text("UPDATE pipeline.outbox SET next_attempt_at = now() + interval '1 hour'"))
    produce(
        engine, [NewEvent("order.placed", {"n": n}, aggregate_id="stuck") for n in range(1, 101)]
    )
    others = produce(
        engine,
        [NewEvent("order.placed", {"k": 1}, aggregate_id="other"), NewEvent("user.seen", {"u": 1})],
    )
    claimed = [event.id for event in drainer.claim()[1]]
    assert sorted(claimed) == sorted(others)
    with engine.connect() as conn:
        waiting = conn.execute(
            text(
                "SELECT count(*) FROM pipeline.outbox WHERE ordering_key = :key"
                " AND next_attempt_at > now() + interval '50 minutes'"
            ),
            {"key": ":stuck"},
        ).scalar()
    assert waiting == 101  # the whole key waits with its head


def test_publisher_reloads_its_script_after_redis_forgets_it(engine, runtime):
    """EVALSHA skips redis-py's SCRIPT EXISTS round trip, so NOSCRIPT must be handled."""
    produce(engine, [NewEvent("order.placed", {"n": 1}, aggregate_id="a")])
    runtime.broker.client.script_flush()
    result = drainer_for(runtime).run_batch()
    assert (result.claimed, result.sent, result.retried) == (1, 1, 0)
    assert len(queue_envelopes(runtime.settings, "pipeline.billing")) == 1
    assert statuses(engine) == {"sent": 1}


def test_relay_transactions_commit_asynchronously_without_touching_the_session(engine, runtime):
    """A lost claim or outcome only re-publishes (docs/architecture.md), so they skip the WAL
    flush wait; the setting stays inside their transactions, never leaking to a pooled
    session another client could get through a transaction-pooling PgBouncer."""
    produce(engine, [NewEvent("order.placed", {"n": 1}, aggregate_id="a")])
    drainer = drainer_for(runtime)
    drainer.conn.execute("SET synchronous_commit = on")  # the test server runs without it
    show = "SHOW synchronous_commit"
    with drainer.conn.transaction():
        token, events = drainer.claim()
        assert drainer.conn.execute(show).fetchone() == ("off",)
    assert len(events) == 1
    with drainer.conn.transaction():
        settlement = Settlement(token, sent=[events[0].id], routes=drainer._routes(events))
        drainer.store.settle(drainer.conn, settlement)
        assert drainer.conn.execute(show).fetchone() == ("off",)
    assert drainer.conn.execute(show).fetchone() == ("on",)
    assert drainer.run_batch().claimed == 0
    assert statuses(engine) == {"sent": 1}


def test_claims_do_not_revisit_the_index_entries_of_sent_events(engine, runtime):
    """Until a vacuum, the unsent-events index still lists every event sent since the last
    one. A plain index scan marks such entries dead as it passes them, a bitmap scan never
    does: with one, every claim read them all again, thousands at 1,000 events/s."""
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE pipeline.outbox SET (autovacuum_enabled = false)"))
    drainer = drainer_for(runtime)
    produce(engine, [NewEvent("user.seen", {"n": n}) for n in range(1500)])
    while drainer.run_batch().claimed:
        pass
    assert statuses(engine) == {"sent": 1500}

    def entries_read() -> int:
        drainer.conn.execute("SELECT pg_stat_force_next_flush()")
        row = drainer.conn.execute(
            "SELECT idx_tup_read FROM pg_stat_user_indexes"
            " WHERE schemaname = 'pipeline' AND indexrelname = 'outbox_unsent_idx'"
        ).fetchone()
        assert row is not None
        return int(row[0])

    drainer.claim()  # may still pass the entries of the last batch, and marks them dead
    before = entries_read()
    produce(engine, [NewEvent("user.seen", {"n": -1})])
    assert len(drainer.claim()[1]) == 1
    assert entries_read() - before < 50  # not the 1,500 entries of the sent events


def test_ordered_consumers_rows_are_recorded_before_publishing_and_a_dead_event_stops_ordering(
    engine, runtime, consumers
):
    consumers.subscribe("sequenced", ["poison", "order.placed"], ordered=True)
    settings = runtime.settings.replace(
        publish_max_attempts=2, publish_backoff_base=0.01, publish_backoff_max=0.02
    )
    drainer = drainer_for(runtime, FlakyPublisher(runtime.publisher))
    drainer.settings = settings
    poison_id = produce(engine, [NewEvent("poison", {"x": 1}, aggregate_id="bad")])[0]
    after_id = produce(engine, [NewEvent("order.placed", {"x": 2}, aggregate_id="bad")])[0]
    drainer.run_batch()  # the poison fails its first attempt; the key's run is given back
    rows = drainer.conn.execute(
        "SELECT event_id, status, seq IS NOT NULL FROM pipeline.inbox WHERE consumer = 'sequenced'"
    ).fetchall()
    assert sorted(rows) == sorted([(poison_id, "pending", True), (after_id, "pending", True)])
    assert statuses(engine) == {"pending": 2}  # recorded before publishing, neither sent
    deadline = time.monotonic() + 30
    while statuses(engine).get("sent", 0) < 1 and time.monotonic() < deadline:
        drainer.run_batch()
        time.sleep(0.01)
    assert statuses(engine) == {"dead": 1, "sent": 1}
    rows = {
        row[0]: row[1:]
        for row in drainer.conn.execute(
            "SELECT event_id, status, seq IS NOT NULL, last_error_class FROM pipeline.inbox "
            "WHERE consumer = 'sequenced'"
        ).fetchall()
    }
    # the dead event's row no longer orders its key; the next event's row is on its way
    assert rows == {
        poison_id: ("pending", False, "DeadAtPublish"),
        after_id: ("pending", True, None),
    }
    held = drainer.conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pipeline.inbox p JOIN pipeline.inbox i "
        "ON i.consumer = p.consumer AND i.ordering_key = p.ordering_key "
        "WHERE i.event_id = %s AND p.consumer = 'sequenced' "
        "AND p.status IN ('pending', 'failed') AND p.seq < i.seq)",
        [after_id],
    ).fetchone()
    assert held == (False,)
