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
* a delayed message is held unacknowledged at most half the server's ``consumer_timeout``
  (``PIPELINE_BROKER_CONSUMER_TIMEOUT_MS``): one due later goes back to the delay queue
  until it is due within that (see :class:`PipelineRabbitmqConsumer`);
* a message no Dramatiq client could decode (or a foreign one) goes to
  :attr:`PipelineRabbitmqBroker.undecodable_sink` and is then acknowledged (removed);
  if the sink fails it is rejected, and RabbitMQ dead-letters it to ``<queue>.XQ``.

It overrides private methods of Dramatiq's broker and consumer (``_declare_*``,
``_build_queue_arguments``); Dramatiq is pinned to one minor series in pyproject.toml and
``tests/integration/test_amqp_transport.py`` declares real queues through them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from functools import partial
from queue import PriorityQueue
from typing import Any, NamedTuple

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
from dramatiq.worker import ConsumerThread

from pipeline.config import Settings
from pipeline.transport.base import UndecodableSink, worker_middleware
from pipeline.transport.outage import BrokerOutage

log = logging.getLogger("pipeline.transport.broker")
# pika logs every connection's steps at INFO and each failed one in a dozen ERROR lines
# with tracebacks; the pipeline reports every failure it sees in one line of its own.
logging.getLogger("pika").setLevel(logging.CRITICAL)

CLOSING_FAILED = "Encountered exception while closing"
"""How Dramatiq's RabbitMQ broker begins the line it logs, with a traceback, when closing a
thread's channel or connection raised."""


class QuietCloseFailures(logging.Filter):
    """Closing the channel and connection of a broker that went away fails by nature, and
    Dramatiq logs each failure at ERROR with a traceback (a relay dropping its connection
    at an outage printed one). The pipeline logs the outage itself once per backoff step,
    so such a line is kept only at DEBUG, on one line, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(CLOSING_FAILED):
            return True
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            record.msg = f"{record.getMessage()} {type(error).__name__}: {error}"
            record.args = ()
        record.exc_info = None
        record.exc_text = None
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


QUIET_CLOSE_FAILURES = QuietCloseFailures()

QUORUM = {"x-queue-type": "quorum"}
IDLE_RETURN_MS = 100
"""Longest an idle consumer goes without returning to Dramatiq's consumer thread, which
enqueues held delayed messages (retries waiting out their backoff) only between returns.
An idle return costs a loop in this process, not a round trip, so it stays short whatever
``worker_timeout`` is."""


CONSUMER_TIMEOUT_REPLY = "delivery acknowledgement on channel"
"""How RabbitMQ's reply text begins when it closed a channel (406 PRECONDITION_FAILED)
because one of its deliveries stayed unacknowledged past ``consumer_timeout``."""


REPARK_RETRY_SECONDS = 1.0
"""How soon a parked message whose publication to the delay queue failed is tried again."""


class Parked(NamedTuple):
    """A delayed message due after the consumer may hold it: held until ``release``
    (monotonic seconds), then published to the delay queue again and acknowledged. Past
    ``expires`` the server's ``consumer_timeout`` has closed the channel holding it (and
    given it back), so it is no longer this consumer's to publish."""

    release: float
    tag: int
    message: Message[Any]
    expires: float


def is_consumer_timeout(exc: BaseException) -> bool:
    """Whether RabbitMQ closed the channel over a delivery held past ``consumer_timeout``."""
    return getattr(exc, "reply_code", None) == 406 and CONSUMER_TIMEOUT_REPLY in str(
        getattr(exc, "reply_text", "")
    )


def _log_undecodable(queue_name: str, data: bytes, reason: str) -> None:
    log.error("dropped undecodable message", extra={"queue": queue_name, "reason": reason})


def physical_name(namespace: str, queue_name: str) -> str:
    """The server's name of a Dramatiq queue (``<namespace>.<queue>``)."""
    return f"{namespace}.{queue_name}"


def is_dead_letter_queue(name: str) -> bool:
    """Whether a server queue name is a Dramatiq dead-letter queue (``<queue>.XQ``)."""
    return name.endswith(xq_name(""))


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


class PipelineRabbitmqConsumer(_RabbitmqConsumer):
    """Dramatiq's RabbitMQ consumer, waiting out an outage instead of raising to Dramatiq.

    Dramatiq's consumer raises on a lost connection, and each of a worker's consumer
    threads then logs a critical error and restarts every three seconds. This one drops
    the lost connection, waits out the broker's :class:`BrokerOutage` (one log line per
    backoff step for the whole process) and connects again, returning no message
    meanwhile. Deliveries of a lost connection are given back by RabbitMQ and delivered
    again; their acknowledgements are skipped (each delivery is known by its connection's
    generation and its tag, so a tag reused by the new channel is never acknowledged by
    mistake). Undecodable messages go to the sink, then are acknowledged.

    RabbitMQ closes a channel whose delivery stays unacknowledged past its
    ``consumer_timeout``, and Dramatiq holds a delayed message unacknowledged until due. So
    a delayed message due later than the broker's ``hold_limit_ms`` from its delivery is
    not handed to Dramatiq: this consumer holds it ``hold_limit_ms``, publishes it to the
    delay queue again (its eta unchanged, confirmed) and acknowledges it, until it is due
    within the limit. Should the channel close anyway (a server's ``consumer_timeout``
    below ``PIPELINE_BROKER_CONSUMER_TIMEOUT_MS``), the consumer thread's held delayed
    messages are forgotten, as Dramatiq does on a connection error: RabbitMQ gives them
    back, and holding the stale copies too would run each once per closed channel.
    """

    def __init__(self, broker: Any, queue_name: str, prefetch: int, timeout: int) -> None:
        # Dramatiq's __init__ connects (and raises); this one connects on first use.
        self.broker = broker
        self.logical_queue = queue_name
        self.queue_name = physical_name(broker.namespace, queue_name)
        self.prefetch = prefetch
        self.timeout = timeout
        self.logger = log
        self.generation = 0
        self.known_tags: set[Any] = set()
        self.connection: Any = None
        self.channel: Any = None
        self.iterator: Any = None
        self.hold_limit_ms: int | None = getattr(broker, "hold_limit_ms", None)
        self.parked: deque[Parked] = deque()

    def _connect(self) -> None:
        self.broker.declare_queue(self.logical_queue, ensure=True)
        connection = pika.BlockingConnection(parameters=self.broker.parameters)
        try:
            channel = connection.channel()
            channel.basic_qos(prefetch_count=self.prefetch)
            iterator = channel.consume(
                self.queue_name, inactivity_timeout=min(self.timeout, IDLE_RETURN_MS) / 1000
            )
        except BaseException:
            with contextlib.suppress(Exception):
                connection.close()
            raise
        self.generation += 1
        self.known_tags = set()
        self.connection, self.channel, self.iterator = connection, channel, iterator

    def _drop(self) -> None:
        connection = self.connection
        self.connection = self.channel = self.iterator = None
        self.known_tags = set()
        self.parked.clear()
        if connection is not None and connection.is_open:
            with contextlib.suppress(Exception):
                connection.close()

    def __next__(self) -> Any:
        outage: BrokerOutage = self.broker.outage
        if self.iterator is None:
            pause = outage.pause()
            if pause:  # short naps: the consumer thread must see a stop request promptly
                time.sleep(min(pause, self.timeout / 1000))
                return None
            try:
                self._connect()
            except (pika.exceptions.AMQPError, ConnectionClosed, OSError) as exc:
                outage.failed(exc)
                self._drop()
                return None
            outage.succeeded()
        try:
            self._release_parked()
            method, _properties, body = next(self.iterator)
        except (
            AssertionError,
            pika.exceptions.AMQPConnectionError,
            pika.exceptions.AMQPChannelError,
            OSError,
        ) as exc:
            if getattr(exc, "reply_code", None) == 404:
                self.broker.queues_pending.add(q_name(self.logical_queue))
            if is_consumer_timeout(exc):
                log.warning(
                    "RabbitMQ closed a channel holding a delivery past its consumer_timeout "
                    "(set PIPELINE_BROKER_CONSUMER_TIMEOUT_MS to the server's); its "
                    "unacknowledged messages are delivered again",
                    extra={"queue": self.logical_queue, "error_class": type(exc).__name__},
                )
            else:
                outage.failed(exc)
            self._drop()
            self._forget_held_delays()
            return None
        if method is None:
            return None
        try:
            message = Message.decode(body)
        except Exception as exc:
            self._dead_letter_undecodable(method.delivery_tag, body, f"undecodable message: {exc}")
            return None
        if self._park(method.delivery_tag, message):
            return None
        key = (self.generation, method.delivery_tag)
        proxy = _RabbitmqMessage(method.redelivered, key, message)  # type: ignore[no-untyped-call]
        self.known_tags.add(key)
        return proxy

    def _park(self, tag: int, message: Message[Any]) -> bool:
        """Keep a delayed message due after the hold limit from Dramatiq (see the class)."""
        eta = message.options.get("eta")
        if self.hold_limit_ms is None or not isinstance(eta, (int, float)):
            return False
        if eta - current_millis() <= self.hold_limit_ms:
            return False
        now, hold = time.monotonic(), self.hold_limit_ms / 1000
        self.parked.append(Parked(now + hold, tag, message, now + 2 * hold))
        log.debug(
            "holding a delayed message due later than the hold limit",
            extra={"queue": self.logical_queue, "hold_seconds": hold},
        )
        return True

    def _release_parked(self) -> None:
        """Publish each parked message whose hold is up to the delay queue again (confirmed),
        then acknowledge its delivery. Deliveries arrive in order, so the parked are in
        order of release. A publish that fails keeps the message parked and tries again
        :data:`REPARK_RETRY_SECONDS` later, its delivery unacknowledged meanwhile, until the
        server's ``consumer_timeout`` (twice the hold) would have closed the channel and
        given the message back: then it is let go, as a channel that closed lets it go.
        (Let go at the first failure, it waited for the channel to close: up to the whole
        ``consumer_timeout``, 30 minutes by default, with its retry not run.)"""
        while self.parked and self.parked[0].release <= time.monotonic():
            parked = self.parked[0]
            try:
                self.broker.republish_delayed(parked.message)
            except ConnectionClosed as exc:
                now = time.monotonic()  # the failed attempts may have taken a while
                expired = now + REPARK_RETRY_SECONDS >= parked.expires
                log.warning(
                    "could not hold a delayed message on the delay queue; "
                    + ("RabbitMQ delivers it again" if expired else "trying again"),
                    extra={
                        "queue": self.logical_queue,
                        "error_class": type(exc).__name__,
                        **({} if expired else {"retry_in": REPARK_RETRY_SECONDS}),
                    },
                )
                if expired:
                    self.parked.popleft()
                else:
                    self.parked[0] = Parked(
                        now + REPARK_RETRY_SECONDS, parked.tag, parked.message, parked.expires
                    )
                return
            self.parked.popleft()
            self.channel.basic_ack(parked.tag)

    def _forget_held_delays(self) -> None:
        """Empty the calling consumer thread's held delayed messages: their deliveries died
        with the connection and RabbitMQ gives them back (Dramatiq does the same when its
        own consumer raises a connection error)."""
        thread = threading.current_thread()
        if isinstance(thread, ConsumerThread):
            thread.delay_queue = PriorityQueue()

    def ack(self, message: Any) -> None:
        self._settle(message, acked=True)

    def nack(self, message: Any) -> None:
        """Reject without requeueing: RabbitMQ dead-letters it to ``<queue>.XQ``."""
        self._settle(message, acked=False)

    def _settle(self, message: Any, *, acked: bool) -> None:
        key = message._tag
        if key not in self.known_tags or self.connection is None:
            return  # delivered on a connection since lost: RabbitMQ delivers it again
        self.known_tags.discard(key)
        channel = self.channel
        settle = (
            partial(channel.basic_ack, key[1])
            if acked
            else partial(channel.basic_nack, key[1], requeue=False)
        )
        try:
            self.connection.add_callback_threadsafe(settle)
        except (pika.exceptions.AMQPError, OSError) as exc:
            log.warning(
                "could not settle a message; RabbitMQ delivers it again",
                extra={"queue": self.logical_queue, "error_class": type(exc).__name__},
            )

    def requeue(self, messages: Any) -> None:
        """RabbitMQ gives unacknowledged messages back when the connection closes."""

    def close(self) -> None:
        self._drop()

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
            self.channel.basic_nack(tag, requeue=False)
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
        hold_limit_ms: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(confirm_delivery=True, max_priority=None, **kwargs)
        self.logger.addFilter(QUIET_CLOSE_FAILURES)  # once: the logger is Dramatiq's, shared
        self.namespace = namespace
        self.prefetch_max = prefetch_max
        self.hold_limit_ms = hold_limit_ms
        self.outage = BrokerOutage("RabbitMQ", cap=outage_backoff_max)

    @property
    def consumer_class(self) -> type[PipelineRabbitmqConsumer]:
        return PipelineRabbitmqConsumer

    def physical(self, queue_name: str) -> str:
        return physical_name(self.namespace, queue_name)

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> Any:
        """Dramatiq's consume, its prefetch bounded by ``PIPELINE_BROKER_PREFETCH_MAX``."""
        self.declare_queue(queue_name)  # on the server when the consumer connects
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
        self._publish(canonical, queue_name, message, delay, emit=True)
        return message

    def republish_delayed(self, message: Message[Any]) -> None:
        """Publish a message taken from a delay queue to it again, unchanged (its eta too),
        waiting for the confirm; no enqueue hooks run (it is the same message, held on)."""
        canonical = q_name(message.queue_name)
        self._publish(canonical, dq_name(canonical), message, None, emit=False)

    def _publish(
        self,
        canonical: str,
        queue_name: str,
        message: Message[Any],
        delay: int | None,
        *,
        emit: bool,
    ) -> None:
        attempts = 0
        while True:
            try:
                self.declare_queue(canonical, ensure=True)
                if emit:
                    self.emit_before("enqueue", message, delay)
                self.channel.basic_publish(
                    exchange="",
                    routing_key=self.physical(queue_name),
                    body=message.encode(),
                    properties=pika.BasicProperties(delivery_mode=2, message_id=message.message_id),
                    mandatory=True,
                )
                if emit:
                    self.emit_after("enqueue", message, delay)
                return
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
    ``blocked_connection_timeout``); None leaves pika's defaults. Consumers hold a delayed
    message at most half ``PIPELINE_BROKER_CONSUMER_TIMEOUT_MS``: RabbitMQ checks the
    timeout only on its channel tick, so the margin keeps well clear of it.
    """
    stack = middleware if middleware is not None else worker_middleware()
    parameters = connection_parameters(settings.require_broker_url(), timeout)
    return PipelineRabbitmqBroker(
        namespace=settings.redis_namespace,
        prefetch_max=settings.broker_prefetch_max,
        outage_backoff_max=settings.reconnect_backoff_max,
        hold_limit_ms=settings.broker_consumer_timeout_ms // 2,
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
