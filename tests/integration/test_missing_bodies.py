"""Message ids fetched without a body are counted, not dead-lettered, by the workers.

A leftover id of a message already acknowledged (Dramatiq's maintenance requeued a slow
consumer's un-acked ids, or a replay pushed it again) is an absorbed duplicate: counted
and dropped. An id whose body Redis removed before any consumer ran it (eviction under
``allkeys-lru``) is a lost delivery: counted, dropped, and sent again by the relay's
delivery ledger. Neither is a dead letter; a foreign value still is
(tests/integration/test_queue_garbage.py).

Dramatiq's worker and the relay run in this process, but for the end-to-end check against
a Redis that really evicts: a worker process and a relay process, counting through
``PROMETHEUS_MULTIPROC_DIR`` as deployed.
"""

from __future__ import annotations

from collections import Counter

import redis

from pipeline import NewEvent, Settings
from pipeline.runtime import build_runtime
from pipeline.transport.redis.keys import messages_key, queue_key
from tests.integration.test_inbox import inbox_settings, publish_repeated, scalar, stage_counts
from tests.support import (
    Counted,
    app_registry,
    log_size,
    multiprocess_metric,
    produce,
    running_app_worker,
    running_relay,
    running_worker,
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
    engine, inbox_settings: Settings
):
    orders = [f"dup-{i}" for i in range(60)]
    book(engine, orders)
    publish_repeated(inbox_settings.replace(max_events_per_message=1), times=1)
    client = redis.Redis.from_url(inbox_settings.require_redis_url())
    ids = client.lrange(queue_key(inbox_settings.redis_namespace, QUEUE), 0, -1)
    assert len(ids) == len(orders)
    counted = Counted(
        dropped=("pipeline_inbox_duplicates_dropped_total", {"queue": QUEUE}),
        lost=("pipeline_deliveries_lost_total", {"queue": QUEUE}),
        dead=("pipeline_dead_letters_total", {}),
    )
    try:
        with running_app_worker(inbox_settings, APP, threads=4):
            wait_until(
                lambda: len(stage_counts(engine, "ledger")) == len(orders),
                timeout=60,
                progress=lambda: len(stage_counts(engine, "ledger")),
            )
            # The storm: every id again (twice), after its message was processed and acked.
            client.rpush(queue_key(inbox_settings.redis_namespace, QUEUE), *ids, *ids)
            wait_until(lambda: counted("dropped") >= 2 * len(orders), timeout=60)
    finally:
        client.close()
    assert counted("dropped") == 2 * len(orders)
    assert counted("lost") == 0
    assert scalar(engine, "SELECT count(*) FROM pipeline.dead_letters") == 0
    assert stage_counts(engine, "ledger") == Counter({o: 1 for o in orders})
    assert counted("dead") == 0


def test_ids_whose_bodies_were_evicted_are_lost_deliveries_the_ledger_sends_again(
    engine, inbox_settings: Settings
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
    counted = Counted(
        dropped=("pipeline_inbox_duplicates_dropped_total", {"queue": QUEUE}),
        lost=("pipeline_deliveries_lost_total", {"queue": QUEUE}),
    )
    runtime = build_runtime(settings, app_registry(APP), set_global_broker=False)
    try:
        with running_worker(runtime, threads=2):
            wait_until(lambda: counted("lost") >= len(orders), timeout=60)
            assert len(stage_counts(engine, "ledger")) == 0  # nothing ran: the bodies were gone
            with running_relay(runtime, runtime.registry):
                wait_until(
                    lambda: len(stage_counts(engine, "ledger")) == len(orders),
                    timeout=60,
                    progress=lambda: len(stage_counts(engine, "ledger")),
                )
    finally:
        runtime.close()
        client.close()
    assert counted("lost") == len(orders)
    assert counted("dropped") == 0
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
