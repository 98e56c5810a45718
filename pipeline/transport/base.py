"""The seam between the pipeline and its message broker: what the relay, the inbox and the
tools may ask of a transport, and nothing of how it does it.

A transport is one broker reached through Dramatiq: workers consume from its Dramatiq
broker (the inbox and publishing actors are declared on it), the relay publishes batches
through its :class:`~pipeline.transport.publisher.Publisher`, and operators read its queue
depths. Everything broker-specific (key layouts, message encoding, private Dramatiq
classes) stays inside the implementation's package; :mod:`pipeline.transport.factory`
picks the implementation from the URL scheme.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dramatiq.common import dq_name

from pipeline.config import Settings
from pipeline.errors import PublisherUnavailable
from pipeline.transport.publisher import Publisher

UndecodableSink = Callable[[str, bytes, str], None]
"""Called with (queue name, raw message bytes, reason) for a message nobody can decode."""

MissingBodySink = Callable[[str, int, int], None]
"""Called with (queue name, absorbed duplicates, lost deliveries) when a consumer fetched
message ids whose bodies are gone: ids of messages already acknowledged (a duplicate left
on the queue, dropped) and ids whose body vanished before any consumer ran it (a lost
delivery: the relay's delivery ledger sends it again)."""


@dataclass
class QueueDepth:
    """Messages (each a run of events) waiting, delayed, and dead on one queue."""

    ready: int = 0
    delayed: int = 0
    dead: int = 0


@dataclass
class BrokerFinding:
    """One check of the broker for ``pipeline doctor``: ``ok``, ``info`` (a fact to know) or
    ``problem`` (with its fix)."""

    check: str
    status: Literal["ok", "info", "problem"]
    summary: str
    fix: str = ""


@dataclass
class BrokerDiagnosis:
    """What :meth:`Transport.diagnose` found, and the measured round trip (None: unreachable)."""

    findings: list[BrokerFinding] = field(default_factory=list)
    round_trip: float | None = None

    def add(
        self, check: str, status: Literal["ok", "info", "problem"], summary: str, fix: str = ""
    ) -> None:
        self.findings.append(BrokerFinding(check, status, summary, fix))


def delay_queue_name(queue_name: str) -> str:
    """The name of a queue's delayed messages (``<queue>.DQ`` on every Dramatiq broker).

    Workers accept it in ``--queues``, and ``pipeline_queue_depth`` labels delayed
    messages with it.
    """
    name: str = dq_name(queue_name)
    return name


class Slots(ABC):
    """A bounded set of leases shared by all processes: at most ``capacity`` held at once.

    The relay holds one per publishing actor in flight; an expired lease (its holder
    died) frees its slot.
    """

    @abstractmethod
    def acquire(self, candidates: Sequence[str], capacity: int, ttl: float) -> list[str]:
        """Take as many of ``candidates`` as there are free slots, each for ``ttl`` seconds.

        A transport failure raises :class:`~pipeline.errors.PublisherUnavailable`.
        """

    @abstractmethod
    def extend(self, slot: str, ttl: float) -> None:
        """Hold ``slot`` for ``ttl`` seconds from now (driver failures propagate: the
        holder fails, and the slot expires)."""

    @abstractmethod
    def release(self, slot: str) -> None:
        """Free ``slot`` now (driver failures propagate, as for :meth:`extend`)."""


class Transport(ABC):
    """One message broker behind the pipeline, built from settings by
    :func:`pipeline.transport.factory.open_transport`.

    Its :attr:`broker` is a Dramatiq broker: the runtime declares actors on it and
    ``dramatiq`` workers consume from it. The methods are what the pipeline needs beside
    Dramatiq's public API.
    """

    broker: Any
    """The Dramatiq broker (consume side, and the send side of actors)."""

    def __init__(
        self,
        settings: Settings,
        middleware: list[Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        """Build the broker (connecting nothing yet) with ``middleware`` (None: the workers'
        Dramatiq stack; ``[]`` for a process that only publishes or reads queue depths).
        ``timeout`` bounds each call to the broker (None: block, as relays and workers do).
        """
        self.settings = settings
        self.broker = self.build_broker(middleware, timeout)

    @abstractmethod
    def build_broker(self, middleware: list[Any] | None, timeout: float | None) -> Any:
        """The Dramatiq broker for :attr:`settings`, as :meth:`__init__` describes it."""

    @abstractmethod
    def publisher(self, source: str) -> Publisher:
        """The relay's batch publisher on this transport (``source``: CloudEvents source)."""

    @abstractmethod
    def publisher_slots(self, name: str, queue: str | None = None) -> Slots:
        """The shared slot set called ``name`` (bounds the publishing actors in flight);
        ``queue`` is the queue its holders are sent to (a transport without a shared lease
        set may bound the slots by that queue's depth)."""

    @abstractmethod
    def as_unavailable(self, exc: BaseException) -> PublisherUnavailable | None:
        """The :class:`~pipeline.errors.PublisherUnavailable` that ``exc``, raised by the
        broker (an actor's ``send``), stands for; None if it is not a transport failure."""

    @abstractmethod
    def on_undecodable(self, sink: UndecodableSink) -> None:
        """Hand ``sink`` the raw bytes of every message a consumer cannot decode; the
        transport removes them after the sink returns (a consume-stage dead letter)."""

    def on_missing_body(self, sink: MissingBodySink) -> None:  # noqa: B027 - optional hook
        """Tell ``sink`` about message ids found without a body (:data:`MissingBodySink`);
        the transport drops them after the sink returns (they carry nothing to run). A
        broker that keeps ids and bodies together (RabbitMQ) never has any: nothing to do."""

    @abstractmethod
    def queue_depths(self, queues: Iterable[str]) -> dict[str, QueueDepth]:
        """Ready, delayed and dead messages of each queue, in one round trip.

        A transport failure raises :class:`~pipeline.errors.ServiceUnavailableError`.
        """

    @abstractmethod
    def queues_holding_messages(self) -> set[str]:
        """The queues that hold any message now (ready, delayed or dead), for operators.

        A transport failure raises :class:`~pipeline.errors.ServiceUnavailableError`.
        """

    @classmethod
    @abstractmethod
    def diagnose(cls, settings: Settings, longest_hold_ms: int) -> BrokerDiagnosis:
        """The broker's checks for ``pipeline doctor`` (reachability, then what silently
        loses or stalls messages on it). ``longest_hold_ms``: the longest a worker may hold
        one message before acknowledging it (the longest handler time limit, or delay)."""

    @classmethod
    @abstractmethod
    def problem(cls, settings: Settings) -> str | None:
        """Why the broker cannot be used yet (one line, no secrets), or None when it answers."""

    @classmethod
    @abstractmethod
    def delete_namespace(cls, url: str, namespace: str, management_url: str | None = None) -> None:
        """Delete everything this transport keeps under ``namespace`` (demo, drill, tests);
        ``management_url``: RabbitMQ's management API when not on the broker's host and port
        15672 (``PIPELINE_BROKER_MANAGEMENT_URL``)."""

    def close(self) -> None:
        """Close the broker's connections."""
        self.broker.close()


def worker_middleware() -> list[Any]:
    """The Dramatiq middleware stack of a worker's broker, whichever the transport.

    Retries sends a message whose actor raised back to its queue with exponential backoff
    (without it, Dramatiq 2 acknowledges the message and it is gone); handler errors never
    reach it, so what it retries is an infrastructure failure.
    """
    from dramatiq.middleware import (
        AgeLimit,
        Callbacks,
        Pipelines,
        Retries,
        ShutdownNotifications,
        TimeLimit,
    )

    return [AgeLimit(), TimeLimit(), ShutdownNotifications(), Callbacks(), Pipelines(), Retries()]
