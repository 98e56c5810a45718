"""The publishing actor, and the relay's bounded, coalesced dispatch of it.

A storm of wake-ups must not become a storm of messages: publishing actors hold
*slots* (expiring leases the transport keeps, :meth:`Transport.publisher_slots`), the
relay only sends an actor when a slot is free, and an actor that still sees a backlog
re-sends itself on its own slot. A worker killed mid-batch leaves a slot that expires
and leases that expire, so its events are claimed again (I2).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any

import dramatiq

from pipeline.config import Settings
from pipeline.db.connect import connect
from pipeline.registry import Registry
from pipeline.relay.drain import Drainer
from pipeline.transport.base import Transport
from pipeline.transport.publisher import Publisher

log = logging.getLogger("pipeline.relay.actors")

PUBLISH_ACTOR_NAME = "pipeline_publish_outbox"
PUBLISH_QUEUE_NAME = "pipeline.publish"
ACTOR_TIME_BUDGET = 2.0

SLOTS_NAME = "pipeline-publishers"


class PublishingDispatcher:
    """Sends publishing actors while fewer than ``publishers_in_flight`` hold a slot."""

    def __init__(
        self, settings: Settings, transport: Transport, actor: dramatiq.Actor[Any, Any]
    ) -> None:
        self.settings = settings
        self.actor = actor
        self.transport = transport
        self.slots = transport.publisher_slots(SLOTS_NAME, PUBLISH_QUEUE_NAME)
        self.slot_ttl = settings.lease_seconds * 2

    def __call__(self) -> int:
        """Send actors for the free slots; a transport failure raises
        :class:`~pipeline.errors.PublisherUnavailable`."""
        capacity = self.settings.publishers_in_flight
        candidates = [uuid.uuid4().hex for _ in range(capacity)]
        slots = self.slots.acquire(candidates, capacity, self.slot_ttl)
        try:
            for slot in slots:
                self.actor.send(slot)
        except Exception as exc:
            down = self.transport.as_unavailable(exc)
            if down is None:
                raise
            raise down from exc
        return len(slots)


def declare_publishing_actor(
    transport: Transport, settings: Settings, registry: Registry, publisher: Publisher
) -> dramatiq.Actor[Any, Any]:
    """Bind the publishing actor to the transport's broker (no import-time side effects)."""
    local = threading.local()
    slots = transport.publisher_slots(SLOTS_NAME, PUBLISH_QUEUE_NAME)
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
                slots.extend(slot, settings.lease_seconds * 2)
                actor.send(slot)
            else:
                slots.release(slot)

    def forget_drainer() -> None:
        current: Drainer | None = getattr(local, "drainer", None)
        local.drainer = None
        if current is not None:
            current.conn.close()

    actor: dramatiq.Actor[Any, Any] = dramatiq.Actor(
        publish_outbox,
        broker=transport.broker,
        actor_name=PUBLISH_ACTOR_NAME,
        queue_name=PUBLISH_QUEUE_NAME,
        priority=0,
        options={"max_retries": 0, "time_limit": int(settings.lease_seconds * 1000)},
    )
    return actor
