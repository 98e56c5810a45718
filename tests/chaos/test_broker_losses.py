"""No loss whatever the broker does: a Redis that forgets (restarted empty, before or under a
running relay, with an ordered key in flight), through real relay and worker processes."""

from __future__ import annotations

import json
import signal
import time

import pytest
from sqlalchemy import text

from pipeline import NewEvent
from pipeline.tools.harness.embedded import EmbeddedRedis
from tests.chaos.orders import (
    APP,
    assert_each_stage_once,
    place_orders,
    scalar,
    status_json,
    wait_all_notified,
    wait_all_sent,
)
from tests.support import (
    pipeline_env,
    produce,
    run_cli,
    soak,
    start_relay,
    start_worker,
    stop_process,
    wait_until,
)


def sent_then_forgotten(engine, settings, redis_server: EmbeddedRedis, orders, log) -> None:
    """``orders`` placed and handed to Redis by a relay (stopped then), and Redis restarted
    empty: their deliveries exist only in the ledger."""
    relay = start_relay(settings, APP, log)
    try:
        place_orders(engine, orders)
        wait_all_sent(engine, len(orders), [relay])
    finally:
        stop_process(relay)
    redis_server.kill()  # no persistence: every message is gone
    redis_server.start()


@pytest.mark.soak
def test_a_redis_that_forgets_delays_events_but_loses_none(engine, chaos_settings, tmp_path):
    """Events sent to Redis, Redis restarted empty before any worker ran: `pipeline status`
    reports the deliveries owed past the horizon, and the relay's ledger sweep sends them
    again, so every stage still runs once per order."""
    orders = [f"forget-{i}" for i in range(soak(100, 300))]
    with EmbeddedRedis(tmp_path / "redis") as redis_server:
        settings = chaos_settings.replace(redis_url=redis_server.url)
        sent_then_forgotten(engine, settings, redis_server, orders, tmp_path / "relay.log")
        time.sleep(settings.redelivery_horizon_seconds + 0.5)
        code, status = status_json(settings)
        assert code == 1 and not status["healthy"], status
        assert status["owed"] == {"payments": len(orders)}, status
        owed = f"{len(orders)} deliveries to payments"
        assert any(owed in p for p in status["problems"]), status
        event_id = scalar(engine, "SELECT id FROM pipeline.outbox ORDER BY seq LIMIT 1")
        traced = run_cli(["trace", str(event_id), "--json"], pipeline_env(settings, APP))
        assert traced.returncode == 0, traced.stderr
        (payments,) = json.loads(traced.stdout)["deliveries"]
        assert (payments["consumer"], payments["status"], payments["owed"]) == (
            "payments",
            "delivered",
            True,
        )

        relay = start_relay(settings, APP, tmp_path / "relay2.log")
        workers = start_worker(settings, APP, tmp_path / "worker.log", 2, 4)
        try:
            wait_all_notified(engine, orders, [relay, workers])
            time.sleep(1.0)
            code, status = status_json(settings)
        finally:
            stop_process(workers)
            stop_process(relay)
    assert_each_stage_once(engine, orders)
    assert code == 0 and status["owed"] == {}, status
    redelivered = scalar(
        engine, "SELECT sum(redeliveries) FROM pipeline.inbox WHERE consumer = 'payments'"
    )
    assert redelivered >= len(orders)


def test_a_redis_that_restarts_empty_is_noticed_and_owed_deliveries_are_sent_at_once(
    engine, chaos_settings, tmp_path
):
    """Redis restarts without persistence under a running relay, its messages gone: the
    relay notices (its marker key vanished) and sends what is owed at once, long before
    the redelivery horizon (set to ten minutes here) would have."""
    orders = [f"amnesia-{i}" for i in range(soak(50, 300))]
    with EmbeddedRedis(tmp_path / "redis") as redis_server:
        settings = chaos_settings.replace(
            redis_url=redis_server.url, redelivery_horizon_seconds=600.0
        )
        relay = start_relay(settings, APP, tmp_path / "relay.log")
        workers = None
        try:
            place_orders(engine, orders)
            wait_all_sent(engine, len(orders), [relay])
            redis_server.kill()  # no persistence: every message is gone
            redis_server.start()
            wait_until(
                lambda: "the broker lost its messages" in (tmp_path / "relay.log").read_text(),
                timeout=60,
                alive=[relay],
            )
            workers = start_worker(settings, APP, tmp_path / "worker.log", 1, 4)
            wait_all_notified(engine, orders, [relay, workers])
        finally:
            if workers is not None:
                stop_process(workers)
            stop_process(relay)
    assert_each_stage_once(engine, orders)
    redelivered = scalar(
        engine, "SELECT sum(redeliveries) FROM pipeline.inbox WHERE consumer = 'payments'"
    )
    assert redelivered == len(orders)  # each lost delivery sent again once, none twice
    assert (tmp_path / "relay.log").read_text().count("the broker lost its messages") == 1


def test_a_loss_noticed_while_another_relay_sweeps_owes_only_what_came_before_it(
    engine, chaos_settings, tmp_path
):
    """Redis restarts empty with deliveries on it; a relay starting then finds the memory
    marker gone while another relay holds the sweep, so its own sweep comes later. What
    was handed over before the notice is owed at once, and only that: what the relay sent
    in between went to the Redis that holds it. (Two relays starting together under load
    once sent a thousand deliveries twice this way.)"""
    lost = [f"lost-{i}" for i in range(20)]
    kept = [f"kept-{i}" for i in range(30)]
    sweeps = "SELECT sweeps FROM pipeline.delivery_sweep"
    with EmbeddedRedis(tmp_path / "redis") as redis_server:
        settings = chaos_settings.replace(
            redis_url=redis_server.url, redelivery_horizon_seconds=600.0
        )
        sent_then_forgotten(engine, settings, redis_server, lost, tmp_path / "relay1.log")
        log = tmp_path / "relay2.log"
        relay = workers = None
        try:
            with engine.connect() as other_relay:  # its sweep holds the ledger's lock
                held = other_relay.execute(
                    text("SELECT pg_try_advisory_xact_lock(hashtext('pipeline.ledger.' || :s))"),
                    {"s": settings.schema_name},
                ).scalar()
                assert held
                relay = start_relay(settings, APP, log)
                wait_until(
                    lambda: "no memory marker yet" in log.read_text(), timeout=60, alive=[relay]
                )
                place_orders(engine, kept)
                wait_all_sent(engine, len(lost) + len(kept), [relay])
                swept = scalar(engine, sweeps)
                other_relay.rollback()  # its sweep ends
            wait_until(lambda: scalar(engine, sweeps) > swept, timeout=60, alive=[relay])
            workers = start_worker(settings, APP, tmp_path / "worker.log", 1, 4)
            wait_all_notified(engine, lost + kept, [relay, workers])
        finally:
            for process in (workers, relay):
                if process is not None:
                    stop_process(process)
    assert_each_stage_once(engine, lost + kept)
    with engine.connect() as conn:
        by_consumer = "SELECT consumer, sum(redeliveries) FROM pipeline.inbox GROUP BY 1"
        redelivered = dict(conn.execute(text(by_consumer)).all())
    assert redelivered == {"payments": len(lost), "inventory": 0, "notifications": 0}


def seq_log(engine) -> dict[str, list[int]]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT ordering_key, n FROM seq_log ORDER BY id")).all()
    seen: dict[str, list[int]] = {}
    for key, n in rows:
        seen.setdefault(key, []).append(n)
    return seen


def steps(first: int, last: int, keys: int = 20) -> list[NewEvent]:
    return [
        NewEvent("seq.step", {"n": n}, ordering_key=f"key-{k}")
        for n in range(first, last)
        for k in range(keys)
    ]


def test_an_ordered_key_whose_events_redis_forgot_resumes_in_order(
    engine, chaos_settings, tmp_path
):
    """Steps 0-4 of each key processed; steps 5-9 sent, then Redis restarted empty; steps
    10-14 published after it. The later steps must not wait forever behind the lost ones:
    the sweep sends 5-9 again, and every key ends with 0..14 handled once, in order."""
    with EmbeddedRedis(tmp_path / "redis") as redis_server:
        settings = chaos_settings.replace(redis_url=redis_server.url)
        relay = start_relay(settings, APP, tmp_path / "relay.log")
        workers = start_worker(settings, APP, tmp_path / "worker.log", 1, 4)
        try:
            produce(engine, steps(0, 5), per_transaction=20)
            wait_until(lambda: scalar(engine, "SELECT count(*) FROM seq_log") == 100, timeout=60)
            # Idle (steps 5-9 are not produced yet) and Redis is emptied below: nothing a
            # graceful stop would finish or hand back, so no need to wait for one.
            stop_process(workers, signal.SIGKILL)
            produce(engine, steps(5, 10), per_transaction=20)
            wait_until(
                lambda: (
                    scalar(engine, "SELECT count(*) FROM pipeline.outbox WHERE status = 'sent'")
                    == 200
                ),
                timeout=60,
            )
            redis_server.kill()
            redis_server.start()
            workers = start_worker(settings, APP, tmp_path / "worker2.log", 1, 4)
            produce(engine, steps(10, 15), per_transaction=20)
            wait_until(
                lambda: scalar(engine, "SELECT count(*) FROM seq_log") == 300,
                timeout=60,
                interval=0.5,
                progress=lambda: scalar(engine, "SELECT count(*) FROM seq_log"),
                alive=[relay, workers],
            )
        finally:
            stop_process(workers)
            stop_process(relay)
    seen = seq_log(engine)
    assert len(seen) == 20
    for key, ns in seen.items():
        assert ns == list(range(15)), f"{key} handled out of order or twice: {ns}"
