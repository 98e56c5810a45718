"""The RabbitMQ adapter of the :class:`~pipeline.transport.publisher.Publisher` port.

A batch is published with **one confirm round**: every message of the batch goes out on
a channel in confirm mode, then the publisher waits until the broker has confirmed
(``basic.ack``) or refused (``basic.nack``) all of them. pika's blocking channel waits
for each publish's confirm in turn, so the batch is published on the channel's
underlying asynchronous channel (``BlockingChannel._impl``, pika's private attribute;
pinned with pika's major version and exercised by ``tests/integration/test_amqp_transport.py``)
while the blocking connection runs the I/O.

A batch the broker did not confirm in full (a nack, a message returned unroutable, a
connection lost, no confirm within ``PIPELINE_BROKER_CONFIRM_TIMEOUT``) raises
:class:`~pipeline.errors.PublisherUnavailable`: nothing of it is marked sent, no event
counts an attempt, and the relay offers the batch again (the inbox absorbs what the
broker had kept of it).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pika
import pika.exceptions
from dramatiq.errors import ConnectionClosed
from pika.spec import Basic

from pipeline.envelope import encode_envelope
from pipeline.errors import PermanentPublishError, PublisherUnavailable
from pipeline.signing import EnvelopeSigner, MessageKeys
from pipeline.transport.amqp.broker import PipelineRabbitmqBroker
from pipeline.transport.publisher import Delivery

PERSISTENT = 2


def unavailable(exc: BaseException | str) -> PublisherUnavailable:
    """A RabbitMQ failure, as the transport being down."""
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return PublisherUnavailable(f"RabbitMQ unavailable: {text}")


def message_json(
    queue_name: str, actor_name: str, envelopes: str, message_id: str, timestamp_ms: int
) -> str:
    """The Dramatiq message calling ``actor_name`` with one argument, ``[envelopes]``.

    Names and ids are plain (validated queue and actor names, UUIDs) and need no escaping.
    """
    return (
        f'{{"queue_name":"{queue_name}","actor_name":"{actor_name}",'
        f'"args":[[{envelopes}]],"kwargs":{{}},"options":{{}},'
        f'"message_id":"{message_id}","message_timestamp":{timestamp_ms}}}'
    )


CONFIRM_WAIT_SLICE = 0.05
"""Seconds of one wait for confirms: a confirm ends it early, the deadline is checked after."""


def _nothing() -> None:
    """Wakes a waiting ``process_data_events`` (see :meth:`_Link.on_confirm`)."""


class _Link:
    """One thread's connection and confirm-mode channel, with its confirms' bookkeeping."""

    def __init__(self, connection: pika.BlockingConnection, channel: Any) -> None:
        self.connection = connection
        self.channel = channel
        self.next_tag = 1
        self.first_unconfirmed = 1
        self.confirmed: dict[int, bool] = {}  # delivery tag -> acked (False: nacked)
        self.returned = 0

    def on_confirm(self, frame: Any) -> None:
        method = frame.method
        acked = isinstance(method, Basic.Ack)
        tag = method.delivery_tag
        if method.multiple:
            for pending in range(self.first_unconfirmed, tag + 1):
                self.confirmed.setdefault(pending, acked)
        else:
            self.confirmed[tag] = acked
        # A confirm arrives on the channel's own callback, which does not end pika's
        # process_data_events(time_limit): without a ready event it waits out its whole
        # slice (CONFIRM_WAIT_SLICE a batch). A no-op timer is one, so the wait ends now.
        self.connection.call_later(0, _nothing)

    def on_return(self, *_args: Any) -> None:
        self.returned += 1

    @property
    def is_open(self) -> bool:
        return bool(self.channel.is_open)

    def close(self) -> None:
        if self.connection.is_open:
            with contextlib.suppress(Exception):  # already failing; the next batch reconnects
                self.connection.close()


class AmqpPublisher:
    """Publishes each delivery as one persistent Dramatiq message; one confirm round a batch.

    Thread-safe: every thread publishes on a connection of its own (pika's connections
    are not shared between threads), as the publishing actors of a worker do.
    """

    def __init__(
        self,
        broker: PipelineRabbitmqBroker,
        source: str,
        confirm_timeout: float = 30.0,
        max_message_bytes: int = 64 * 1024 * 1024,
        signer: EnvelopeSigner | None = None,
    ) -> None:
        self.broker = broker
        self.source = source
        self.signer = signer or EnvelopeSigner(MessageKeys(), source)
        self.confirm_timeout = confirm_timeout
        self.max_message_bytes = max_message_bytes
        self._local = threading.local()
        self._links: set[_Link] = set()
        self._lock = threading.Lock()

    # -- connection ------------------------------------------------------------------------
    def _open(self) -> _Link:
        link: _Link | None = getattr(self._local, "link", None)
        if link is not None and link.is_open:
            return link
        self._drop()
        connection = pika.BlockingConnection(self.broker.parameters)
        channel = connection.channel()
        link = _Link(connection, channel)
        impl = channel._impl  # the asynchronous channel under pika's blocking one
        selected: list[bool] = []
        impl.confirm_delivery(
            ack_nack_callback=link.on_confirm, callback=lambda _frame: selected.append(True)
        )
        deadline = time.monotonic() + self.confirm_timeout
        while not selected:
            if time.monotonic() > deadline:
                link.close()
                raise unavailable("no reply to confirm.select")
            connection.process_data_events(time_limit=0.05)
        channel.add_on_return_callback(link.on_return)
        self._local.link = link
        with self._lock:
            self._links.add(link)
        return link

    def _drop(self) -> None:
        """Close this thread's connection (the next batch opens another)."""
        link: _Link | None = getattr(self._local, "link", None)
        self._local.link = None
        if link is not None:
            with self._lock:
                self._links.discard(link)
            link.close()

    # -- Publisher port --------------------------------------------------------------------
    def encode(
        self,
        delivery: Delivery,
        cache: dict[uuid.UUID, str],
        digests: dict[uuid.UUID, str] | None = None,
    ) -> bytes:
        """The Dramatiq message of one delivery, its envelopes signed for its consumer when
        a message key is set (as the Redis publisher does)."""
        for event in delivery.events:
            if event.id not in cache:
                cache[event.id] = encode_envelope(event, self.source)
        subscription = delivery.subscription
        parts = self.signer.sign_texts(
            delivery.events, subscription.consumer, cache, {} if digests is None else digests
        )
        return message_json(
            subscription.queue,
            subscription.actor_name,
            ",".join(parts),
            str(uuid.uuid4()),
            int(time.time() * 1000),
        ).encode()

    def deliver(self, deliveries: Sequence[Delivery]) -> list[BaseException | None]:
        if not deliveries:
            return []
        outcomes: list[BaseException | None] = [None] * len(deliveries)
        envelopes: dict[uuid.UUID, str] = {}
        digests: dict[uuid.UUID, str] = {}
        bodies: list[tuple[str, bytes]] = []
        for index, delivery in enumerate(deliveries):
            body = self.encode(delivery, envelopes, digests)
            if len(body) > self.max_message_bytes:
                outcomes[index] = PermanentPublishError(
                    f"message of {len(body)} bytes exceeds the {self.max_message_bytes}-byte limit"
                )
                continue
            bodies.append((delivery.subscription.queue, body))
        if bodies:
            try:
                self._publish(bodies)
            except PublisherUnavailable:
                self._drop()
                raise
            except (pika.exceptions.AMQPError, ConnectionClosed, OSError) as exc:
                self._drop()
                del self.broker.connection
                self.broker.queues_pending.update(self.broker.queues)
                raise unavailable(exc) from exc
        return outcomes

    def _publish(self, bodies: list[tuple[str, bytes]]) -> None:
        for queue in sorted({queue for queue, _ in bodies}):
            self.broker.declare_queue(queue, ensure=True)  # quorum, once per process
        link = self._open()
        impl = link.channel._impl
        first = link.next_tag
        link.first_unconfirmed = first
        link.returned = 0
        properties = pika.BasicProperties(delivery_mode=PERSISTENT)
        for queue, body in bodies:
            impl.basic_publish(
                exchange="",
                routing_key=self.broker.physical(queue),
                body=body,
                properties=properties,
                mandatory=True,
            )
        last = first + len(bodies) - 1
        link.next_tag = last + 1
        deadline = time.monotonic() + self.confirm_timeout
        while any(tag not in link.confirmed for tag in range(first, last + 1)):
            if time.monotonic() > deadline:
                raise unavailable(f"no confirm within {self.confirm_timeout:.0f}s")
            link.connection.process_data_events(time_limit=CONFIRM_WAIT_SLICE)
        link.connection.process_data_events(time_limit=0)  # hand over returns received
        refused = sum(1 for tag in range(first, last + 1) if not link.confirmed.pop(tag))
        if refused:
            raise unavailable(f"the broker refused {refused} of {len(bodies)} messages (nack)")
        if link.returned:
            self.broker.queues_pending.update(q for q, _ in bodies)
            raise unavailable(f"{link.returned} messages returned unroutable (queue missing)")

    def oldest_waiting(self, queue: str) -> datetime | None:
        """Now when the queue holds ready messages, else None.

        RabbitMQ cannot show a queue's head without taking it, so a queue with any
        message waiting counts as holding the youngest delivery too: the ledger sweep
        resends nothing for it until it has drained.
        """
        try:
            counts = self.broker.get_queue_message_counts(queue)
        except (pika.exceptions.AMQPError, ConnectionClosed, OSError) as exc:
            del self.broker.connection
            raise unavailable(exc) from exc
        return datetime.now(UTC) if counts[0] else None

    def forgot(self) -> bool:
        """False: quorum queues keep what they confirmed; the ledger's horizon remains the
        backstop for anything else."""
        return False

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links), set()
        for link in links:
            link.close()
