"""The worker's Redis consumer: wake-up list instead of blind polling (real Redis)."""

from __future__ import annotations

import threading
import time

from dramatiq.message import Message

from pipeline.broker import make_broker, wake_key


def test_a_short_fetch_waits_on_the_wake_up_list_and_wakes_for_the_next_message(settings):
    broker = make_broker(settings)
    queue = "wake_test"
    broker.declare_queue(queue)
    calls: list[str] = []
    fetch, blpop = broker.do_fetch, broker.client.blpop

    def counted_fetch(*args, **kwargs):
        calls.append("fetch")
        return fetch(*args, **kwargs)

    def counted_blpop(*args, **kwargs):
        calls.append("blpop")
        return blpop(*args, **kwargs)

    def publish(n: int) -> None:  # what the relay's publisher does: message, then wake-up
        broker.enqueue(Message(queue, "noop", (n,), {}, {}))
        broker.client.lpush(wake_key(broker.namespace, queue), "1")

    broker.do_fetch, broker.client.blpop = counted_fetch, counted_blpop
    consumer = broker.consume(queue, prefetch=4, timeout=1000)
    try:
        publish(1)
        first = next(consumer)
        assert first is not None and first.args == (1,)
        assert calls == ["fetch"]  # one message of the four asked for: the queue is empty
        calls.clear()
        assert next(consumer) is None
        assert calls == ["blpop"]  # straight to the wake-up list, no second fetch
        calls.clear()

        later = threading.Timer(0.3, publish, args=(2,))
        later.start()
        deadline = time.monotonic() + 10
        second = None
        while second is None and time.monotonic() < deadline:
            second = next(consumer)
        later.join()
        assert second is not None and second.args == (2,)
        assert "blpop" in calls  # it waited on the list, and the wake-up ended the wait
    finally:
        consumer.close()
        broker.close()
