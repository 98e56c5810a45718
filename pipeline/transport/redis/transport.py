"""The Redis transport: Dramatiq's Redis broker, extended (:mod:`.broker`), behind the seam."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import redis

from pipeline.config import Settings
from pipeline.driver_errors import translate
from pipeline.errors import PublisherUnavailable, ServiceUnavailableError
from pipeline.redaction import redact_secrets, redact_url
from pipeline.signing import EnvelopeSigner
from pipeline.transport.base import (
    BrokerDiagnosis,
    MissingBodySink,
    QueueDepth,
    Slots,
    Transport,
    UndecodableSink,
)
from pipeline.transport.publisher import Publisher
from pipeline.transport.redis.broker import PipelineRedisBroker, make_broker
from pipeline.transport.redis.client import redis_client
from pipeline.transport.redis.keys import (
    dead_set_key,
    delay_queue_key,
    messages_key,
    queue_key,
    queue_of_messages_key,
)
from pipeline.transport.redis.publisher import DramatiqRedisPublisher, unavailable

T = TypeVar("T")

# KEYS[1] slot set (score = expiry); ARGV: now, expiry, capacity, candidate slot ids...
# Drops expired slots, then adds candidates while fewer than ``capacity`` are held;
# returns the slots acquired. Atomic, so concurrent relays never over-fill the set.
_ACQUIRE_SLOTS = """
redis.call('zremrangebyscore', KEYS[1], '-inf', ARGV[1])
local free = tonumber(ARGV[3]) - redis.call('zcard', KEYS[1])
local acquired = {}
for i = 4, #ARGV do
    if free <= 0 then break end
    redis.call('zadd', KEYS[1], ARGV[2], ARGV[i])
    table.insert(acquired, ARGV[i])
    free = free - 1
end
return acquired
"""


class RedisSlots(Slots):
    """Slots as members of a sorted set scored by their expiry."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client = client
        self.key = key
        self._acquire = client.register_script(_ACQUIRE_SLOTS)

    def acquire(self, candidates: Sequence[str], capacity: int, ttl: float) -> list[str]:
        now = time.time()
        try:
            slots = self._acquire(keys=[self.key], args=[now, now + ttl, capacity, *candidates])
        except redis.RedisError as exc:
            raise unavailable(exc) from exc
        return [slot.decode() if isinstance(slot, bytes) else str(slot) for slot in slots]

    def extend(self, slot: str, ttl: float) -> None:
        self.client.zadd(self.key, {slot: time.time() + ttl})

    def release(self, slot: str) -> None:
        self.client.zrem(self.key, slot)


class RedisTransport(Transport):
    """Dramatiq on Redis (``redis://``, ``rediss://`` TLS, ``unix://``); the broker is
    :func:`.broker.make_broker`'s, with the workers' middleware stack unless told otherwise.
    """

    broker: PipelineRedisBroker

    def build_broker(
        self, middleware: list[Any] | None, timeout: float | None
    ) -> PipelineRedisBroker:
        return make_broker(self.settings, middleware, timeout=timeout)

    @property
    def namespace(self) -> str:
        return self.settings.redis_namespace

    def publisher(self, source: str) -> Publisher:
        return DramatiqRedisPublisher(
            self.broker, source, signer=EnvelopeSigner.from_settings(self.settings, source)
        )

    def publisher_slots(self, name: str, queue: str | None = None) -> Slots:
        return RedisSlots(self.broker.client, f"{self.namespace}:{name}")

    def as_unavailable(self, exc: BaseException) -> PublisherUnavailable | None:
        return unavailable(exc) if isinstance(exc, redis.RedisError) else None

    def on_undecodable(self, sink: UndecodableSink) -> None:
        self.broker.undecodable_sink = sink

    def on_missing_body(self, sink: MissingBodySink) -> None:
        self.broker.missing_body_sink = sink

    def queue_depths(self, queues: Iterable[str]) -> dict[str, QueueDepth]:
        names = sorted(set(queues))
        if not names:
            return {}
        pipe = self.broker.client.pipeline(transaction=False)
        for name in names:
            pipe.llen(queue_key(self.namespace, name))
            pipe.llen(delay_queue_key(self.namespace, name))
            pipe.zcard(dead_set_key(self.namespace, name))
        results = self._run(pipe.execute)
        return {
            name: QueueDepth(int(results[3 * i]), int(results[3 * i + 1]), int(results[3 * i + 2]))
            for i, name in enumerate(names)
        }

    def queues_holding_messages(self, limit: int = 10_000) -> set[str]:
        """Found by their message hashes (a ``SCAN``, never ``KEYS``; at most ``limit``)."""

        def scan() -> set[str]:
            found: set[str] = set()
            pattern = messages_key(self.namespace, "*")
            keys = self.broker.client.scan_iter(match=pattern, count=1000)
            for index, key in enumerate(keys):
                if index >= limit:
                    break
                text = key.decode() if isinstance(key, bytes) else str(key)
                name = queue_of_messages_key(self.namespace, text)
                if name is not None:
                    found.add(name)
            return found

        return self._run(scan)

    def _run(self, call: Callable[[], T]) -> T:
        """``call()``, a Redis failure raised as :class:`ServiceUnavailableError`."""
        try:
            return call()
        except redis.RedisError as exc:
            error = translate(exc, self.settings)
            raise (error or ServiceUnavailableError(str(exc))) from exc

    @classmethod
    def diagnose(cls, settings: Settings, longest_hold_ms: int) -> BrokerDiagnosis:
        from pipeline.transport.redis.health import diagnose

        return diagnose(settings)

    @classmethod
    def problem(cls, settings: Settings) -> str | None:
        url = settings.require_broker_url()
        client = redis_client(url, 5.0)
        try:
            client.ping()
        except redis.RedisError as exc:
            reason = redact_secrets(f"{type(exc).__name__}: {exc}", url)
            return f"cannot use Redis at {redact_url(url)}: {reason}"
        finally:
            client.close()
        return None

    @classmethod
    def delete_namespace(cls, url: str, namespace: str, management_url: str | None = None) -> None:
        """Delete the keys named ``<namespace>:*``, in chunks of 500.

        Scans rather than ``KEYS``, so a shared Redis is not blocked, and touches nothing
        outside the namespace: the queues, wake-up lists and acks of one pipeline only.
        """
        client = redis_client(url)
        try:
            keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
            for start in range(0, len(keys), 500):
                client.delete(*keys[start : start + 500])
        finally:
            client.close()
