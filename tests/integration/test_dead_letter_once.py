"""A well-formed message the consumer dead-letters itself is recorded once, however often
it is delivered.

Its dead letters (an unauthentic or undecodable envelope in it, arguments its consumer
cannot take) are recorded in their own transaction before the message is acknowledged.
A worker that dies in between leaves both the row and the message, which comes back;
Dramatiq sends a message again under the same id after an outage, too. Real workers,
real Redis and Postgres: the second delivery finds the dead letter recorded already.
"""

from __future__ import annotations

import json
import signal
import uuid
from typing import Any

import psycopg
import pytest
import redis
from dramatiq.message import Message
from sqlalchemy import text

from pipeline import NewEvent, Settings
from pipeline.db.connect import make_engine
from pipeline.envelope import encode_envelope
from pipeline.inbox.processor import WHOLE_MESSAGE, DeliveredMessage, record_unreadable
from pipeline.registry import Registry
from pipeline.relay.drain import Drainer
from pipeline.runtime import build_runtime
from pipeline.signing import event_source
from pipeline.transport.factory import open_transport
from pipeline.transport.redis import broker as broker_module
from pipeline.transport.redis.keys import acks_key, heartbeats_key, messages_key, queue_key
from tests.integration.test_authenticity import KEY, OTHER_KEY, made_up_event, signed_envelope
from tests.integration.test_follow_ups import waiting_on_advisory_lock
from tests.integration.test_inbox import RepeatingPublisher, inbox_settings, scalar
from tests.integration.test_queue_garbage import dead_letters, requeue_as_maintenance_does
from tests.integration.test_roles import Deployment, deployment
from tests.support import (
    process_log,
    produce,
    running_app_worker,
    start_worker,
    stop_process,
    wait_until,
)

__all__ = ["deployment", "inbox_settings"]  # fixtures re-used here

APP = "tests.apps.inbox_app"
QUEUE, ACTOR = "pipeline.ledger", "pipeline_inbox_ledger"
HOLD = 42  # the advisory lock the ledger handler takes for an event with "slow" in its data


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def enqueue(settings: Settings, message: Message[Any], times: int = 1) -> None:
    """Put ``message`` on its queue ``times`` times (each under a Redis id of its own, the
    same Dramatiq message id: what Dramatiq's own retry of a message looks like)."""
    transport = open_transport(settings, middleware=[])
    try:
        for _ in range(times):
            transport.broker.enqueue(message)
    finally:
        transport.close()


def inbox_message(
    args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, actor: str = ACTOR
) -> Message[Any]:
    return Message(queue_name=QUEUE, actor_name=actor, args=args, kwargs=kwargs or {}, options={})


@pytest.mark.parametrize("bad", ["unauthentic", "undecodable"])
def test_a_worker_killed_after_recording_a_dead_letter_leaves_one_row(
    engine, inbox_settings: Settings, tmp_path, bad
):
    """A message of a bad envelope and a good event: the worker records the bad one, then
    the good event's handler waits (on a lock the test holds) and the worker process is
    killed before it could acknowledge the message. The message comes back to the next
    worker (this process's: the kill is the first one's), which runs the handler once and
    does not record the bad envelope a second time."""
    settings = inbox_settings.replace(message_key=KEY) if bad == "unauthentic" else inbox_settings
    source = event_source(settings)
    good_event = made_up_event("good", {"slow": 0.01})
    if bad == "unauthentic":
        rejected = signed_envelope(made_up_event("forged", {}), OTHER_KEY, source)
        good = signed_envelope(good_event, KEY, source)
    else:
        rejected = {**json.loads(encode_envelope(made_up_event("bad", {}), source)), "id": "x"}
        good = json.loads(encode_envelope(good_event, source))
    enqueue(settings, inbox_message(([rejected, good],)))
    client = redis.Redis.from_url(settings.require_redis_url())
    namespace = settings.redis_namespace
    hold = engine.connect()
    try:
        hold.execute(text("SELECT pg_advisory_lock(:k)"), {"k": HOLD})
        log = tmp_path / "worker-killed.log"
        worker = start_worker(settings, APP, log, processes=1, threads=1)
        try:
            wait_until(lambda: len(dead_letters(engine)) == 1, timeout=30, alive=[worker])
            wait_until(lambda: waiting_on_advisory_lock(engine) == 1, timeout=30, alive=[worker])
        finally:
            stop_process(worker, signal.SIGKILL)
        hold.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": HOLD})
        assert client.hlen(messages_key(namespace, QUEUE)) == 1  # never acknowledged
        requeue_as_maintenance_does(client, namespace, QUEUE)
        with process_log() as log, running_app_worker(settings, APP, threads=1):
            wait_until(lambda: scalar(engine, "SELECT count(*) FROM effects") == 1)
            wait_until(lambda: client.hlen(messages_key(namespace, QUEUE)) == 0)
            assert client.llen(queue_key(namespace, QUEUE)) == 0
    finally:
        hold.close()
        client.close()
    letters = dead_letters(engine)
    assert len(letters) == 1, letters
    assert letters[0]["class"] == (
        "UnauthenticMessage" if bad == "unauthentic" else "UnprocessableMessage"
    )
    assert scalar(engine, "SELECT count(*) FROM effects") == 1
    assert "dead-lettered already" in log.getvalue(), log.getvalue()[-3000:]


@pytest.mark.parametrize(
    ("args", "kwargs", "actor"),
    [
        ([], {}, ACTOR),
        ([[]], {}, ACTOR),
        ([["not an envelope"]], {}, ACTOR),
        ([[]], {"surprise": 1}, ACTOR),
        ([[]], {}, "pipeline_inbox_ghost"),
    ],
    ids=[
        "arguments-do-not-fit",
        "no-envelopes",
        "envelope-not-an-object",
        "unknown-keyword",
        "unknown-actor",
    ],
)
def test_a_message_delivered_again_under_its_id_is_dead_lettered_once(
    engine, inbox_settings: Settings, args, kwargs, actor
):
    """The same Dramatiq message delivered twice (as after a worker died before it
    acknowledged it, or as Dramatiq retries it): one dead letter. A message with the same
    content under another id is another message, and is recorded too."""
    message = inbox_message(tuple(args), kwargs, actor)
    enqueue(inbox_settings, message, times=2)
    enqueue(inbox_settings, inbox_message(tuple(args), kwargs, actor))  # another message id
    client = redis.Redis.from_url(inbox_settings.require_redis_url())
    namespace = inbox_settings.redis_namespace
    try:
        with process_log() as log, running_app_worker(inbox_settings, APP, threads=2):
            wait_until(lambda: client.hlen(messages_key(namespace, QUEUE)) == 0)
            wait_until(lambda: client.llen(queue_key(namespace, QUEUE)) == 0)
    finally:
        client.close()
    letters = dead_letters(engine)
    assert len(letters) == 2, letters
    assert letters[0]["reason"] == letters[1]["reason"]
    assert "dead-lettered already" in log.getvalue(), log.getvalue()[-3000:]
    if actor == ACTOR:  # (Dramatiq itself logs a traceback for an unknown actor)
        assert "Traceback" not in log.getvalue(), log.getvalue()[-3000:]


def test_an_event_whose_handler_failed_every_retry_is_dead_lettered_once(
    engine, inbox_settings: Settings, monkeypatch
):
    """The ordinary dead letter (a handler that failed every retry) is recorded in the
    transaction that marks the event dead in its inbox row (one per consumer and event,
    ``inbox_pkey``): the event delivered again afterwards is a duplicate, not a second
    dead letter. Two copies of the event, both retried to the end by a real worker."""
    produce(engine, [NewEvent("order.placed", {"order_id": "doomed"})])
    routes = Registry()
    routes.subscribe("payments", ["order.placed"])
    runtime = build_runtime(inbox_settings, routes, set_global_broker=False)
    try:
        conn = psycopg.connect(inbox_settings.require_database_url(), autocommit=True)
        publisher = RepeatingPublisher(runtime.publisher, 2)
        drainer = Drainer(inbox_settings, publisher, routes, "t", conn)
        while drainer.run_batch().claimed:
            pass
        conn.close()
    finally:
        runtime.close()
    client = redis.Redis.from_url(inbox_settings.require_redis_url())
    namespace, queue = inbox_settings.redis_namespace, "pipeline.payments"
    monkeypatch.setattr(f"{APP}.FAIL_RATE", 1.0)
    try:
        with running_app_worker(inbox_settings, APP, threads=2):
            wait_until(lambda: len(dead_letters(engine)) >= 1, timeout=60)
            wait_until(lambda: client.hlen(messages_key(namespace, queue)) == 0)
    finally:
        client.close()
    letters = dead_letters(engine)
    assert len(letters) == 1, letters
    assert letters[0]["reason"].startswith("gave up after"), letters  # two copies: 21 or more
    status = scalar(engine, "SELECT status FROM pipeline.inbox WHERE consumer = 'payments'")
    assert status == "dead"


def test_the_worker_role_records_a_message_dead_letter_once(deployment: Deployment):
    """The consuming role has INSERT only on ``dead_letters``: skipping a digest recorded
    already needs no more."""
    settings = deployment.settings("worker")
    worker_engine = make_engine(settings)
    delivered = DeliveredMessage(QUEUE, str(uuid.uuid4()), ACTOR, [], {})
    try:
        for _ in range(2):
            record_unreadable(
                settings,
                worker_engine,
                QUEUE,
                "arguments",
                consumer="ledger",
                envelope={"args": []},
                message_digest=delivered.digest(WHOLE_MESSAGE),
            )
    finally:
        worker_engine.dispose()
    assert deployment.admin("SELECT count(*) FROM pipeline.dead_letters") == [(1,)]


def test_an_unacked_id_a_live_worker_no_longer_holds_is_put_back(
    engine, inbox_settings: Settings, monkeypatch
):
    """A message id in a live worker's un-acked set that no thread of it holds (left there
    by a settlement that failed for good, or by a pause past the heartbeat timeout while
    another worker's maintenance emptied the set): Dramatiq would leave it there for the
    life of the process and the delivery ledger would count it in flight. The worker puts
    it back on the queue at its next periodic look (every half second here, not every
    ``ORPHAN_LOOK_SECONDS``), and the event is handled."""
    monkeypatch.setattr(broker_module, "ORPHAN_LOOK_SECONDS", 0.5)
    settings = inbox_settings
    client = redis.Redis.from_url(settings.require_redis_url())
    namespace = settings.redis_namespace
    try:
        with process_log() as log, running_app_worker(settings, APP, threads=2):
            wait_until(lambda: client.zcard(heartbeats_key(namespace)) == 1)
            [broker_id] = [
                _text(member) for member in client.zrange(heartbeats_key(namespace), 0, 0)
            ]
            redis_id = str(uuid.uuid4())
            event = made_up_event("orphan", {})
            envelope = json.loads(encode_envelope(event, event_source(settings)))
            message = inbox_message(([envelope],)).copy(options={"redis_message_id": redis_id})
            client.hset(messages_key(namespace, QUEUE), redis_id, message.encode())
            client.sadd(acks_key(namespace, broker_id, QUEUE), redis_id)  # held by nobody
            wait_until(lambda: scalar(engine, "SELECT count(*) FROM effects") == 1)
            wait_until(lambda: client.scard(acks_key(namespace, broker_id, QUEUE)) == 0)
    finally:
        client.close()
    assert "requeued un-acked messages this consumer no longer held" in log.getvalue()
