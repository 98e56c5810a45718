"""The Dramatiq broker on Redis, built from settings.

``PipelineRedisBroker`` changes one thing in Dramatiq's Redis consumer: an idle
consumer blocks on a per-queue wake-up list instead of sleeping up to
``worker_timeout``, so an idle pipeline delivers at once without polling Redis hard.
Every enqueue pushes a wake-up (the relay's publisher with each batch, this broker
for Dramatiq's own enqueues), so a consumer whose wait timed out has nothing to fetch
and only sweeps the queue once a second (for messages requeued by Dramatiq's
maintenance, and to keep its heartbeat fresh). One wake-up wakes one consumer; one
whose fetch came back full passes a wake-up on, so others join in on a backlog.
Without this, every consumer whose short wait had expired woke on the next Redis
command and fetched at once, and each delivery set off a herd of empty fetches.

Undecodable messages are handed to :attr:`PipelineRedisBroker.undecodable_sink` and
removed, instead of being stuck in the consumer's un-acked set.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis
from dramatiq.broker import MessageProxy
from dramatiq.brokers.redis import (
    MAINTENANCE_COMMAND_BLACKLIST,
    MAINTENANCE_SCALE,
    RedisBroker,
    _RedisConsumer,
)
from dramatiq.common import compute_backoff
from dramatiq.errors import ConnectionClosed, DecodeError
from dramatiq.message import Message
from dramatiq.middleware import (
    AgeLimit,
    Callbacks,
    Pipelines,
    ShutdownNotifications,
    TimeLimit,
)

from pipeline.config import Settings

log = logging.getLogger("pipeline.broker")

UndecodableSink = Callable[[str, bytes, str], None]
"""Called with (queue name, raw message bytes, reason) for a message that is not decodable."""


SWEEP_INTERVAL = 1.0
"""Seconds between fetches of a consumer that no wake-up has called for."""
SWEEP_MAINTENANCE_FACTOR = 10
"""A sweep replaces about ten fetches of Dramatiq's consumer (``worker_timeout`` 100 ms)."""
_sweep = threading.local()  # .active: the current thread's fetch is a sweep


def wake_key(namespace: str, queue_name: str) -> str:
    return f"{namespace}:pipeline-wake:{queue_name}"


def _log_undecodable(queue_name: str, data: bytes, reason: str) -> None:
    log.error("dropped undecodable message", extra={"queue": queue_name, "reason": reason})


class WakeableRedisConsumer(_RedisConsumer):
    """Dramatiq's Redis consumer, waking on a wake-up list instead of sleeping blind."""

    def __next__(self) -> Any:
        try:
            while True:
                try:
                    data = self.message_cache.pop(0)
                except IndexError:
                    if not self._fetch():
                        return None
                    continue
                if data is None:
                    continue
                self.misses = 0
                try:
                    message = Message.decode(data)
                except (DecodeError, UnicodeDecodeError, TypeError, KeyError) as exc:
                    self._discard_undecodable(data, f"undecodable message: {exc}")
                    continue
                self.queued_message_ids.add(message.message_id)
                return MessageProxy(message)
        except redis.ConnectionError as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]

    _drained = False  # the last fetch got fewer messages than it asked for
    _last_fetch = 0.0  # monotonic time of the last fetch
    _timed_out = False  # the last wait on the wake-up list ended without a wake-up

    def _fetch(self) -> bool:
        messages: list[Any] = []
        wanted = self.prefetch - self.outstanding_message_count
        if wanted > 0 and not self._drained:
            self._last_fetch = time.monotonic()
            _sweep.active = self._timed_out
            try:
                self.message_cache = messages = self.broker.do_fetch(self.queue_name, wanted)
            finally:
                _sweep.active = False
        if messages:
            # A short fetch emptied the queue: wait on the wake-up list next instead of
            # asking again (anything enqueued after this fetch pushed a wake-up after it,
            # so the wait returns at once for it). A full one, or one Dramatiq's script cut
            # at its unpack limit, may have left a backlog: others are woken for it.
            self._drained = len(messages) < min(wanted, self.broker._max_unpack_size())
            if not self._drained:
                self.broker.wake(self.queue_name)
            return True
        if self.outstanding_message_count >= self.prefetch:  # enough in hand: back off
            self.misses, backoff_ms = compute_backoff(self.misses, max_backoff=self.timeout)
            time.sleep(backoff_ms / 1000)
            self._drained = False
            return False
        woken = self.broker.client.blpop(
            [wake_key(self.broker.namespace, self.queue_name)], max(self.timeout / 1000, 0.01)
        )
        self._timed_out = woken is None
        self._drained = woken is None and time.monotonic() - self._last_fetch < SWEEP_INTERVAL
        return False

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        """Dramatiq's requeue (a stopping worker's unprocessed messages), then a wake-up."""
        super().requeue(messages)  # type: ignore[no-untyped-call]
        self.broker.wake(self.queue_name)

    def _discard_undecodable(self, data: bytes, reason: str) -> None:
        """Hand the raw bytes to the sink, then remove them from Redis (they can never run)."""
        self.broker.undecodable_sink(self.queue_name, data, reason)
        acks = f"{self.broker.namespace}:__acks__.{self.broker.broker_id}.{self.queue_name}"
        messages = f"{self.broker.namespace}:{self.queue_name}.msgs"
        for message_id in self.broker.client.smembers(acks):
            if self.broker.client.hget(messages, message_id) == data:
                self.broker.do_ack(self.queue_name, message_id)
                return


class PipelineRedisBroker(RedisBroker):
    undecodable_sink: UndecodableSink = staticmethod(_log_undecodable)

    @property
    def consumer_class(self) -> type[WakeableRedisConsumer]:
        return WakeableRedisConsumer

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Dramatiq's enqueue (actor sends, re-sends, due delayed messages), then a wake-up."""
        enqueued: Message[Any] = super().enqueue(message, delay=delay)
        self.wake(enqueued.queue_name)
        return enqueued

    def wake(self, queue_name: str) -> None:
        """Leave one wake-up on the queue's list (a list of at most one: wake-ups fold).

        Best effort: the message is already queued, and a consumer's sweep finds it
        within a second even if this fails (raising would make a caller send it again).
        """
        key = wake_key(self.namespace, queue_name)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.lpush(key, "1")
            pipe.ltrim(key, 0, 0)
            pipe.execute()
        except redis.RedisError as exc:
            log.warning(
                "could not push a wake-up; consumers find the message on their next sweep",
                extra={"queue": queue_name, "error_class": type(exc).__name__},
            )

    def _should_do_maintenance(self, command: str) -> int:
        """Dramatiq's chance per command, times ``SWEEP_MAINTENANCE_FACTOR`` for a sweep.

        Maintenance (requeueing the un-acked messages of dead workers) rides on fetches
        at random. An idle consumer sweeps once a second instead of fetching after every
        ``worker_timeout``, so its sweep carries the chance of the fetches it replaces.
        """
        if not getattr(_sweep, "active", False):
            return super()._should_do_maintenance(command)
        chance = min(self.maintenance_chance * SWEEP_MAINTENANCE_FACTOR, MAINTENANCE_SCALE)
        return int(
            command not in MAINTENANCE_COMMAND_BLACKLIST
            and random.randint(1, MAINTENANCE_SCALE) <= chance
        )


def make_broker(settings: Settings, middleware: list[Any] | None = None) -> PipelineRedisBroker:
    """A broker for the configured Redis (``redis://``, ``rediss://`` TLS, or ``unix://``).

    Dramatiq's Retries middleware is left out on purpose: the inbox retries with its
    own bookkeeping (attempt history, dead letters in Postgres).
    """
    stack = (
        middleware
        if middleware is not None
        else [AgeLimit(), TimeLimit(), ShutdownNotifications(), Callbacks(), Pipelines()]
    )
    return PipelineRedisBroker(  # type: ignore[no-untyped-call]
        url=settings.require_redis_url(),
        namespace=settings.redis_namespace,
        middleware=stack,
        heartbeat_timeout=settings.broker_heartbeat_timeout_ms,
        maintenance_chance=settings.broker_maintenance_chance,
    )
