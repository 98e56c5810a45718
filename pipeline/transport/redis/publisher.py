"""The Dramatiq/Redis adapter of the :class:`~pipeline.transport.publisher.Publisher` port."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import redis
from redis.exceptions import NoScriptError

from pipeline.envelope import encode_envelope
from pipeline.errors import PermanentPublishError, PublisherUnavailable
from pipeline.signing import EnvelopeSigner, MessageKeys
from pipeline.transport.publisher import Delivery
from pipeline.transport.redis.encoding import message_json
from pipeline.transport.redis.keys import memory_key


def unavailable(exc: BaseException) -> PublisherUnavailable:
    """Any Redis failure, as the transport being down (its message names the server's reply)."""
    return PublisherUnavailable(f"Redis unavailable: {type(exc).__name__}: {exc}")


class DramatiqRedisPublisher:
    """Enqueues Dramatiq messages on consumer queues, many per Redis round trip.

    Each delivery becomes one Dramatiq message whose single argument is the list of
    CloudEvents envelopes, enqueued with Dramatiq's own ``dispatch`` Lua script (so
    workers see ordinary messages) through a Redis pipeline: one round trip per
    batch instead of one per message. Each envelope carries its signature for the
    delivery's consumer when a message key is set (:mod:`pipeline.signing`).
    """

    def __init__(
        self,
        broker: Any,
        source: str,
        max_message_bytes: int = 64 * 1024 * 1024,
        signer: EnvelopeSigner | None = None,
    ):
        self.broker = broker
        self.source = source
        self.max_message_bytes = max_message_bytes
        self.signer = signer or EnvelopeSigner(MessageKeys(), source)
        self._dispatch = broker.scripts["dispatch"]

    def encode(
        self,
        delivery: Delivery,
        envelopes_by_event: dict[uuid.UUID, str] | None = None,
        digests: dict[uuid.UUID, str] | None = None,
    ) -> tuple[str, str]:
        """The Redis message id and the Dramatiq message JSON of one delivery.

        ``envelopes_by_event`` (and ``digests``, the payload digests signatures cover)
        cache across the deliveries of one batch, so an event fanned out to several
        consumers is encoded once.
        """
        cache = {} if envelopes_by_event is None else envelopes_by_event
        for event in delivery.events:
            if event.id not in cache:
                cache[event.id] = encode_envelope(event, self.source)
        subscription = delivery.subscription
        parts = self.signer.sign_texts(
            delivery.events, subscription.consumer, cache, {} if digests is None else digests
        )
        redis_id = str(uuid.uuid4())
        body = message_json(
            subscription.queue,
            subscription.actor_name,
            ",".join(parts),
            redis_id,
            str(uuid.uuid4()),
            int(time.time() * 1000),
        )
        return redis_id, body

    def deliver(self, deliveries: Sequence[Delivery]) -> list[BaseException | None]:
        if not deliveries:
            return []
        outcomes: list[BaseException | None] = [None] * len(deliveries)
        envelopes: dict[uuid.UUID, str] = {}
        digests: dict[uuid.UUID, str] = {}
        commands: dict[int, tuple[str, str, str]] = {}  # delivery index -> queue, id, body
        for index, delivery in enumerate(deliveries):
            redis_id, body = self.encode(delivery, envelopes, digests)
            if len(body) > self.max_message_bytes:
                outcomes[index] = PermanentPublishError(
                    f"message of {len(body)} bytes exceeds the {self.max_message_bytes}-byte limit"
                )
                continue
            commands[index] = (delivery.subscription.queue, redis_id, body)
        try:
            results = self._enqueue(commands)
            if any(isinstance(result, NoScriptError) for result in results.values()):
                # The server lost its script cache (restart, SCRIPT FLUSH): load it, send again.
                self._dispatch.sha = self.broker.client.script_load(self._dispatch.script)
                retry = {i: commands[i] for i, r in results.items() if isinstance(r, NoScriptError)}
                results.update(self._enqueue(retry))
        except redis.RedisError as exc:
            raise unavailable(exc) from exc
        for result in results.values():
            if isinstance(result, redis.RedisError):
                # Out of memory, read-only replica, loading, busy script: Redis cannot take
                # writes, whichever message it is. No event is to blame, so none counts an
                # attempt: the batch is given back at once and retried when Redis recovers.
                raise unavailable(result)
        return outcomes

    def _enqueue(self, commands: dict[int, tuple[str, str, str]]) -> dict[int, object]:
        """One pipelined round trip: Dramatiq's enqueue per message, then the wake-ups."""
        if not commands:
            return {}
        pipe = self.broker.client.pipeline(transaction=False)
        for queue, redis_id, body in commands.values():
            self.broker.push_dispatch(pipe, "enqueue", queue, redis_id, body, maintenance=False)
        for queue in sorted({queue for queue, _, _ in commands.values()}):
            self.broker.push_wake(pipe, queue)  # wake idle consumers of these queues
        results = pipe.execute(raise_on_error=False)
        return dict(zip(commands, results, strict=False))

    def oldest_waiting(self, queue: str) -> datetime | None:
        try:
            waiting: datetime | None = self.broker.oldest_waiting(queue)
        except redis.RedisError as exc:
            raise unavailable(exc) from exc
        return waiting

    def forgot(self) -> bool:
        """Set the memory marker unless it is there (``SET NX``); True when this call set it.

        The marker lives as long as Redis keeps its data, so finding it gone means Redis
        lost whatever it held: restarted without persistence, flushed, or an empty replica
        promoted. Exactly one caller sees each loss (the one whose ``SET NX`` won), which
        keeps a fleet of relays to one early sweep. The very first call against a Redis
        that never had the marker also answers True: nothing is owed yet on a new
        deployment, and what a Redis forgot while no relay ran is owed at once.
        """
        try:
            created = self.broker.client.set(
                memory_key(self.broker.namespace), str(uuid.uuid4()), nx=True
            )
        except redis.RedisError as exc:
            raise unavailable(exc) from exc
        return bool(created)

    def close(self) -> None:
        self.broker.client.close()
