"""A bare value pushed on a consumer queue is dead-lettered by a real worker, not swallowed.

Dramatiq's fetch moves whatever it pops to the worker's un-acked set and looks up a body
for it; a value that no Dramatiq client enqueued has none. The worker must keep it (a
consume-stage dead letter with the raw value), say so in one log line, and clear it from
the un-acked set, where it would otherwise sit until the worker dies and then come back.
"""

from __future__ import annotations

import redis

from pipeline import NewEvent, Settings
from pipeline.transport.redis.keys import acks_key, queue_key
from tests.integration.test_inbox import inbox_settings, publish_repeated, scalar
from tests.support import produce, start_worker, stop_process, wait_until

__all__ = ["inbox_settings"]  # the fixture, re-used from the inbox tests

APP = "tests.apps.inbox_app"


def acks_sets(client: redis.Redis, namespace: str, queue: str) -> dict[bytes, set[bytes]]:
    return {
        key: client.smembers(key)
        for key in client.scan_iter(match=acks_key(namespace, "*", queue), count=1000)
    }


def test_a_bare_value_on_a_queue_is_dead_lettered_with_its_raw_value(
    engine, inbox_settings: Settings, tmp_path
):
    client = redis.Redis.from_url(inbox_settings.require_redis_url())
    namespace, queue = inbox_settings.redis_namespace, "pipeline.ledger"
    client.lpush(queue_key(namespace, queue), "garbage")
    log = tmp_path / "worker.log"
    worker = start_worker(inbox_settings, APP, log, processes=1, threads=2)
    try:
        wait_until(
            lambda: scalar(engine, "SELECT count(*) FROM pipeline.dead_letters") == 1, timeout=30
        )
        # The worker still processes real events afterwards.
        produce(engine, [NewEvent("entry.booked", {"order_id": "after-garbage"})])
        publish_repeated(inbox_settings, times=1)
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM effects") == 1, timeout=30)
        wait_until(lambda: not any(acks_sets(client, namespace, queue).values()), timeout=10)
        assert worker.poll() is None
    finally:
        stop_process(worker)
        client.close()
    row = scalar(
        engine,
        "SELECT json_build_object('stage', stage, 'queue', queue, 'raw', raw_message,"
        " 'reason', reason) FROM pipeline.dead_letters",
    )
    assert row["stage"] == "consume" and row["queue"] == queue
    assert row["raw"] == "garbage"
    assert "not a Dramatiq message" in row["reason"]
    lines = [line for line in log.read_text().splitlines() if "not a Dramatiq message" in line]
    assert len(lines) == 1, log.read_text()[-3000:]
    assert "garbage" not in lines[0]  # the value is kept in Postgres, never logged
