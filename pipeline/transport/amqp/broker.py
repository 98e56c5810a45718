"""Dramatiq's RabbitMQ broker, declaring quorum queues under the pipeline's namespace.

Dramatiq's ``RabbitmqBroker`` declares classic queues, publishes without confirms unless
told, and names queues exactly as the actors do. ``PipelineRabbitmqBroker`` changes that:

* every queue it declares (a consumer queue, its delay queue ``<queue>.DQ`` and its
  dead-letter queue ``<queue>.XQ``) is a durable **quorum queue** (``x-queue-type:
  quorum``; never ``x-max-priority``, which quorum queues refuse);
* the queues live under ``<namespace>.`` on the server (``pipeline.orders.DQ``), so
  several pipelines (and test runs) share one virtual host without meeting; messages
  keep the actors' queue names, so Dramatiq's workers see ordinary messages;
* every publish waits for the broker's confirm (``confirm_delivery``), persistent;
* a consumer's prefetch is bounded (``PIPELINE_BROKER_PREFETCH_MAX``);
* a message no Dramatiq client could decode (or a foreign one) goes to
  :attr:`PipelineRabbitmqBroker.undecodable_sink` and is then acknowledged (removed);
  if the sink fails it is rejected, and RabbitMQ dead-letters it to ``<queue>.XQ``.

It overrides private methods of Dramatiq's broker and consumer (``_declare_*``,
``_build_queue_arguments``); Dramatiq is pinned to one minor series in pyproject.toml and
``tests/integration/test_amqp_transport.py`` declares real queues through them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pika
import pika.exceptions
from dramatiq.brokers.rabbitmq import (
    DEAD_MESSAGE_TTL,
    MAX_ENQUEUE_ATTEMPTS,
    RabbitmqBroker,
    _RabbitmqConsumer,
    _RabbitmqMessage,
)
from dramatiq.common import current_millis, dq_name, q_name, xq_name
from dramatiq.errors import ConnectionClosed
from dramatiq.message import Message
from dramatiq.middleware import (
    AgeLimit,
    Callbacks,
    Pipelines,
    Retries,
    ShutdownNotifications,
    TimeLimit,
)

from pipeline.backoff import Backoff
from pipeline.config import Settings
from pipeline.transport.base import UndecodableSink

log = logging.getLogger("pipeline.transport.broker")

QUORUM = {"x-queue-type": "quorum"}


def _log_undecodable(queue_name: str, data: bytes, reason: str) -> None:
    log.error("dropped undecodable message", extra={"queue": queue_name, "reason": reason})


def physical_name(namespace: str, queue_name: str) -> str:
    """The server's name of a Dramatiq queue (``<namespace>.<queue>``)."""
    return f"{namespace}.{queue_name}"


def queue_arguments(namespace: str, canonical: str) -> dict[str, Any]:
    """The arguments of a consumer queue and its delay queue: quorum, rejects to ``.XQ``."""
    return {
        **QUORUM,
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": physical_name(namespace, xq_name(canonical)),
    }


def dead_queue_arguments() -> dict[str, Any]:
    """The arguments of a dead-letter queue: quorum, messages kept Dramatiq's dead TTL."""
    return {**QUORUM, "x-message-ttl": DEAD_MESSAGE_TTL}


class BrokerOutage:
    """A process's view of RabbitMQ being down: one log line per backoff step."""

    def __init__(self, first: float = 0.5, cap: float = 10.0) -> None:
        self._lock = threading.Lock()
        self._backoff = Backoff(first, cap)
        self._next_try = 0.0

    def failed(self, exc: BaseException) -> float:
        """Record a failure; the seconds to wait before the next try."""
        with self._lock:
            now = time.monotonic()
            if now < self._next_try:
                return self._next_try - now
            delay = self._backoff.next_delay()
            self._next_try = now + delay
        log.warning(
            f"RabbitMQ unreachable: {type(exc).__name__}: {exc}; next try in {delay:.1f}s",
            extra={"error_class": type(exc).__name__, "retry_in": delay},
        )
        return delay

    def succeeded(self) -> None:
        if not self._backoff.failures:
            return
        with self._lock:
            recovered = self._backoff.reset()
            self._next_try = 0.0
        if recovered:
            log.info("RabbitMQ reachable again: consuming")


class PipelineRabbitmqConsumer(_RabbitmqConsumer):
    """Dramatiq's RabbitMQ consumer: undecodable messages to the sink, then removed."""

    def __init__(self, broker: Any, queue_name: str, prefetch: int, timeout: int) -> None:
        self.logical_queue = queue_name
        try:
            super().__init__(  # type: ignore[no-untyped-call]
                broker, physical_name(broker.namespace, queue_name), prefetch, timeout
            )
        except ConnectionClosed as exc:
            broker.outage.failed(exc)
            raise
        broker.outage.succeeded()

    def __next__(self) -> Any:
        try:
            method, _properties, body = next(self.iterator)
            if method is None:
                return None
        except (
            AssertionError,
            pika.exceptions.AMQPConnectionError,
            pika.exceptions.AMQPChannelError,
        ) as exc:
            if getattr(exc, "reply_code", None) == 404:
                self.broker.queues_pending.add(q_name(self.logical_queue))
            self.broker.outage.failed(exc)
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        try:
            message = Message.decode(body)
        except Exception as exc:
            self._dead_letter_undecodable(method.delivery_tag, body, f"undecodable message: {exc}")
            return None
        proxy = _RabbitmqMessage(  # type: ignore[no-untyped-call]
            method.redelivered, method.delivery_tag, message
        )
        self.known_tags.add(method.delivery_tag)
        return proxy

    def _dead_letter_undecodable(self, tag: int, body: bytes, reason: str) -> None:
        """Hand the raw bytes to the sink, then acknowledge them (they can never run); if
        the sink fails, reject them so that RabbitMQ keeps them in ``<queue>.XQ``."""
        try:
            self.broker.undecodable_sink(self.logical_queue, body, reason)
        except Exception as exc:
            log.error(
                "could not dead-letter an undecodable message; RabbitMQ keeps it in the "
                "queue's dead-letter queue",
                extra={"queue": self.logical_queue, "error_class": type(exc).__name__},
            )
            self._nack(tag)  # type: ignore[no-untyped-call]
            return
        self.channel.basic_ack(tag)


class PipelineRabbitmqBroker(RabbitmqBroker):
    """See the module docstring."""

    undecodable_sink: UndecodableSink = staticmethod(_log_undecodable)

    def __init__(
        self,
        *,
        namespace: str,
        prefetch_max: int = 1000,
        outage_backoff_max: float = 10.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(confirm_delivery=True, max_priority=None, **kwargs)
        self.namespace = namespace
        self.prefetch_max = prefetch_max
        self.outage = BrokerOutage(cap=outage_backoff_max)

    @property
    def consumer_class(self) -> type[PipelineRabbitmqConsumer]:
        return PipelineRabbitmqConsumer

    def physical(self, queue_name: str) -> str:
        return physical_name(self.namespace, queue_name)

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> Any:
        """Dramatiq's consume, its prefetch bounded by ``PIPELINE_BROKER_PREFETCH_MAX``."""
        try:
            self.declare_queue(queue_name, ensure=True)
        except ConnectionClosed as exc:
            self.outage.failed(exc)
            raise
        return self.consumer_class(self, queue_name, min(prefetch, self.prefetch_max), timeout)

    def _build_queue_arguments(self, queue_name: str) -> dict[str, Any]:
        return queue_arguments(self.namespace, q_name(queue_name))

    def _declare_queue(self, queue_name: str) -> Any:
        return self.channel.queue_declare(
            queue=self.physical(queue_name),
            durable=True,
            arguments=self._build_queue_arguments(queue_name),
        )

    def _declare_dq_queue(self, queue_name: str) -> Any:
        return self.channel.queue_declare(
            queue=self.physical(dq_name(queue_name)),
            durable=True,
            arguments=self._build_queue_arguments(queue_name),
        )

    def _declare_xq_queue(self, queue_name: str) -> Any:
        return self.channel.queue_declare(
            queue=self.physical(xq_name(queue_name)),
            durable=True,
            arguments=dead_queue_arguments(),
        )

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Dramatiq's enqueue on the namespaced queue, waiting for the broker's confirm.

        A publish the broker refused (``basic.nack``: a queue at its length limit, no
        quorum) raises :class:`dramatiq.errors.ConnectionClosed` after Dramatiq's attempts.
        """
        canonical = message.queue_name
        queue_name = canonical
        if delay is not None:
            queue_name = dq_name(queue_name)
            message = message.copy(queue_name=queue_name, options={"eta": current_millis() + delay})
        attempts = 0
        while True:
            try:
                self.declare_queue(canonical, ensure=True)
                self.emit_before("enqueue", message, delay)
                self.channel.basic_publish(
                    exchange="",
                    routing_key=self.physical(queue_name),
                    body=message.encode(),
                    properties=pika.BasicProperties(delivery_mode=2, message_id=message.message_id),
                    mandatory=True,
                )
                self.emit_after("enqueue", message, delay)
                return message
            except (
                pika.exceptions.AMQPConnectionError,
                pika.exceptions.AMQPChannelError,
            ) as exc:
                del self.connection
                if isinstance(exc, pika.exceptions.UnroutableError):
                    self.queues_pending.add(q_name(queue_name))
                attempts += 1
                if attempts >= MAX_ENQUEUE_ATTEMPTS:
                    raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]

    def get_queue_message_counts(self, queue_name: str) -> tuple[int, int, int]:
        """Ready messages on the queue, its delay queue and its dead-letter queue."""
        return (
            self._declare_queue(queue_name).method.message_count,
            self._declare_dq_queue(queue_name).method.message_count,
            self._declare_xq_queue(queue_name).method.message_count,
        )

    def flush(self, queue_name: str) -> None:
        for name in (queue_name, dq_name(queue_name), xq_name(queue_name)):
            try:
                self.channel.queue_purge(self.physical(name))
            except pika.exceptions.AMQPChannelError:
                del self.channel


def make_broker(
    settings: Settings, middleware: list[Any] | None = None, *, timeout: float | None = None
) -> PipelineRabbitmqBroker:
    """A broker for the configured RabbitMQ (``amqp://``, ``amqps://`` TLS).

    The middleware stack is the Redis broker's (see
    :func:`pipeline.transport.redis.broker.make_broker` for why Retries is there).
    ``timeout`` bounds connecting and each blocked call (pika's ``socket_timeout`` and
    ``blocked_connection_timeout``); None leaves pika's defaults.
    """
    stack = (
        middleware
        if middleware is not None
        else [
            AgeLimit(),
            TimeLimit(),
            ShutdownNotifications(),
            Callbacks(),
            Pipelines(),
            Retries(),
        ]
    )
    parameters = connection_parameters(settings.require_broker_url(), timeout)
    return PipelineRabbitmqBroker(
        namespace=settings.redis_namespace,
        prefetch_max=settings.broker_prefetch_max,
        outage_backoff_max=settings.reconnect_backoff_max,
        middleware=stack,
        parameters=parameters,
    )


def connection_parameters(url: str, timeout: float | None) -> list[dict[str, Any]]:
    """pika connection parameters (as keywords) for each of the ``;``-separated URLs of
    ``url`` (a cluster's nodes: clients connect to the first that answers), with
    ``timeout`` if given."""
    return [_node_parameters(part.strip(), timeout) for part in url.split(";") if part.strip()]


def connect(url: str, timeout: float | None) -> pika.BlockingConnection:
    """A blocking connection to the first node of ``url`` that answers."""
    return pika.BlockingConnection(
        [pika.ConnectionParameters(**values) for values in connection_parameters(url, timeout)]
    )


def _node_parameters(url: str, timeout: float | None) -> dict[str, Any]:
    params = pika.URLParameters(url)
    values: dict[str, Any] = {
        "host": params.host,
        "port": params.port,
        "virtual_host": params.virtual_host,
        "credentials": params.credentials,
        "ssl_options": params.ssl_options,
        "heartbeat": params.heartbeat,
        "connection_attempts": params.connection_attempts,
        "retry_delay": params.retry_delay,
        "client_properties": {"connection_name": "pipeline"},
    }
    if timeout is not None:
        values["socket_timeout"] = timeout
        values["blocked_connection_timeout"] = timeout
        values["stack_timeout"] = timeout
    return values
