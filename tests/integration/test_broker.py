"""The worker's Redis consumer: wake-up list instead of blind polling (real Redis)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.common import dq_name
from dramatiq.message import Message

from pipeline.transport.redis import broker as broker_module
from pipeline.transport.redis.broker import PipelineRedisBroker, make_broker
from pipeline.transport.redis.encoding import REDIS_MESSAGE_ID
from pipeline.transport.redis.keys import (
    acks_key,
    heartbeats_key,
    messages_key,
    queue_key,
    wake_key,
)
from tests.support import wait_until

QUEUE = "wake_test"


@pytest.fixture
def broker(settings: Any) -> Iterator[PipelineRedisBroker]:
    broker = make_broker(settings)
    broker.declare_queue(QUEUE)
    yield broker
    broker.close()


def count_calls(broker: PipelineRedisBroker) -> list[str]:
    """Record the consumer's Redis calls: plain fetches, waits (each with a fetch), wake-ups."""
    calls: list[str] = []
    fetch, wait_and_fetch, wake = broker.fetch, broker.wait_and_fetch, broker.wake

    def counted_fetch(*args: Any, **kwargs: Any) -> Any:
        calls.append("fetch")
        return fetch(*args, **kwargs)

    def counted_wait(*args: Any, **kwargs: Any) -> Any:
        messages = wait_and_fetch(*args, **kwargs)
        calls.append(f"wait + fetch of {len(messages)}")
        return messages

    def counted_wake(queue_name: str) -> None:
        calls.append("wake")
        wake(queue_name)

    broker.fetch, broker.wait_and_fetch, broker.wake = counted_fetch, counted_wait, counted_wake  # type: ignore[method-assign]
    return calls


def encoded(argument: int, redis_id: str) -> bytes:
    """A message as Dramatiq's enqueue writes it: with the id it is acknowledged by."""
    body: bytes = Message(QUEUE, "noop", (argument,), {}, {REDIS_MESSAGE_ID: redis_id}).encode()
    return body


def next_message(consumer: Any, timeout: float = 10) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = next(consumer)
        if message is not None:
            return message
    raise AssertionError("no message arrived")


def test_a_short_fetch_waits_on_the_wake_up_list_and_an_enqueue_wakes_it(broker):
    # Dramatiq's own enqueue pushes the wake-up (the relay's publisher does the same).
    calls = count_calls(broker)
    consumer = broker.consume(QUEUE, prefetch=4, timeout=1000)
    try:
        broker.enqueue(Message(QUEUE, "noop", (1,), {}, {}))
        first = next(consumer)
        assert first is not None and first.args == (1,)
        assert calls == ["wake", "fetch"]  # one message of the four asked for: queue empty
        calls.clear()

        later = threading.Timer(0.3, broker.enqueue, args=(Message(QUEUE, "noop", (2,), {}, {}),))
        later.start()
        second = next_message(consumer)
        later.join()
        assert second.args == (2,)
        # The first wait may find the first message's wake-up still there (the fetch took
        # the message before it was popped): one empty fetch. Then it waits on the list, and
        # the next enqueue's wake-up ends the wait, whose fetch (same round trip) brings it.
        assert calls[-2:] == ["wake", "wait + fetch of 1"], calls
        assert "fetch" not in calls, calls  # no plain fetch: every one followed a wait
        assert len(calls) <= 3, calls
    finally:
        consumer.close()


def test_a_wait_and_its_fetch_are_one_round_trip(broker):
    """Redis runs the fetch when the wait ends: a wake-up costs no second round trip."""
    assert broker.fetch(QUEUE, 1) == []  # the first fetch loads the fetch script
    sent: list[list[str]] = []
    pipeline = broker.client.pipeline

    def recording_pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = pipeline(*args, **kwargs)
        execute = pipe.execute

        def recording_execute(*a: Any, **k: Any) -> Any:
            sent.append([str(command[0][0]) for command in pipe.command_stack])
            return execute(*a, **k)

        pipe.execute = recording_execute
        return pipe

    broker.client.pipeline = recording_pipeline  # type: ignore[method-assign]
    broker.do_enqueue(QUEUE, "raw-id", Message(QUEUE, "noop", (7,), {}, {}).encode())
    broker.client.lpush(wake_key(broker.namespace, QUEUE), "1")

    broker._last_fetch_heartbeat = float("-inf")  # the heartbeat is due: it rides along
    messages = broker.wait_and_fetch(QUEUE, 4, 1000)

    assert [(i, Message.decode(m).args) for i, m in messages] == [("raw-id", (7,))]
    assert sent == [["BLPOP", "EVALSHA", "EVALSHA"]]  # the heartbeat's dispatch, the fetch
    assert broker.client.zscore(heartbeats_key(broker.namespace), broker.broker_id) is not None
    assert broker.client.llen(wake_key(broker.namespace, QUEUE)) == 0  # the wake-up was used


def test_a_wait_whose_fetch_script_redis_lost_fetches_again(broker):
    """After a Redis restart or SCRIPT FLUSH the pipelined fetch fails: nothing is lost."""
    broker.do_enqueue(QUEUE, "raw-id", Message(QUEUE, "noop", (5,), {}, {}).encode())
    broker.client.script_flush()

    messages = broker.wait_and_fetch(QUEUE, 4, 100)

    assert [(i, Message.decode(m).args) for i, m in messages] == [("raw-id", (5,))]
    assert broker.client.script_exists(broker.scripts["dispatch"].sha) == [True]
    assert broker.client.script_exists(broker.fetch_with_ids.sha) == [True]


def test_a_wait_that_times_out_still_fetches_what_came_without_a_wake_up(broker):
    """Dramatiq's maintenance requeues a dead worker's messages without a wake-up."""
    calls = count_calls(broker)
    consumer = broker.consume(QUEUE, prefetch=4, timeout=100)
    try:
        assert next(consumer) is None  # the first call fetches; the queue is empty
        assert next(consumer) is None  # a wait that times out, and an empty fetch
        broker.do_enqueue(QUEUE, "raw-id", encoded(3, "raw-id"))
        message = next_message(consumer)
        assert message.args == (3,)
        assert calls[0] == "fetch"
        assert calls[1] == "wait + fetch of 0"
        assert calls[-1] == "wait + fetch of 1", calls
        assert calls.count("fetch") == 1, calls
    finally:
        consumer.close()


def test_a_full_fetch_passes_a_wake_up_on_to_the_next_consumer(broker):
    for n in range(6):
        broker.do_enqueue(QUEUE, f"id-{n}", encoded(n, f"id-{n}"))
    calls = count_calls(broker)
    consumer = broker.consume(QUEUE, prefetch=4, timeout=1000)
    try:
        next_message(consumer)
        assert calls == ["fetch", "wake"]  # four of four: a backlog may remain
        assert broker.client.lrange(wake_key(broker.namespace, QUEUE), 0, -1) == [b"1"]
    finally:
        consumer.close()


def test_a_fetch_cut_at_dramatiqs_unpack_limit_passes_a_wake_up_on(broker, monkeypatch):
    """Dramatiq's script returns at most its unpack limit: that is not an empty queue."""
    for n in range(5):
        broker.do_enqueue(QUEUE, f"id-{n}", encoded(n, f"id-{n}"))
    monkeypatch.setattr(broker, "_max_unpack_size", lambda: 3)
    calls = count_calls(broker)
    consumer = broker.consume(QUEUE, prefetch=10, timeout=1000)
    try:
        next_message(consumer)
        assert calls == ["fetch", "wake"]  # 3 of 10 asked for, but cut at the limit of 3
        for _ in range(2):
            next_message(consumer)
        assert next_message(consumer).args in {(3,), (4,)}
        assert calls[:3] == ["fetch", "wake", "fetch"], calls  # fetched again without waiting
    finally:
        consumer.close()


def test_an_idle_consumers_waits_requeue_a_dead_workers_messages(broker, settings):
    """Maintenance rides on fetches at random; an idle consumer's waits each carry one."""
    dead = make_broker(settings)
    dead.declare_queue(QUEUE)
    dead.enqueue(Message(QUEUE, "noop", (9,), {}, {}))
    dead_consumer = dead.consume(QUEUE, prefetch=1, timeout=100)
    assert next_message(dead_consumer).args == (9,)  # fetched, never acked: then it dies
    dead.client.zadd(f"{dead.namespace}:__heartbeats__", {dead.broker_id: 0})
    broker.client.delete(wake_key(broker.namespace, QUEUE))  # the requeue pushes none

    calls = count_calls(broker)
    broker.maintenance_chance = 0
    consumer = broker.consume(QUEUE, prefetch=4, timeout=100)
    try:
        assert next(consumer) is None  # the queue is empty: the next call waits
        broker.maintenance_chance = 1_000_000  # every fetch from now on does maintenance
        message = next_message(consumer)
        assert message.args == (9,)
        assert calls[0] == "fetch"
        assert calls[-1] == "wait + fetch of 1", calls
    finally:
        consumer.close()
        dead.close()


def test_a_wake_up_that_cannot_be_pushed_does_not_fail_the_enqueue(broker, caplog):
    def broken_pipeline(*args: Any, **kwargs: Any) -> Any:
        raise redis.ConnectionError("Redis went away")

    original = broker.client.pipeline
    broker.client.pipeline = broken_pipeline
    try:
        message = broker.enqueue(Message(QUEUE, "noop", (1,), {}, {}))
    finally:
        broker.client.pipeline = original
    assert message.args == (1,)
    assert broker.client.llen(queue_key(broker.namespace, QUEUE)) == 1  # queued all the same
    assert "could not push a wake-up" in caplog.text


def test_messages_a_stopping_consumer_puts_back_wake_the_others(broker):
    for n in range(3):
        broker.enqueue(Message(QUEUE, "noop", (n,), {}, {}))
    stopping = broker.consume(QUEUE, prefetch=4, timeout=100)
    first = next_message(stopping)
    broker.client.delete(wake_key(broker.namespace, QUEUE))
    stopping.requeue([first])
    assert broker.client.lrange(wake_key(broker.namespace, QUEUE), 0, -1) == [b"1"]
    stopping.close()


def test_a_fetched_message_is_in_the_acks_set_the_broker_computes_until_acked(broker):
    message = broker.enqueue(Message(QUEUE, "actor", (), {}, {}))
    redis_id = message.options[REDIS_MESSAGE_ID]
    consumer = broker.consume(QUEUE, prefetch=1, timeout=100)
    fetched = next_message(consumer)
    assert fetched.message_id == message.message_id
    key = acks_key(broker.namespace, broker.broker_id, QUEUE)
    assert broker.client.smembers(key) == {redis_id.encode()}
    consumer.ack(fetched)
    assert broker.client.smembers(key) == set()
    assert broker.client.hlen(messages_key(broker.namespace, QUEUE)) == 0
    consumer.close()


def test_a_delay_queue_consumer_survives_redis_going_away_while_it_moves_a_due_message(
    settings, private_redis, monkeypatch
):
    """Redis is killed after the delay queue's consumer fetched two delayed messages and
    before the first comes due: moving it fails, and so does putting the other one back.
    The consumer thread must start again once Redis is back (Dramatiq's thread ends on a
    Redis error), so a message delayed later still runs."""
    monkeypatch.setattr(broker_module, "BLIP_SECONDS", 0.2)  # give up on the blip sooner
    broker = make_broker(settings.replace(redis_url=private_redis.url))
    ran: list[int] = []

    @dramatiq.actor(broker=broker, queue_name=QUEUE, actor_name="delayed_noop", max_retries=0)
    def delayed_noop(n: int) -> None:
        ran.append(n)

    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    try:
        delayed_noop.send_with_options(args=(1,), delay=1500)
        delayed_noop.send_with_options(args=(3,), delay=600_000)  # held while the first fails
        delay_queue = queue_key(broker.namespace, dq_name(QUEUE))
        wait_until(lambda: broker.client.llen(delay_queue) == 0, timeout=10)  # fetched
        private_redis.kill()
        time.sleep(2.5)  # past the message's due time: moving and requeueing it both fail
        private_redis.start()
        delayed_noop.send_with_options(args=(2,), delay=100)
        wait_until(lambda: 2 in ran, timeout=30)
        assert all(thread.is_alive() for thread in worker.consumers.values())
    finally:
        worker.stop(timeout=5000)
        broker.close()


def test_a_delayed_message_runs_when_due_not_when_the_idle_wait_ends(broker):
    """An idle consumer waits on Redis up to ``worker_timeout`` (here 4 s), but a delayed
    message it handed out (a retry in its backoff) is enqueued by Dramatiq's consumer
    thread only when that wait returns: the wait must end when the message is due."""
    ran: list[float] = []

    @dramatiq.actor(broker=broker, queue_name=QUEUE, actor_name="due_soon", max_retries=0)
    def due_soon() -> None:
        ran.append(time.monotonic())

    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=4000)
    worker.start()
    try:
        time.sleep(0.5)  # both consumers idle in their long wait
        sent = time.monotonic()
        due_soon.send_with_options(delay=200)
        wait_until(lambda: ran, timeout=30)
        # held for the whole wait it would run 4 s after it was sent
        assert ran[0] - sent < 3.0, f"ran {ran[0] - sent:.2f} s after it was sent"
    finally:
        worker.stop(timeout=10_000)


def test_fetches_beat_once_an_interval_and_lend_their_maintenance_chances(broker):
    """Every consumer thread fetches at least once per idle wait; the process's heartbeat
    (Dramatiq's dispatch call) rides on one fetch per interval, and that call carries the
    maintenance chances of the fetches that went without it."""
    chances: list[int] = []
    push = broker.push_dispatch

    def counted(pipe: Any, command: str, queue_name: str, *args: Any, **options: Any) -> None:
        if command == "fetch":
            chances.append(options.get("chances", 1))
        push(pipe, command, queue_name, *args, **options)

    broker.push_dispatch = counted  # type: ignore[method-assign]
    broker.heartbeat_every = 3600.0  # the loop below stays within one interval
    for _ in range(50):
        assert broker.fetch(QUEUE, 1) == []
    assert chances == [1]  # the first fetch beat, the other 49 did not
    beat = broker.client.zscore(heartbeats_key(broker.namespace), broker.broker_id)
    assert beat is not None and beat > time.time() * 1000 - 60_000
    broker._last_fetch_heartbeat -= broker.heartbeat_every  # an interval later
    broker.fetch(QUEUE, 1)
    assert chances == [1, 50]  # the 49 without a beat and this one
    # a message still arrives on a fetch without the heartbeat
    sent = broker.enqueue(Message(QUEUE, "actor", (), {}, {}))
    (fetched,) = broker.fetch(QUEUE, 1)
    assert fetched[0] == sent.options[REDIS_MESSAGE_ID] and chances == [1, 50]


def test_an_idle_workers_heartbeat_stays_younger_than_a_short_heartbeat_timeout(settings):
    """The heartbeat rides on an idle consumer's fetch, stamped before its wait: with
    waits as long as the heartbeat timeout (1 s each here) a live, idle worker would look
    dead to Dramatiq's maintenance, which then requeues the messages it is running."""
    broker = make_broker(settings.replace(broker_heartbeat_timeout_ms=1000))
    broker.declare_queue(QUEUE)
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=1000)
    worker.start()
    try:
        key = heartbeats_key(broker.namespace)
        wait_until(lambda: broker.client.zscore(key, broker.broker_id) is not None, timeout=10)
        ages = []
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            ages.append(time.time() * 1000 - broker.client.zscore(key, broker.broker_id))
            time.sleep(0.05)
        assert max(ages) < 1000, f"heartbeat {max(ages):.0f} ms old"
    finally:
        worker.stop(timeout=10_000)
        broker.close()
