"""Message ids fetched without a body are counted, not dead-lettered, by real workers.

A leftover id of a message already acknowledged (Dramatiq's maintenance requeued a slow
consumer's un-acked ids, or a replay pushed it again) is an absorbed duplicate: counted
and dropped. An id whose body Redis removed before any consumer ran it (eviction under
``allkeys-lru``) is a lost delivery: counted, dropped, and sent again by the relay's
delivery ledger. Neither is a dead letter; a foreign value still is
(tests/integration/test_queue_garbage.py).
"""

from __future__ import annotations

from collections import Counter

import redis

from pipeline import NewEvent, Settings
from pipeline.transport.redis.keys import messages_key, queue_key
from tests.integration.test_inbox import inbox_settings, publish_repeated, scalar, stage_counts
from tests.support import (
    log_size,
    multiprocess_metric,
    produce,
    start_relay,
    start_worker,
    stop_process,
    wait_until,
)

__all__ = ["inbox_settings"]  # the fixture, re-used from the inbox tests

APP = "tests.apps.inbox_app"
QUEUE = "pipeline.ledger"


def book(engine, orders: list[str]) -> None:
    produce(engine, [NewEvent("entry.booked", {"order_id": o}, aggregate_id=o) for o in orders])


def test_leftover_ids_of_processed_messages_are_counted_as_duplicates_and_dropped(
    engine, inbox_settings: Settings, tmp_path
):
    orders = [f"dup-{i}" for i in range(60)]
    book(engine, orders)
    publish_repeated(inbox_settings.replace(max_events_per_message=1), times=1)
    client = redis.Redis.from_url(inbox_settings.require_redis_url())
    ids = client.lrange(queue_key(inbox_settings.redis_namespace, QUEUE), 0, -1)
    assert len(ids) == len(orders)
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    log = tmp_path / "worker.log"
    worker = start_worker(inbox_settings, APP, log, 2, 2, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir))
    try:
        wait_until(
            lambda: len(stage_counts(engine, "ledger")) == len(orders),
            timeout=60,
            progress=lambda: log_size(log),
            alive=[worker],
        )
        # The storm: every id again (twice), after its message was processed and acked.
        client.rpush(queue_key(inbox_settings.redis_namespace, QUEUE), *ids, *ids)

        def dropped() -> float:
            return multiprocess_metric(
                metrics_dir, "pipeline_inbox_duplicates_dropped_total", queue=QUEUE
            )

        wait_until(lambda: dropped() >= 2 * len(orders), timeout=60, alive=[worker])
    finally:
        stop_process(worker)
        client.close()
    assert dropped() == 2 * len(orders)
    assert multiprocess_metric(metrics_dir, "pipeline_deliveries_lost_total", queue=QUEUE) == 0
    assert scalar(engine, "SELECT count(*) FROM pipeline.dead_letters") == 0
    assert stage_counts(engine, "ledger") == Counter({o: 1 for o in orders})
    assert multiprocess_metric(metrics_dir, "pipeline_dead_letters_total") == 0


def test_ids_whose_bodies_were_evicted_are_lost_deliveries_the_ledger_sends_again(
    engine, inbox_settings: Settings, tmp_path
):
    settings = inbox_settings.replace(
        canary_interval=0, redelivery_horizon_seconds=3.0, reconcile_interval_seconds=0.5
    )
    orders = [f"evicted-{i}" for i in range(40)]
    book(engine, orders)
    publish_repeated(settings.replace(max_events_per_message=1), times=1)
    client = redis.Redis.from_url(settings.require_redis_url())
    namespace = settings.redis_namespace
    ids = client.lrange(queue_key(namespace, QUEUE), 0, -1)
    assert len(ids) == len(orders)
    # What an allkeys-lru eviction of the bodies leaves: ids on the queue, no bodies.
    assert client.delete(messages_key(namespace, QUEUE)) == 1
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    worker_log, relay_log = tmp_path / "worker.log", tmp_path / "relay.log"
    worker = start_worker(
        settings, APP, worker_log, 1, 2, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir)
    )
    relay = None
    try:

        def lost() -> float:
            return multiprocess_metric(metrics_dir, "pipeline_deliveries_lost_total", queue=QUEUE)

        wait_until(lambda: lost() >= len(orders), timeout=60, alive=[worker])
        assert len(stage_counts(engine, "ledger")) == 0  # nothing ran: the bodies were gone
        relay = start_relay(settings, APP, relay_log, "--metrics-port", "0")
        wait_until(
            lambda: len(stage_counts(engine, "ledger")) == len(orders),
            timeout=60,
            progress=lambda: log_size(worker_log, relay_log),
            alive=[worker, relay],
        )
    finally:
        if relay is not None:
            stop_process(relay)
        stop_process(worker)
        client.close()
    assert lost() == len(orders)
    assert (
        multiprocess_metric(metrics_dir, "pipeline_inbox_duplicates_dropped_total", queue=QUEUE)
        == 0
    )
    assert scalar(engine, "SELECT count(*) FROM pipeline.dead_letters") == 0
    assert stage_counts(engine, "ledger") == Counter({o: 1 for o in orders})  # none lost
    assert scalar(
        engine, "SELECT sum(redeliveries) FROM pipeline.inbox WHERE consumer = 'ledger'"
    ) >= len(orders)


def test_bodies_evicted_by_a_real_allkeys_lru_redis_are_lost_deliveries_not_dead_letters(
    engine, inbox_settings: Settings, private_redis, tmp_path
):
    """A real eviction: a Redis of this test's own, ``allkeys-lru``, its ``maxmemory`` set
    just under what it holds. The queue's message bodies (one large hash, least recently
    used) go; the ids stay on the queue."""
    settings = inbox_settings.replace(
        redis_url=private_redis.url,
        canary_interval=0,
        redelivery_horizon_seconds=3.0,
        reconcile_interval_seconds=0.5,
    )
    orders = [f"lru-{i}" for i in range(40)]
    padding = "x" * 20_000  # 40 bodies of about 20 kB: the hash is the biggest key by far
    produce(
        engine,
        [
            NewEvent("entry.booked", {"order_id": o, "padding": padding}, aggregate_id=o)
            for o in orders
        ],
    )
    publish_repeated(settings.replace(max_events_per_message=1), times=1)
    client = redis.Redis.from_url(settings.require_redis_url())
    namespace = settings.redis_namespace
    queue, bodies = queue_key(namespace, QUEUE), messages_key(namespace, QUEUE)
    try:
        assert client.llen(queue) == len(orders) and client.hlen(bodies) == len(orders)
        wait_until(lambda: client.object("idletime", bodies) >= 2, timeout=30)
        for key in client.scan_iter(match=f"{namespace}:*"):
            if key != bodies.encode():
                client.dump(key)  # read: only the bodies stay least recently used
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory-policy", "allkeys-lru")
        client.config_set("maxmemory", str(used - 200_000))
        client.set(f"{namespace}:filler", "1")  # a write: Redis evicts before it runs
        evicted = int(client.info("stats")["evicted_keys"])
        assert evicted >= 1
        assert not client.exists(bodies), "Redis evicted another key than the bodies"
        assert client.llen(queue) == len(orders)
        client.config_set("maxmemory", "0")
    finally:
        client.close()
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    worker_log, relay_log = tmp_path / "worker.log", tmp_path / "relay.log"
    worker = start_worker(
        settings, APP, worker_log, 1, 2, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir)
    )
    relay = start_relay(settings, APP, relay_log, "--metrics-port", "0")
    try:
        wait_until(
            lambda: len(stage_counts(engine, "ledger")) == len(orders),
            timeout=60,
            progress=lambda: log_size(worker_log, relay_log),
            alive=[worker, relay],
        )
    finally:
        stop_process(relay)
        stop_process(worker)
    lost = multiprocess_metric(metrics_dir, "pipeline_deliveries_lost_total", queue=QUEUE)
    assert lost == len(orders)
    assert scalar(engine, "SELECT count(*) FROM pipeline.dead_letters") == 0
    assert stage_counts(engine, "ledger") == Counter({o: 1 for o in orders})
