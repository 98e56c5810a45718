"""The publishing actor, and the relay's bounded, coalesced dispatch of it.

A storm of wake-ups must not become a storm of messages: publishing actors hold
*slots* in a Redis sorted set (score = expiry), the relay only sends an actor when
a slot is free, and an actor that still sees a backlog re-sends itself on its own
slot. A worker killed mid-batch leaves a slot that expires and leases that expire,
so its events are claimed again (I2).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any

import dramatiq
import redis

from pipeline.config import Settings
from pipeline.db.connect import connect
from pipeline.registry import Registry
from pipeline.relay.drain import Drainer
from pipeline.transport.publisher import Publisher, PublisherUnavailable

log = logging.getLogger("pipeline.relay.actors")

PUBLISH_ACTOR_NAME = "pipeline_publish_outbox"
PUBLISH_QUEUE_NAME = "pipeline.publish"
ACTOR_TIME_BUDGET = 2.0

# KEYS[1] slot set; ARGV: now, expiry, max, candidate slot ids... -> the slots acquired
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


def slots_key(settings: Settings) -> str:
    return f"{settings.redis_namespace}:pipeline-publishers"


class PublishingDispatcher:
    """Sends publishing actors while fewer than ``publishers_in_flight`` hold a slot."""

    def __init__(self, settings: Settings, broker: Any, actor: dramatiq.Actor[Any, Any]) -> None:
        self.settings = settings
        self.actor = actor
        self.key = slots_key(settings)
        self.slot_ttl = settings.lease_seconds * 2
        self._acquire = broker.client.register_script(_ACQUIRE_SLOTS)

    def __call__(self) -> int:
        """Send actors for the free slots; a Redis failure raises :class:`PublisherUnavailable`."""
        now = time.time()
        candidates = [uuid.uuid4().hex for _ in range(self.settings.publishers_in_flight)]
        try:
            slots = self._acquire(
                keys=[self.key],
                args=[now, now + self.slot_ttl, self.settings.publishers_in_flight, *candidates],
            )
            for slot in slots:
                self.actor.send(slot.decode() if isinstance(slot, bytes) else slot)
        except redis.RedisError as exc:
            raise PublisherUnavailable(f"Redis unavailable: {type(exc).__name__}: {exc}") from exc
        return len(slots)


def declare_publishing_actor(
    broker: Any, settings: Settings, registry: Registry, publisher: Publisher
) -> dramatiq.Actor[Any, Any]:
    """Bind the publishing actor to ``broker`` (no import-time broker side effects)."""
    local = threading.local()
    key = slots_key(settings)
    # Stay well inside the time limit (the lease): an interrupted batch only costs a retry.
    budget = min(ACTOR_TIME_BUDGET, settings.lease_seconds / 4)

    def drainer() -> Drainer:
        current: Drainer | None = getattr(local, "drainer", None)
        if current is None or current.conn.closed:
            owner = f"worker-{os.getpid()}-{threading.get_ident()}"
            conn = connect(settings, autocommit=True)
            current = Drainer(settings, publisher, registry, owner, conn)
            local.drainer = current
        return current

    def publish_outbox(slot: str) -> None:
        more = False
        try:
            worker = drainer()
            deadline = time.monotonic() + budget
            while time.monotonic() < deadline:
                result = worker.run_batch()
                more = result.full
                if not more:
                    break
        except BaseException:
            # A batch interrupted mid-statement (time limit, lost server) leaves the
            # connection unusable: drop it so that the next message starts clean.
            forget_drainer()
            raise
        finally:
            if more:
                broker.client.zadd(key, {slot: time.time() + settings.lease_seconds * 2})
                actor.send(slot)
            else:
                broker.client.zrem(key, slot)

    def forget_drainer() -> None:
        current: Drainer | None = getattr(local, "drainer", None)
        local.drainer = None
        if current is not None:
            current.conn.close()

    actor: dramatiq.Actor[Any, Any] = dramatiq.Actor(
        publish_outbox,
        broker=broker,
        actor_name=PUBLISH_ACTOR_NAME,
        queue_name=PUBLISH_QUEUE_NAME,
        priority=0,
        options={"max_retries": 0, "time_limit": int(settings.lease_seconds * 1000)},
    )
    return actor
