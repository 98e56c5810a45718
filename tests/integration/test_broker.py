"""The worker's Redis consumer: wake-up list instead of blind polling (real Redis)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from dramatiq.message import Message

from pipeline import broker as broker_module
from pipeline.broker import PipelineRedisBroker, make_broker, wake_key

QUEUE = "wake_test"


@pytest.fixture
def broker(settings: Any) -> Iterator[PipelineRedisBroker]:
    broker = make_broker(settings)
    broker.declare_queue(QUEUE)
    yield broker
    broker.close()


def count_calls(broker: PipelineRedisBroker) -> list[str]:
    """Record the consumer's Redis calls: fetches, waits on the wake-up list, wake-ups."""
    calls: list[str] = []
    fetch, blpop, wake = broker.do_fetch, broker.client.blpop, broker.wake

    def counted_fetch(*args: Any, **kwargs: Any) -> Any:
        calls.append("fetch")
        return fetch(*args, **kwargs)

    def counted_blpop(*args: Any, **kwargs: Any) -> Any:
        result = blpop(*args, **kwargs)
        calls.append("blpop" if result is not None else "blpop timed out")
        return result

    def counted_wake(queue_name: str) -> None:
        calls.append("wake")
        wake(queue_name)

    broker.do_fetch, broker.client.blpop, broker.wake = counted_fetch, counted_blpop, counted_wake  # type: ignore[method-assign]
    return calls


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
        # the next enqueue's wake-up ends the wait.
        assert calls[-3:] == ["wake", "blpop", "fetch"], calls
        assert calls.count("fetch") <= 2, calls
    finally:
        consumer.close()


def test_a_wait_that_times_out_does_not_fetch_until_the_sweep_is_due(broker, monkeypatch):
    monkeypatch.setattr(broker_module, "SWEEP_INTERVAL", 0.5)
    calls = count_calls(broker)
    consumer = broker.consume(QUEUE, prefetch=4, timeout=100)
    try:
        started = time.monotonic()
        assert next(consumer) is None  # the first call always fetches
        while time.monotonic() - started < 0.35:
            assert next(consumer) is None
        assert calls[0] == "fetch"
        assert calls.count("fetch") == 1, calls  # timed-out waits, no fetch between them
        assert calls.count("blpop timed out") >= 2, calls

        # A message that arrived without a wake-up (Dramatiq's maintenance requeues one so)
        # is found by the sweep.
        broker.do_enqueue(QUEUE, "raw-id", Message(QUEUE, "noop", (3,), {}, {}).encode())
        message = next_message(consumer)
        assert message.args == (3,)
        assert time.monotonic() - started >= 0.5
    finally:
        consumer.close()


def test_a_full_fetch_passes_a_wake_up_on_to_the_next_consumer(broker):
    for n in range(6):
        broker.do_enqueue(QUEUE, f"id-{n}", Message(QUEUE, "noop", (n,), {}, {}).encode())
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
        broker.do_enqueue(QUEUE, f"id-{n}", Message(QUEUE, "noop", (n,), {}, {}).encode())
    monkeypatch.setattr(broker, "_max_unpack_size", lambda: 3)
    calls = count_calls(broker)
    consumer = broker.consume(QUEUE, prefetch=10, timeout=1000)
    try:
        next_message(consumer)
        assert calls == ["fetch", "wake"]  # 3 of 10 asked for, but cut at the limit of 3
        for _ in range(2):
            next_message(consumer)
        assert next_message(consumer).args in {(3,), (4,)}  # fetched again, no sweep wait
        assert calls.count("blpop timed out") == 0, calls
    finally:
        consumer.close()


def test_a_sweep_carries_the_maintenance_chance_of_the_fetches_it_replaces(broker):
    """Maintenance (requeueing dead workers' messages) rides on fetches at random."""
    flags: list[tuple[str, int]] = []
    dispatch = broker.scripts["dispatch"]

    def recording(args: list[Any], keys: list[str]) -> Any:
        flags.append((args[0], args[6]))  # command, do_maintenance
        return dispatch(args=args, keys=keys)

    broker.scripts["dispatch"] = recording
    broker.maintenance_chance = 100_000  # 10 % per fetch; a sweep: x10 = always
    consumer = broker.consume(QUEUE, prefetch=4, timeout=100)
    try:
        deadline = time.monotonic() + 10
        while sum(1 for command, _ in flags if command == "fetch") < 4:
            assert time.monotonic() < deadline, flags
            next(consumer)
        fetches = [flag for command, flag in flags if command == "fetch"]
        assert fetches[1:] == [1] * (len(fetches) - 1), fetches  # every sweep after the first
    finally:
        consumer.close()


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
    assert broker.client.llen(f"{broker.namespace}:{QUEUE}") == 1  # queued all the same
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
