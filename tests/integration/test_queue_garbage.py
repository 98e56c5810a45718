"""A bare value pushed on a consumer queue is dead-lettered by the worker, not swallowed.

Dramatiq's fetch moves whatever it pops to the worker's un-acked set and looks up a body
for it; a value that no Dramatiq client enqueued has none. The worker must keep it (a
consume-stage dead letter with the raw value), say so in one log line, and clear it from
the un-acked set, where it would otherwise sit until the worker dies and then come back.

Dramatiq's worker runs in this process, its log formatted as a worker process writes it;
one test runs a worker process, for the log a real process writes at DEBUG.
"""

from __future__ import annotations

import json
import uuid

import pytest
import redis
from dramatiq.message import Message

from pipeline import NewEvent, Settings
from pipeline.inbox.processor import record_unreadable
from pipeline.transport.factory import open_transport
from pipeline.transport.redis.keys import acks_key, messages_key, queue_key, wake_key
from tests.integration.test_inbox import inbox_settings, publish_repeated, scalar
from tests.support import (
    process_log,
    process_metric,
    produce,
    running_app_worker,
    start_worker,
    stop_process,
    wait_until,
)

__all__ = ["inbox_settings"]  # the fixture, re-used from the inbox tests

APP = "tests.apps.inbox_app"


def acks_sets(client: redis.Redis, namespace: str, queue: str) -> dict[bytes, set[bytes]]:
    return {
        key: client.smembers(key)
        for key in client.scan_iter(match=acks_key(namespace, "*", queue), count=1000)
    }


def test_a_bare_value_on_a_queue_is_dead_lettered_with_its_raw_value(
    engine, inbox_settings: Settings
):
    client = redis.Redis.from_url(inbox_settings.require_redis_url())
    namespace, queue = inbox_settings.redis_namespace, "pipeline.ledger"
    client.lpush(queue_key(namespace, queue), "garbage")
    try:
        with process_log() as log, running_app_worker(inbox_settings, APP, threads=2) as worker:
            wait_until(
                lambda: scalar(engine, "SELECT count(*) FROM pipeline.dead_letters") == 1,
                timeout=30,
            )
            # The worker still processes real events afterwards.
            produce(engine, [NewEvent("entry.booked", {"order_id": "after-garbage"})])
            publish_repeated(inbox_settings, times=1)
            wait_until(lambda: scalar(engine, "SELECT count(*) FROM effects") == 1, timeout=30)
            wait_until(lambda: not any(acks_sets(client, namespace, queue).values()), timeout=10)
            assert all(
                thread.is_alive() for thread in [*worker.consumers.values(), *worker.workers]
            )
    finally:
        client.close()
    row = scalar(
        engine,
        "SELECT json_build_object('stage', stage, 'queue', queue, 'raw', raw_message,"
        " 'reason', reason) FROM pipeline.dead_letters",
    )
    assert row["stage"] == "consume" and row["queue"] == queue
    assert row["raw"] == "garbage"
    assert "not a Dramatiq message" in row["reason"]
    lines = [line for line in log.getvalue().splitlines() if "not a Dramatiq message" in line]
    assert len(lines) == 1, log.getvalue()[-3000:]
    assert "garbage" not in lines[0]  # the value is kept in Postgres, never logged


def hand_written(
    client: redis.Redis, namespace: str, queue: str, body: dict | bytes, *, with_id: bool = False
) -> None:
    """A message written straight into Dramatiq's keys, as anyone with Redis access can
    (``with_id``: with the ``redis_message_id`` option Dramatiq acknowledges it by)."""
    message_id = str(uuid.uuid4())
    if with_id and isinstance(body, dict):
        body = {**body, "options": {"redis_message_id": message_id}}
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    client.hset(messages_key(namespace, queue), message_id, raw)
    client.rpush(queue_key(namespace, queue), message_id)
    client.lpush(wake_key(namespace, queue), "1")


def dead_letters(engine) -> list[dict]:
    return (
        scalar(
            engine,
            "SELECT json_agg(json_build_object('reason', reason, 'raw', raw_message,"
            " 'envelope', envelope, 'class', error_class) ORDER BY id) FROM pipeline.dead_letters",
        )
        or []
    )


def test_unacknowledgeable_and_nul_messages_are_dead_lettered_once_and_removed(
    engine, inbox_settings: Settings
):
    """No ``redis_message_id`` (Dramatiq could not acknowledge it), arguments of the wrong
    shape, NUL bytes in a bare value and in an unparseable body: each recorded once,
    removed, and not back after a restart."""
    client = redis.Redis.from_url(inbox_settings.require_redis_url())
    namespace, queue = inbox_settings.redis_namespace, "pipeline.ledger"
    envelope = {"specversion": "1.0", "id": str(uuid.uuid4()), "type": "entry.booked"}
    hand_written(
        client,
        namespace,
        queue,
        {
            "queue_name": queue,
            "actor_name": "pipeline_inbox_ledger",
            "args": [[{**envelope, "source": "/x", "data": {"order_id": "no-redis-id"}}]],
            "kwargs": {},
            "options": {},
            "message_id": str(uuid.uuid4()),
            "message_timestamp": 0,
        },
    )
    shapes = {"queue_name": queue, "actor_name": "pipeline_inbox_ledger", "message_id": "m"}
    hand_written(client, namespace, queue, {**shapes, "args": [], "kwargs": []}, with_id=True)
    hand_written(client, namespace, queue, {**shapes, "args": [], "kwargs": {}, "options": "o"})
    hand_written(client, namespace, queue, b"not json \x00 with a NUL")
    client.lpush(queue_key(namespace, queue), b"bare\x00value")
    try:
        for _run in range(2):  # the second worker finds nothing left to dead-letter
            with process_log() as log, running_app_worker(inbox_settings, APP, threads=2):
                wait_until(lambda: len(dead_letters(engine)) >= 5, timeout=30)
                wait_until(lambda: not any(acks_sets(client, namespace, queue).values()))
                assert client.hlen(messages_key(namespace, queue)) == 0
                assert client.llen(queue_key(namespace, queue)) == 0
            assert "Traceback" not in log.getvalue(), log.getvalue()[-3000:]
            assert "no-redis-id" not in log.getvalue()
    finally:
        client.close()
    letters = dead_letters(engine)
    assert len(letters) == 5, letters
    unacknowledgeable = [r["reason"] for r in letters if "'redis_message_id'" in r["reason"]]
    assert len(unacknowledgeable) == 2  # no such option, or no options object at all
    assert "not enqueued by a Dramatiq client" in unacknowledgeable[0]
    assert sum("kwargs not an object" in letter["reason"] for letter in letters) == 1
    raws = sorted(letter["raw"] for letter in letters)
    assert "bare\\x00value" in raws
    assert "not json \\x00 with a NUL" in raws
    assert any("no-redis-id" in raw for raw in raws)
    assert scalar(engine, "SELECT count(*) FROM effects") == 0  # no handler ran


UNFIT_ARGUMENTS = {  # what the inbox actor is called with: (its args, its kwargs)
    "no-arguments": ([], {}),
    "two-arguments": ([[], []], {}),
    "unknown-keyword": ([[]], {"surprise": 1}),
    "bad-deferrals": ([[]], {"deferrals": "x"}),
}


def test_arguments_a_consumer_cannot_take_are_dead_lettered_at_once(
    engine, inbox_settings: Settings
):
    """Each kind of unfit arguments (one message each, through one worker) is one dead
    letter at once, never retried; the worker goes on working."""
    transport = open_transport(inbox_settings, middleware=[])
    try:
        for args, kwargs in UNFIT_ARGUMENTS.values():
            transport.broker.enqueue(
                Message(
                    queue_name="pipeline.ledger",
                    actor_name="pipeline_inbox_ledger",
                    args=tuple(args),
                    kwargs=kwargs,
                    options={},
                )
            )
    finally:
        transport.close()
    retries = "pipeline_inbox_infrastructure_retries_total"
    retried_before = process_metric(retries)
    with process_log() as log, running_app_worker(inbox_settings, APP, threads=2):
        wanted = len(UNFIT_ARGUMENTS)
        wait_until(lambda: len(dead_letters(engine)) >= wanted, timeout=30)
        produce(engine, [NewEvent("entry.booked", {"order_id": "after"})])
        publish_repeated(inbox_settings, times=1)  # the worker still works afterwards
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM effects") == 1)
    letters = dead_letters(engine)
    envelopes = [letter["envelope"] for letter in letters]
    expected = [{"args": args, "kwargs": kwargs} for args, kwargs in UNFIT_ARGUMENTS.values()]
    assert sorted(map(repr, envelopes)) == sorted(map(repr, expected))  # one letter each
    for letter in letters:
        assert "message arguments do not fit consumer 'ledger'" in letter["reason"]
        assert "non-retryable" in letter["reason"]
    assert process_metric(retries) == retried_before
    assert "Traceback" not in log.getvalue(), log.getvalue()[-3000:]


def test_no_payload_reaches_the_logs_at_debug(engine, inbox_settings: Settings, tmp_path):
    """Dramatiq's own DEBUG lines ("Received args=...") included, through a real worker
    process: the logging a ``pipeline worker`` configures for itself is what is checked."""
    marker = "payload-marker-5c1d"
    produce(engine, [NewEvent("entry.booked", {"order_id": marker})])
    publish_repeated(inbox_settings, times=1)
    log = tmp_path / "worker.log"
    worker = start_worker(inbox_settings, APP, log, PIPELINE_LOG_LEVEL="DEBUG")
    try:
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM effects") == 1, alive=[worker])
    finally:
        stop_process(worker)
    text = log.read_text()
    assert "Received args=" in text  # Dramatiq's DEBUG line is there, without its arguments
    assert marker not in text


def requeue_as_maintenance_does(client: redis.Redis, namespace: str, queue: str) -> None:
    """What Dramatiq's maintenance does with a dead worker's un-acked set: ids that still
    have a body go back on the queue, and the set goes."""
    for key in acks_sets(client, namespace, queue):
        for member in client.smembers(key):
            if client.hexists(messages_key(namespace, queue), member):
                client.rpush(queue_key(namespace, queue), member)
        client.delete(key)
    client.lpush(wake_key(namespace, queue), "1")


@pytest.mark.parametrize("names", ["another-redis-id", "another-queue"])
def test_a_message_naming_another_id_or_queue_is_dead_lettered_once(
    engine, inbox_settings: Settings, names
):
    """A hand-written message whose ``redis_message_id`` option names another id than the
    one it is stored under, or whose ``queue_name`` names another queue the worker consumes
    (Dramatiq's worker settles a message through that queue's consumer): it is settled on
    its own queue under the id it was fetched by, so after the worker stops nothing of it
    is left to come back and be dead-lettered again."""
    client = redis.Redis.from_url(inbox_settings.require_redis_url())
    namespace, queue = inbox_settings.redis_namespace, "pipeline.ledger"
    stored_under = str(uuid.uuid4())
    named = str(uuid.uuid4()) if names == "another-redis-id" else stored_under
    body = {
        "queue_name": "pipeline.payments" if names == "another-queue" else queue,
        "actor_name": "pipeline_inbox_ledger",
        "args": [],  # arguments no consumer takes: dead-lettered at once
        "kwargs": {},
        "options": {"redis_message_id": named},
        "message_id": str(uuid.uuid4()),
        "message_timestamp": 0,
    }
    client.hset(messages_key(namespace, queue), stored_under, json.dumps(body))
    client.rpush(queue_key(namespace, queue), stored_under)
    client.lpush(wake_key(namespace, queue), "1")
    try:
        for run in range(2):  # the second worker gets whatever the first left behind
            with process_log() as log, running_app_worker(inbox_settings, APP, threads=2):
                wait_until(lambda: len(dead_letters(engine)) >= 1, timeout=30)
                produce(engine, [NewEvent("entry.booked", {"order_id": f"after-{run}"})])
                publish_repeated(inbox_settings, times=1)  # behind anything requeued
                wait_until(
                    lambda run=run: scalar(engine, "SELECT count(*) FROM effects") == run + 1
                )
                wait_until(lambda: client.llen(queue_key(namespace, queue)) == 0)
            assert "Traceback" not in log.getvalue(), log.getvalue()[-3000:]
            requeue_as_maintenance_does(client, namespace, queue)
        letters = dead_letters(engine)
        assert len(letters) == 1, letters
        assert "not enqueued by a Dramatiq client" in letters[0]["reason"]
        assert client.hlen(messages_key(namespace, queue)) == 0
        assert client.llen(queue_key(namespace, queue)) == 0
        assert not any(acks_sets(client, namespace, queue).values())
    finally:
        client.close()


def test_a_raw_message_recorded_before_a_crash_is_not_recorded_again(
    engine, inbox_settings: Settings
):
    """A worker that dies between recording a raw message and removing it from Redis
    leaves both: the row, and the message (which comes back). The next worker removes
    the message without recording it a second time."""
    client = redis.Redis.from_url(inbox_settings.require_redis_url())
    namespace, queue = inbox_settings.redis_namespace, "pipeline.ledger"
    raw = b"not json, recorded before a crash"
    hand_written(client, namespace, queue, raw)
    # What the dead worker did before it could acknowledge the message:
    record_unreadable(inbox_settings, engine, queue, "undecodable message: before", raw=raw)
    try:
        with process_log() as log, running_app_worker(inbox_settings, APP, threads=2):
            produce(engine, [NewEvent("entry.booked", {"order_id": "after"})])
            publish_repeated(inbox_settings, times=1)  # queued behind the raw message
            wait_until(lambda: scalar(engine, "SELECT count(*) FROM effects") == 1)
            wait_until(lambda: client.hlen(messages_key(namespace, queue)) == 0)
    finally:
        client.close()
    letters = dead_letters(engine)
    assert [letter["reason"] for letter in letters] == ["undecodable message: before"]
    assert "dead-lettered already" in log.getvalue(), log.getvalue()[-3000:]


def test_raw_messages_are_recorded_once_per_queue_and_bytes(engine, inbox_settings: Settings):
    """The same bytes on the same queue are one dead letter however often they are
    recorded; other bytes, another queue, or a dead letter without raw bytes are not
    folded into it."""
    for _ in range(2):
        record_unreadable(inbox_settings, engine, "pipeline.ledger", "r", raw=b"same\x00bytes")
        record_unreadable(inbox_settings, engine, "pipeline.other", "r", raw=b"same\x00bytes")
        record_unreadable(inbox_settings, engine, "pipeline.ledger", "r", raw=b"other")
        record_unreadable(inbox_settings, engine, "pipeline.ledger", "r", envelope={"a": 1})
    counts = scalar(
        engine,
        "SELECT json_object_agg(k, n) FROM (SELECT coalesce(queue || ':' || raw_message,"
        " 'envelope') AS k, count(*) AS n FROM pipeline.dead_letters GROUP BY 1) c",
    )
    assert counts == {
        "pipeline.ledger:same\\x00bytes": 1,
        "pipeline.other:same\\x00bytes": 1,
        "pipeline.ledger:other": 1,
        "envelope": 2,
    }
    digests = scalar(engine, "SELECT count(DISTINCT raw_digest) FROM pipeline.dead_letters")
    assert digests == 3
