"""Tracing port: OpenTelemetry spans following the messaging semantic conventions.

One workflow is one trace::

    app span ─▶ create order.placed (PRODUCER, context stored in the outbox row)
                   ├─▶ send pipeline.billing (CLIENT, one per delivery, a link to each
                   │        event's creation context; a root when its events span traces)
                   ▼
                process order.placed (CONSUMER, parented on the creation context)
                   └─▶ create order.paid (follow-up event) ─▶ …

Span kinds follow the conventions' table: ``create`` is the PRODUCER span whose
context travels with the message; a ``send`` span whose context is *not* the
creation context is a CLIENT span (so producer→consumer edges in trace tools always
join a PRODUCER to a CONSUMER span); ``process`` is a CONSUMER span.

The creation context travels as W3C ``traceparent``/``tracestate`` (the CloudEvents
distributed-tracing extension), whatever global propagator the application set.

Spans are started through the OpenTelemetry API only (``trace.get_tracer("pipeline")``),
so they are the installed provider's: the SDK's when the application or
:func:`configure_tracing` installed it, no-ops when nothing is installed. Without a
provider an event created outside any trace still gets a creation context of its own
(fresh random ids, sampled as the ``OTEL_TRACES_SAMPLER`` sampler would sample a new
trace), so the relay, the consumers and the follow-up events share its trace id.
Payloads never become attributes, and neither do exception messages: errors are
recorded by class only.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import Token
from typing import TYPE_CHECKING

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, TraceState

from pipeline.config import Settings
from pipeline.errors import ConfigurationError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.sdk.trace.sampling import Sampler

    from pipeline.envelope import OutboxEvent, ReceivedEvent

log = logging.getLogger("pipeline.tracing")

TRACER_NAME = "pipeline"
MESSAGING_SYSTEM = "dramatiq"
SEND_SPAN_KIND = SpanKind.CLIENT  # the send span's context is not the creation context

# Attribute names (OpenTelemetry messaging semantic conventions, plus pipeline.*).
SYSTEM = "messaging.system"
OPERATION_TYPE = "messaging.operation.type"
OPERATION_NAME = "messaging.operation.name"
DESTINATION = "messaging.destination.name"
MESSAGE_ID = "messaging.message.id"
CONVERSATION_ID = "messaging.message.conversation_id"
BATCH_COUNT = "messaging.batch.message_count"
CONSUMER_GROUP = "messaging.consumer.group.name"
ERROR_TYPE = "error.type"
ATTEMPT = "pipeline.attempt"
DUPLICATE = "pipeline.duplicate"
DEAD_LETTERED = "pipeline.dead_lettered"


@functools.cache
def _tracer() -> trace.Tracer:
    # The SDK builds a new Tracer per get_tracer call (tens of microseconds); the API's
    # proxy tracer resolves to whatever provider is installed, even one installed later.
    return trace.get_tracer(TRACER_NAME)


def _sdk_installed() -> bool:
    """Whether some provider is installed (else the pipeline's spans are no-ops)."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def _sdk_disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def span_headers(span: Span) -> dict[str, str]:
    """The W3C ``traceparent`` (and ``tracestate``) of ``span``; empty for an invalid span."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return {}
    # Formatted here rather than through a propagator: it runs once per produced event.
    headers = {"traceparent": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"}
    if ctx.trace_state:
        headers["tracestate"] = ctx.trace_state.to_header()
    return headers


# W3C trace-context ``traceparent``: what OpenTelemetry's propagator accepts, parsed here
# because it runs once per handled event (the propagator's carrier plumbing costs more).
_TRACEPARENT = re.compile(
    r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$"
)
TRACEPARENT_MAX_LENGTH = 512
TRACESTATE_MAX_LENGTH = 8192


def remote_span_context(
    traceparent: str | None, tracestate: str | None = None
) -> trace.SpanContext | None:
    """The remote span context a ``traceparent`` names, or ``None`` for none (or junk)."""
    if not traceparent or len(traceparent) > TRACEPARENT_MAX_LENGTH:
        return None
    match = _TRACEPARENT.match(traceparent)
    if match is None:
        return None
    version, trace_hex, span_hex, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return trace.SpanContext(
        trace_id,
        span_id,
        is_remote=True,
        trace_flags=trace.TraceFlags(int(flags, 16)),
        trace_state=(
            TraceState.from_header([tracestate])
            if tracestate and len(tracestate) <= TRACESTATE_MAX_LENGTH
            else None
        ),
    )


def extract_context(
    traceparent: str | None, tracestate: str | None = None
) -> otel_context.Context | None:
    """The remote context stored with a message, or ``None`` when it carries none (or junk)."""
    span_context = remote_span_context(traceparent, tracestate)
    return None if span_context is None else _remote_parent(span_context)


def _remote_parent(span_context: trace.SpanContext) -> otel_context.Context:
    """A context holding only ``span_context``, for parenting a span on a stored context."""
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context), otel_context.Context())


def headers_span_context(headers: Mapping[str, str]) -> trace.SpanContext | None:
    """The creation span context stored in an outbox row's headers, if valid."""
    return remote_span_context(headers.get("traceparent"), headers.get("tracestate"))


# -- producer ------------------------------------------------------------------------------


@contextmanager
def create_span(
    event_type: str,
    event_id: uuid.UUID | str,
    *,
    parent: otel_context.Context | None = None,
    correlation_id: str | None = None,
) -> Iterator[Span]:
    """A PRODUCER span ``create <event_type>`` for one event; inject *its* context.

    The span is not made current (nothing runs inside it but building the row); use
    :func:`span_headers` on the yielded span for the row's ``traceparent``. ``parent``
    defaults to the current context, e.g. the application's request span.
    """
    span = start_create_span(event_type, event_id, parent=parent, correlation_id=correlation_id)
    try:
        yield span
    finally:
        span.end()


def start_create_span(
    event_type: str,
    event_id: uuid.UUID | str,
    *,
    parent: otel_context.Context | None = None,
    correlation_id: str | None = None,
) -> Span:
    """:func:`create_span` without the context manager (the caller ends the span).

    Without a provider and outside any trace, the span is a non-recording one with a
    new trace of its own (see :class:`_NewTraces`), unless ``OTEL_SDK_DISABLED`` is true.
    """
    name = f"create {event_type}"
    attributes: dict[str, str | int] = {
        SYSTEM: MESSAGING_SYSTEM,
        OPERATION_TYPE: "create",
        OPERATION_NAME: "create",
        DESTINATION: event_type,
        MESSAGE_ID: str(event_id),
    }
    if correlation_id is not None:
        attributes[CONVERSATION_ID] = correlation_id
    span = _tracer().start_span(
        name,
        parent,
        SpanKind.PRODUCER,
        attributes,
        record_exception=False,
        set_status_on_exception=False,
    )
    if span.get_span_context().is_valid:
        return span
    new_traces = _new_traces()
    if new_traces is None:  # tracing is disabled: the event carries no context
        return span
    return trace.NonRecordingSpan(new_traces.root(name, attributes))


class _NewTraces:
    """Creation contexts for events made outside any trace while no provider is installed.

    The pipeline's own processes then continue a trace the producer never recorded:
    the relay, every consumer and the follow-up events share its trace id, and its
    sampled flag is what a sampler would decide for a new trace, so that head sampling
    downstream keeps or drops the whole workflow. Ids and flags are made as the SDK's
    tracer makes them for a root span.
    """

    def __init__(self, sampler: Sampler, ids: IdGenerator) -> None:
        from opentelemetry.sdk.trace.sampling import Decision

        self.sampler = sampler
        self.ids = ids
        self.sampled = Decision.RECORD_AND_SAMPLE  # the one decision that samples
        self.no_parent = otel_context.Context()  # empty: the sampler sees a root

    def root(self, name: str, attributes: Mapping[str, str | int]) -> trace.SpanContext:
        trace_id = self.ids.generate_trace_id()
        result = self.sampler.should_sample(
            self.no_parent, trace_id, name, SpanKind.PRODUCER, attributes
        )
        flags = trace.TraceFlags.SAMPLED if result.decision is self.sampled else 0
        if self.ids.is_trace_id_random():
            flags |= trace.TraceFlags.RANDOM_TRACE_ID
        return trace.SpanContext(
            trace_id,
            self.ids.generate_span_id(),
            is_remote=False,
            trace_flags=trace.TraceFlags(flags),
            trace_state=result.trace_state,
        )


@functools.cache
def _new_traces() -> _NewTraces | None:
    """The SDK's sampler from ``OTEL_TRACES_SAMPLER``/``_ARG`` (read once, as the SDK does).

    Its default, ``parentbased_always_on``, samples every new trace. ``None`` when
    ``OTEL_SDK_DISABLED`` is true. The sampler is taken from an SDK provider that is
    never installed, which is how the SDK's public API builds it from the environment.
    """
    if _sdk_disabled():
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    unused = TracerProvider(resource=Resource.get_empty(), shutdown_on_exit=False)
    return _NewTraces(unused.sampler, unused.id_generator)


# -- relay ---------------------------------------------------------------------------------


@contextmanager
def send_span(destination: str, events: Sequence[OutboxEvent]) -> Iterator[Span]:
    """One ``send <destination>`` span per delivery, linked to each event's creation context.

    ``messaging.batch.message_count`` is the number of events (set even for one event,
    since a delivery is a batch operation), and each link carries the event's
    ``messaging.message.id``. Events without a stored context get no link. The span is
    not made current. When all its events belong to one trace it is parented in that
    trace (on the first event's creation context); otherwise it is a root. Raising inside
    marks it failed; :func:`record_send_outcome` does the same for an outcome the
    publisher returned instead of raising. Without a provider nothing is started: a send
    span parents nothing, so a no-op one would carry nothing anywhere.
    """
    if not _sdk_installed():
        yield trace.INVALID_SPAN
        return
    created = _creation_contexts(events)
    attributes: dict[str, str | int] = {
        SYSTEM: MESSAGING_SYSTEM,
        OPERATION_TYPE: "send",
        OPERATION_NAME: "send",
        DESTINATION: destination,
        BATCH_COUNT: len(events),
    }
    links = [Link(context, {MESSAGE_ID: str(event_id)}) for event_id, context in created]
    span = _tracer().start_span(
        f"send {destination}",
        _single_trace_parent([context for _, context in created]),
        SEND_SPAN_KIND,
        attributes,
        links,
        record_exception=False,
        set_status_on_exception=False,
    )
    yield from _ended_on_exit(span)


def record_send_outcome(span: Span, outcome: BaseException | None) -> None:
    """Mark a send span failed when the broker refused its delivery."""
    if outcome is not None:
        _fail(span, outcome)


def _single_trace_parent(created: Sequence[trace.SpanContext]) -> otel_context.Context:
    """Parent a delivery in its events' trace when they all share one; else make it a root.

    A delivery of one workflow's events then appears inside that workflow's trace, while
    a batch mixing traces cannot belong to any one of them and relies on its links.
    """
    traces = {context.trace_id for context in created}
    if len(created) == 0 or len(traces) != 1:
        return otel_context.Context()
    return _remote_parent(created[0])


def _creation_contexts(events: Sequence[OutboxEvent]) -> list[tuple[uuid.UUID, trace.SpanContext]]:
    """Each event's id and stored creation context (events without a valid one are left out)."""
    created: list[tuple[uuid.UUID, trace.SpanContext]] = []
    for event in events:
        try:
            headers = event.headers
        except ValueError:
            continue
        span_context = headers_span_context(headers)
        if span_context is not None:
            created.append((event.id, span_context))
    return created


# -- consumer ------------------------------------------------------------------------------


@contextmanager
def process_span(event: ReceivedEvent, consumer: str, attempt: int) -> Iterator[Span]:
    """The CONSUMER span ``process <event.type>`` around one handler run, made current.

    Its parent is the event's creation context (so producer, consumer and any
    follow-up events form one trace); without one it continues the current context.
    Being current, it parents the handler's own spans, follow-up ``create`` spans and
    log lines. An exception escaping the block marks the span failed (by class only)
    and propagates. Without a provider only the creation context is made current, so
    follow-up events still carry it. It runs once per handled event, so it calls
    ``start_span`` and attaches the context itself rather than through the layered
    context managers of ``start_as_current_span``.
    """
    parent = remote_span_context(event.traceparent, event.tracestate)
    if not _sdk_installed():  # nothing is recorded, the context still travels
        current = trace.get_current_span().get_span_context()
        span: Span = trace.NonRecordingSpan(parent if parent is not None else current)
    else:
        attributes: dict[str, str | int] = {
            SYSTEM: MESSAGING_SYSTEM,
            OPERATION_TYPE: "process",
            OPERATION_NAME: "process",
            DESTINATION: event.type,
            MESSAGE_ID: str(event.id),
            CONSUMER_GROUP: consumer,
            ATTEMPT: attempt,
        }
        if event.correlation_id is not None:
            attributes[CONVERSATION_ID] = event.correlation_id
        span = _tracer().start_span(
            f"process {event.type}",
            None if parent is None else _remote_parent(parent),
            SpanKind.CONSUMER,
            attributes,
            record_exception=False,  # failures are marked by class only (_fail)
            set_status_on_exception=False,
        )
    yield from _ended_on_exit(span, otel_context.attach(trace.set_span_in_context(span)))


def _ended_on_exit(span: Span, token: Token[otel_context.Context] | None = None) -> Iterator[Span]:
    """Yield ``span``; an exception marks it failed (by class) and propagates; then end it.

    ``token`` is the attach that made the span current: it is detached first, in the order
    ``start_as_current_span`` uses. Delegated to with ``yield from`` (no extra context
    manager layer on the per-event path).
    """
    try:
        yield span
    except BaseException as exc:
        _fail(span, exc)
        raise
    finally:
        if token is not None:
            otel_context.detach(token)
        span.end()


def mark_duplicate(span: Span) -> None:
    """The inbox already had this (consumer, event): the handler did not run."""
    span.set_attribute(DUPLICATE, True)
    span.add_event("pipeline.duplicate")


def record_retry(span: Span, exc: BaseException, delay: float) -> None:
    """The handler failed and will run again after ``delay`` seconds."""
    span.add_event(
        "pipeline.retry",
        {ERROR_TYPE: type(exc).__name__, "pipeline.retry.delay_seconds": float(delay)},
    )
    _fail(span, exc)


def record_dead_letter(span: Span, reason: str) -> None:
    """The event was dead-lettered for this consumer (``reason`` is the pipeline's own text)."""
    span.set_attribute(DEAD_LETTERED, True)
    span.add_event("pipeline.dead_letter", {"pipeline.dead_letter.reason": reason})
    span.set_status(Status(StatusCode.ERROR, "dead-lettered"))


def _fail(span: Span, exc: BaseException) -> None:
    name = type(exc).__name__
    span.set_attribute(ERROR_TYPE, name)
    span.set_status(Status(StatusCode.ERROR, name))


# -- set-up --------------------------------------------------------------------------------

_configure_lock = threading.Lock()
_configured: trace.TracerProvider | None = None
_installed: TracerProvider | None = None  # the provider configure_tracing installed itself
EXPORTERS = frozenset({"otlp", "console", "none"})


def configure_tracing(settings: Settings, service_name: str) -> trace.TracerProvider | None:
    """Install an SDK ``TracerProvider`` for a pipeline process, from ``OTEL_*`` variables.

    ``OTEL_TRACES_EXPORTER``: ``otlp`` (the official OTLP/HTTP protobuf exporter, which
    reads ``OTEL_EXPORTER_OTLP_*``), ``console``, or ``none`` (the default). With no
    exporter nothing is installed, since nothing would read a span: the pipeline's spans
    stay no-ops and events still carry a trace context. ``OTEL_SDK_DISABLED=true`` leaves
    tracing off; ``OTEL_SERVICE_NAME`` overrides ``service_name``; the SDK reads
    ``OTEL_TRACES_SAMPLER``/``_ARG`` and ``OTEL_BSP_*`` itself. Idempotent, and a provider
    the application installed first is used as it is. Returns the active provider
    (``None`` when none is installed).
    """
    global _configured, _installed  # noqa: PLW0603
    with _configure_lock:
        if _configured is not None:
            return _configured
        if _sdk_disabled():
            return None
        current = trace.get_tracer_provider()
        if not isinstance(current, trace.ProxyTracerProvider):
            _configured = current  # the application configured tracing already
            return current
        exporters = [_exporter(name) for name in _exporter_names()]
        if not exporters:
            log.debug("tracing: no exporter, no provider installed")
            return None
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        attributes: dict[str, str] = {"pipeline.schema": settings.schema_name}
        if not os.environ.get("OTEL_SERVICE_NAME"):
            attributes[SERVICE_NAME] = service_name
        provider = TracerProvider(resource=Resource.create(attributes))
        for exporter in exporters:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        _configured = _installed = provider
        log.debug("tracing configured", extra={"exporters": len(exporters)})
        return provider


def shutdown_tracing() -> None:
    """Flush and stop the provider :func:`configure_tracing` installed (safe to repeat).

    A provider the application installed is the application's to shut down.
    """
    if _installed is not None:
        _installed.shutdown()


def _exporter_names() -> list[str]:
    raw = os.environ.get("OTEL_TRACES_EXPORTER", "none")
    names = [part.strip().lower() for part in raw.split(",") if part.strip()]
    unknown = [name for name in names if name not in EXPORTERS]
    if unknown:
        raise ConfigurationError(
            f"OTEL_TRACES_EXPORTER: unsupported exporter {unknown[0]!r} (use otlp, console or none)"
        )
    if "otlp" in names:
        protocol = os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        )
        if protocol.strip() != "http/protobuf":
            raise ConfigurationError(
                f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not supported; "
                "the pipeline exports OTLP over http/protobuf"
            )
    return [name for name in dict.fromkeys(names) if name != "none"]


def _exporter(name: str) -> SpanExporter:
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    return ConsoleSpanExporter()
