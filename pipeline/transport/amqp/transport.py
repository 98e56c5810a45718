"""The RabbitMQ transport: Dramatiq's RabbitMQ broker, extended (:mod:`.broker`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import pika
import pika.exceptions
from dramatiq.common import dq_name, xq_name
from dramatiq.errors import ConnectionClosed

from pipeline.config import Settings
from pipeline.errors import PublisherUnavailable, ServiceUnavailableError
from pipeline.redaction import redact_secrets, redact_url
from pipeline.signing import EnvelopeSigner
from pipeline.transport.amqp.broker import (
    PipelineRabbitmqBroker,
    connect,
    make_broker,
    physical_name,
)
from pipeline.transport.amqp.management import Management
from pipeline.transport.amqp.publisher import AmqpPublisher, unavailable
from pipeline.transport.base import (
    BrokerDiagnosis,
    QueueDepth,
    Slots,
    Transport,
    UndecodableSink,
)
from pipeline.transport.publisher import Publisher

log = logging.getLogger("pipeline.transport.amqp")
T = TypeVar("T")
FAILURES = (pika.exceptions.AMQPError, ConnectionClosed, OSError)


class QueueBoundSlots(Slots):
    """Slots bounded by the messages waiting on the holders' queue.

    RabbitMQ has no shared, expiring set to keep leases in, so a slot is free while fewer
    than ``capacity`` messages wait (ready) on the queue the holders are sent to: a storm
    of wake-ups still sends at most ``capacity`` waiting messages. Running holders are not
    counted, so up to twice ``capacity`` may be in flight per relay; ``extend`` and
    ``release`` have nothing to do.
    """

    def __init__(self, transport: AmqpTransport, queue: str) -> None:
        self.transport = transport
        self.queue = queue

    def acquire(self, candidates: Sequence[str], capacity: int, ttl: float) -> list[str]:
        try:
            waiting = self.transport.ready_count(self.queue)
        except ServiceUnavailableError as exc:
            raise PublisherUnavailable(str(exc)) from exc
        return list(candidates[: max(0, capacity - waiting)])

    def extend(self, slot: str, ttl: float) -> None:
        return None

    def release(self, slot: str) -> None:
        return None


class AmqpTransport(Transport):
    """Dramatiq on RabbitMQ (``amqp://``, ``amqps://`` TLS): quorum queues, publisher
    confirms, persistent messages, bounded prefetch (see :mod:`.broker`)."""

    broker: PipelineRabbitmqBroker

    def build_broker(
        self, middleware: list[Any] | None, timeout: float | None
    ) -> PipelineRabbitmqBroker:
        return make_broker(self.settings, middleware, timeout=timeout)

    @property
    def namespace(self) -> str:
        return self.settings.redis_namespace

    def publisher(self, source: str) -> Publisher:
        return AmqpPublisher(
            self.broker,
            source,
            self.settings.broker_confirm_timeout,
            signer=EnvelopeSigner.from_settings(self.settings, source),
        )

    def publisher_slots(self, name: str, queue: str | None = None) -> Slots:
        return QueueBoundSlots(self, queue or name)

    def as_unavailable(self, exc: BaseException) -> PublisherUnavailable | None:
        return unavailable(exc) if isinstance(exc, FAILURES) else None

    def on_undecodable(self, sink: UndecodableSink) -> None:
        self.broker.undecodable_sink = sink

    def _run(self, call: Callable[[], T]) -> T:
        """``call()``, a RabbitMQ failure raised as :class:`ServiceUnavailableError`."""
        try:
            return call()
        except FAILURES as exc:
            del self.broker.connection
            url = self.settings.require_broker_url()
            reason = redact_secrets(f"{type(exc).__name__}: {exc}", url)
            raise ServiceUnavailableError(
                f"cannot use RabbitMQ at {redact_url(url)}: {reason}"
            ) from exc

    def _count(self, queue_name: str) -> int:
        """Ready messages on the server's queue for ``queue_name`` (0 if it does not exist)."""
        channel = self.broker.channel
        try:
            reply = channel.queue_declare(
                queue=physical_name(self.namespace, queue_name), passive=True
            )
        except pika.exceptions.ChannelClosedByBroker as exc:
            del self.broker.channel
            if exc.reply_code == 404:
                return 0
            raise
        count: int = reply.method.message_count
        return count

    def ready_count(self, queue_name: str) -> int:
        return self._run(lambda: self._count(queue_name))

    def queue_depths(self, queues: Iterable[str]) -> dict[str, QueueDepth]:
        def read() -> dict[str, QueueDepth]:
            return {
                name: QueueDepth(
                    self._count(name), self._count(dq_name(name)), self._count(xq_name(name))
                )
                for name in sorted(set(queues))
            }

        return self._run(read)

    def queues_holding_messages(self) -> set[str]:
        """Found through the management API; without it, none (a warning says why)."""
        try:
            listed = Management.for_settings(self.settings).queues()
        except ServiceUnavailableError as exc:
            log.warning(f"queues holding messages unknown: {exc}")
            return set()
        prefix = f"{self.namespace}."
        found: set[str] = set()
        for queue in listed:
            name = str(queue.get("name", ""))
            if not name.startswith(prefix) or not queue.get("messages"):
                continue
            name = name[len(prefix) :]
            for suffix in (dq_name(""), xq_name("")):
                name = name.removesuffix(suffix)
            if name:
                found.add(name)
        return found

    @classmethod
    def diagnose(cls, settings: Settings, longest_hold_ms: int) -> BrokerDiagnosis:
        from pipeline.transport.amqp.health import diagnose

        return diagnose(settings, longest_hold_ms)

    @classmethod
    def problem(cls, settings: Settings) -> str | None:
        url = settings.require_broker_url()
        try:
            connection = connect(url, 5.0)
        except FAILURES as exc:
            reason = redact_secrets(f"{type(exc).__name__}: {exc}", url)
            return f"cannot use RabbitMQ at {redact_url(url)}: {reason}"
        connection.close()
        return None

    @classmethod
    def delete_namespace(cls, url: str, namespace: str, management_url: str | None = None) -> None:
        """Delete the queues named ``<namespace>.*`` (through the management API)."""
        management = Management(url, management_url)
        for queue in management.queues():
            name = str(queue.get("name", ""))
            if name.startswith(f"{namespace}."):
                management.delete_queue(name)
