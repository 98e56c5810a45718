"""Observability: spans across producer → relay → consumer, metrics endpoints, `pipeline status`.

Real Postgres and Redis (fixtures), real relay and worker processes for the endpoints and
the OTLP export; ``pipeline status`` and ``pipeline trace`` run in this process (click's
``CliRunner``), and once as a real process.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import psycopg
import pytest
import redis
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pipeline import NewEvent, Settings, configure
from pipeline.envelope import decode_envelope
from pipeline.observability import metrics, tracing
from pipeline.registry import CANARY_CONSUMER, CANARY_EVENT_TYPE
from pipeline.relay.state import StateCollector
from pipeline.runtime import build_runtime
from pipeline.transport.publisher import Delivery, PermanentPublishError
from tests.integration.conftest import drainer_for
from tests.support import (
    ROOT,
    Ran,
    app_registry,
    cli_argv,
    otlp_attributes,
    pipeline_env,
    produce,
    queue_envelopes,
    queue_messages,
    run_cli,
    run_cli_process,
    running_relay,
    start_process,
    start_worker,
    stop_process,
    wait_until,
    worker_argv,
)

APP = "tests.apps.relay_app"
SECRET = "hunter2-payload-secret"


# -- tracing fixtures ------------------------------------------------------------------------


class _Capture(SpanProcessor):
    """Records finished spans only while a test captures (the provider is process-wide)."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.active = False

    def on_end(self, span: ReadableSpan) -> None:
        if self.active:
            self.exporter.export([span])


_installed: list[_Capture] = []


def _install_provider() -> _Capture:
    if not _installed:
        _installed.append(_Capture())
        provider = TracerProvider()  # the SDK's, as `configure_tracing` installs it
        provider.add_span_processor(_installed[0])
        trace.set_tracer_provider(provider)  # once per process: OpenTelemetry's rule
        assert trace.get_tracer_provider() is provider, "another provider was installed first"
    return _installed[0]


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    capture = _install_provider()
    capture.exporter.clear()
    capture.active = True
    try:
        yield capture.exporter
    finally:
        capture.active = False
        capture.exporter.clear()


def by_name(exported, prefix: str) -> list[ReadableSpan]:
    return [s for s in exported if s.name.startswith(prefix)]


def row_headers(engine, event_id) -> dict[str, str]:
    from sqlalchemy import text

    with engine.connect() as conn:
        return conn.execute(
            text("SELECT headers FROM pipeline.outbox WHERE id = :id"), {"id": event_id}
        ).scalar_one()


def traceparent_of(span: ReadableSpan) -> str:
    ctx = span.context
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def all_text(span: ReadableSpan) -> str:
    """Everything a span carries that could leak data: attributes, events, links, status."""
    parts = [span.name, repr(dict(span.attributes or {})), str(span.status.description)]
    parts += [f"{e.name} {dict(e.attributes or {})}" for e in span.events]
    parts += [repr(dict(link.attributes or {})) for link in span.links]
    return " ".join(parts)


# -- tracing ---------------------------------------------------------------------------------


def test_create_send_process_form_one_trace(engine, runtime, spans):
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("http request") as request:
        ids = produce(
            engine,
            [
                NewEvent("order.placed", {"secret": SECRET}, aggregate_id="o1"),
                NewEvent("order.paid", {"n": 2}, aggregate_id="o1"),
                NewEvent("user.seen", {"n": 3}),
            ],
        )
    request_ctx = request.get_span_context()

    # create: one PRODUCER span per event, child of the caller's span, its context in the row
    creates = {
        s.attributes["messaging.message.id"]: s
        for s in by_name(spans.get_finished_spans(), "create ")
    }
    assert set(creates) == {str(i) for i in ids}
    for event_id, event_type in zip(ids, ["order.placed", "order.paid", "user.seen"], strict=True):
        span = creates[str(event_id)]
        assert span.name == f"create {event_type}"
        assert span.kind is SpanKind.PRODUCER
        assert span.parent is not None and span.parent.span_id == request_ctx.span_id
        assert span.context.trace_id == request_ctx.trace_id
        assert span.attributes["messaging.operation.type"] == "create"
        assert span.attributes["messaging.destination.name"] == event_type
        assert span.attributes["messaging.system"] == "dramatiq"
        assert row_headers(engine, event_id)["traceparent"] == traceparent_of(span)

    # send: one span per delivery, linked to each event's creation context
    spans.clear()
    result = drainer_for(runtime).run_batch()
    assert result.sent == 3
    sends = {
        s.attributes["messaging.destination.name"]: s
        for s in by_name(spans.get_finished_spans(), "send ")
    }
    assert set(sends) == {"pipeline.audit", "pipeline.billing"}
    expected = {"pipeline.audit": ids, "pipeline.billing": ids[:2]}
    for queue, send in sends.items():
        assert send.name == f"send {queue}"
        assert send.kind is SpanKind.CLIENT  # the create span, not this one, is the producer
        # a delivery mixing two traces' events (the request's and none) would be a root;
        # here every event came from the one request, so the send span joins its trace
        assert send.parent is not None and send.context.trace_id == request_ctx.trace_id
        assert send.attributes["messaging.operation.type"] == "send"
        assert send.attributes["messaging.batch.message_count"] == len(send.links)
        assert len(send.links) == len(expected[queue])
        linked = {link.attributes["messaging.message.id"]: link.context for link in send.links}
        assert set(linked) == {str(i) for i in expected[queue]}
        for event_id, ctx in linked.items():
            assert ctx.span_id == creates[event_id].context.span_id
            assert ctx.trace_id == request_ctx.trace_id
        assert send.status.status_code is StatusCode.UNSET

    # process: parented on the stored creation context; follow-up events continue the trace
    spans.clear()
    envelope = next(
        e for e in queue_envelopes(runtime.settings, "pipeline.billing") if e["id"] == str(ids[0])
    )
    event = decode_envelope(envelope)
    with tracing.process_span(event, "billing", attempt=1) as span:
        assert trace.get_current_span() is span
        follow_up = produce(engine, [NewEvent("invoice.sent", {"n": 1}, causation_id=event.id)])[0]
    exported = spans.get_finished_spans()
    (process,) = by_name(exported, "process ")
    assert process.name == "process order.placed"
    assert process.kind is SpanKind.CONSUMER
    assert process.parent.span_id == creates[str(ids[0])].context.span_id
    assert process.parent.is_remote
    assert process.context.trace_id == request_ctx.trace_id
    assert process.attributes["messaging.consumer.group.name"] == "billing"
    assert process.attributes["messaging.message.id"] == str(ids[0])
    assert process.attributes["messaging.destination.name"] == "order.placed"
    assert process.attributes["pipeline.attempt"] == 1
    (follow_create,) = by_name(exported, "create invoice.sent")
    assert follow_create.parent.span_id == process.context.span_id
    assert follow_create.context.trace_id == request_ctx.trace_id
    assert row_headers(engine, follow_up)["traceparent"] == traceparent_of(follow_create)


def run_workflow(engine, relay_settings: Settings, produce_order: Callable[[], object]) -> None:
    """order.placed -> payment.charged -> stock.reserved, relayed and handled for real.

    order.placed has two consumers (payments publishes the next step, audit does not);
    the relay and the inbox run in this process, under the test's SDK provider.
    """
    from pipeline.inbox.consumer import consumer, definitions
    from pipeline.inbox.processor import InboxProcessor
    from pipeline.registry import Registry
    from pipeline.runtime import build_runtime

    routes = Registry()
    chain = {"order.placed": "payment.charged", "payment.charged": "stock.reserved"}
    for name, event_type in [
        ("payments", "order.placed"),
        ("audit", "order.placed"),
        ("inventory", "payment.charged"),
        ("notifications", "stock.reserved"),
    ]:

        def handle(event, ctx, publishes: bool = name != "audit") -> None:
            follow = chain.get(event.type)
            if follow and publishes:
                ctx.publish(follow, {"order": event.data["order"]})

        consumer(name, [event_type], registry=routes)(handle)
    runtime = build_runtime(relay_settings, routes, set_global_broker=False)
    processors = {
        sub.queue: InboxProcessor(
            relay_settings,
            sub,
            definition,
            lambda: engine,
            lambda envelopes, delay, deferrals: None,
        )
        for sub, definition in definitions(routes)
    }
    try:
        produce_order()
        drainer = drainer_for(runtime)
        handled: set[str] = set()
        for _ in range(10):  # relay, then handle what arrived, until the chain is done
            drainer.run_batch()
            for queue, processor in processors.items():
                for message in queue_messages(relay_settings, queue):
                    if message["message_id"] not in handled:
                        handled.add(message["message_id"])
                        processor.handle(message["args"][0])
            if len(handled) == 4:
                break
    finally:
        runtime.close()
    assert len(handled) == 4


def outbox_traceparents(engine) -> dict[str, tuple[str, str]]:
    """Each outbox row's event type and stored ``traceparent``, by event id."""
    from sqlalchemy import text

    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, event_type, headers->>'traceparent' FROM pipeline.outbox")
        ).all()
    return {str(event_id): (event_type, traceparent) for event_id, event_type, traceparent in rows}


def assert_one_trace_per_workflow(exported: Sequence[ReadableSpan], engine) -> int:
    """Relay, every consumer and the follow-ups are in the trace the first event's row names.

    Returns that trace id.
    """
    stored = outbox_traceparents(engine)
    assert sorted(event_type for event_type, _ in stored.values()) == [
        "order.placed",
        "payment.charged",
        "stock.reserved",
    ]
    (placed,) = [tp for event_type, tp in stored.values() if event_type == "order.placed"]
    trace_id = int(placed.split("-")[1], 16)
    assert {int(tp.split("-")[1], 16) for _, tp in stored.values()} == {trace_id}
    assert {s.context.trace_id for s in exported} == {trace_id}
    creates, sends = by_name(exported, "create "), by_name(exported, "send ")
    processes = by_name(exported, "process ")
    assert sorted(s.name for s in processes) == [
        "process order.placed",
        "process order.placed",
        "process payment.charged",
        "process stock.reserved",
    ]
    assert sorted(s.attributes["messaging.consumer.group.name"] for s in processes) == [
        "audit",
        "inventory",
        "notifications",
        "payments",
    ]
    for process in processes:  # parented on the creation context stored with its event
        assert process.kind is SpanKind.CONSUMER
        _, traceparent = stored[process.attributes["messaging.message.id"]]
        parent = process.parent
        assert parent is not None and parent.is_remote
        assert traceparent.split("-")[1:3] == [f"{parent.trace_id:032x}", f"{parent.span_id:016x}"]
    assert len(sends) == 4  # one delivery per consumer queue
    for send in sends:
        assert send.kind is SpanKind.CLIENT
        assert send.attributes["messaging.batch.message_count"] == len(send.links) == 1
        (link,) = send.links
        _, traceparent = stored[link.attributes["messaging.message.id"]]
        assert f"{link.context.span_id:016x}" == traceparent.split("-")[2]
        assert send.parent is not None and send.parent.span_id == link.context.span_id
    # each follow-up's create span is a child of the process span that published it
    by_span = {s.context.span_id: s for s in exported}
    follow_ups = [c for c in creates if c.name != "create order.placed"]
    assert sorted(c.name for c in follow_ups) == ["create payment.charged", "create stock.reserved"]
    for create in follow_ups:
        assert by_span[create.parent.span_id].name.startswith("process ")
        assert stored[create.attributes["messaging.message.id"]][1] == traceparent_of(create)
    return trace_id


def test_three_stage_workflow_is_one_trace_through_the_real_inbox(engine, relay_settings, spans):
    tracer = trace.get_tracer("test")

    def produce_order() -> None:
        with tracer.start_as_current_span("POST /orders"):
            produce(engine, [NewEvent("order.placed", {"order": "o-1"}, aggregate_id="o-1")])

    run_workflow(engine, relay_settings, produce_order)
    exported = spans.get_finished_spans()
    trace_id = assert_one_trace_per_workflow(exported, engine)
    (request,) = by_name(exported, "POST /orders")
    (placed,) = by_name(exported, "create order.placed")
    assert request.context.trace_id == trace_id
    assert placed.parent.span_id == request.context.span_id


PRODUCER_WITHOUT_OPENTELEMETRY = """
import json
from opentelemetry import trace
from sqlalchemy import create_engine
from sqlalchemy.orm import Session
from pipeline import NewEvent, add_events, get_settings
assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
engine = create_engine(get_settings().sqlalchemy_url())
with Session(engine) as session, session.begin():
    ids = add_events(session, [NewEvent("order.placed", json.loads(input()), aggregate_id="o-1")])
print(ids[0])
"""


def produce_without_opentelemetry(
    settings: Settings, payload: dict[str, str], app: str = APP
) -> str:
    """Add an event from a process that configured no OpenTelemetry at all; its id."""
    env = {k: v for k, v in pipeline_env(settings, app).items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [sys.executable, "-c", PRODUCER_WITHOUT_OPENTELEMETRY],
        input=json.dumps(payload),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_a_workflow_from_a_producer_without_opentelemetry_is_one_trace(
    engine, relay_settings, spans
):
    placed: list[str] = []
    run_workflow(
        engine,
        relay_settings,
        lambda: placed.append(produce_without_opentelemetry(relay_settings, {"order": "o-1"})),
    )
    exported = spans.get_finished_spans()
    trace_id = assert_one_trace_per_workflow(exported, engine)
    assert not by_name(exported, "create order.placed")  # the producer recorded nothing
    shown = run_cli(["trace", placed[0], "--json"], pipeline_env(relay_settings, APP))
    assert shown.returncode == 0, shown.stderr
    lineage = json.loads(shown.stdout)
    assert lineage["trace_id"] == f"{trace_id:032x}"
    assert lineage["follow_ups"][0]["trace_id"] == f"{trace_id:032x}"


INBOX_APP = "tests.apps.inbox_app"
EFFECTS = (
    "CREATE TABLE effects (id bigserial PRIMARY KEY, stage text NOT NULL,"
    " order_id text NOT NULL, event_id uuid NOT NULL)"
)


def test_relay_and_worker_processes_export_one_trace_over_otlp(
    engine, settings, otlp_receiver, tmp_path
):
    """Real `pipeline relay` and `pipeline worker` processes export with the official exporter.

    The producer configured no OpenTelemetry; the three-stage workflow of
    tests/apps/inbox_app.py is still one trace, and no payload reaches the collector.
    """
    with engine.begin() as conn:
        conn.exec_driver_sql(EFFECTS)
    otel = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint,
    }
    relay_log, worker_log = tmp_path / "relay.log", tmp_path / "worker.log"
    relay = start_process(
        cli_argv("relay"),
        pipeline_env(settings, INBOX_APP, **otel),
        relay_log,
    )
    worker = start_worker(settings, INBOX_APP, worker_log, 1, 2, **otel)
    try:
        placed = produce_without_opentelemetry(
            settings, {"order_id": "o-1", "card": SECRET}, app=INBOX_APP
        )

        def notified() -> bool:
            with engine.connect() as conn:
                return bool(
                    conn.exec_driver_sql(
                        "SELECT count(*) FROM effects WHERE stage = 'notifications'"
                    ).scalar()
                )

        wait_until(notified, timeout=90, interval=0.2)
    finally:
        stop_process(worker)
        stop_process(relay)
    assert relay.returncode == 0, relay_log.read_text()
    assert worker.returncode == 0, worker_log.read_text()
    assert not any(SECRET.encode() in body for _, _, body in otlp_receiver.received)
    stored = outbox_traceparents(engine)
    trace_id = int(stored[placed][1].split("-")[1], 16)
    exported = otlp_receiver.spans()
    names = sorted(span.name for _, span in exported)
    assert names == [
        "create payment.charged",
        "create stock.reserved",
        "process order.placed",
        "process payment.charged",
        "process stock.reserved",
        "send pipeline.inventory",
        "send pipeline.notifications",
        "send pipeline.payments",
    ]
    for resource, span in exported:
        assert int.from_bytes(span.trace_id, "big") == trace_id, span.name
        service = "pipeline-relay" if span.name.startswith("send ") else "pipeline-worker"
        assert resource["service.name"] == service
        attributes = otlp_attributes(span)
        assert attributes["messaging.system"] == "dramatiq"
        assert attributes["messaging.operation.type"] == span.name.split()[0]
        if span.name.startswith("process "):
            event_type, traceparent = stored[str(attributes["messaging.message.id"])]
            assert span.name == f"process {event_type}"
            assert span.parent_span_id.hex() == traceparent.split("-")[2]
        if span.name.startswith("send "):
            (link,) = span.links
            _, traceparent = stored[str(otlp_attributes(link)["messaging.message.id"])]
            assert link.span_id.hex() == traceparent.split("-")[2]


def test_consumer_outcomes_are_span_events_without_payloads_or_messages(engine, runtime, spans):
    ids = produce(engine, [NewEvent("order.placed", {"secret": SECRET})])
    drainer_for(runtime).run_batch()
    event = decode_envelope(queue_envelopes(runtime.settings, "pipeline.audit")[0])
    with tracing.process_span(event, "audit", 0) as span:
        tracing.mark_duplicate(span)
    with tracing.process_span(event, "audit", 2) as span:
        tracing.record_retry(span, ValueError(f"bad {SECRET}"), 1.5)
    with tracing.process_span(event, "audit", 9) as span:
        tracing.record_dead_letter(span, "gave up after 9 attempts")
    with pytest.raises(KeyError), tracing.process_span(event, "audit", 3):
        raise KeyError(SECRET)
    duplicate, retried, dead, raised = by_name(spans.get_finished_spans(), "process ")
    assert duplicate.attributes["pipeline.duplicate"] is True
    assert [e.name for e in duplicate.events] == ["pipeline.duplicate"]
    assert duplicate.status.status_code is StatusCode.UNSET
    (retry,) = retried.events
    assert retry.name == "pipeline.retry"
    assert retry.attributes["error.type"] == "ValueError"
    assert retry.attributes["pipeline.retry.delay_seconds"] == 1.5
    assert retried.status.status_code is StatusCode.ERROR
    assert dead.attributes["pipeline.dead_lettered"] is True
    assert dead.events[0].attributes["pipeline.dead_letter.reason"] == "gave up after 9 attempts"
    assert dead.status.status_code is StatusCode.ERROR
    assert raised.attributes["error.type"] == "KeyError"
    assert raised.status.status_code is StatusCode.ERROR
    for span in spans.get_finished_spans():
        assert SECRET not in all_text(span)
    assert str(ids[0]) == duplicate.attributes["messaging.message.id"]


def test_failed_delivery_marks_its_send_span(engine, runtime, spans):
    class Refusing:
        def deliver(self, deliveries):
            return [PermanentPublishError("too big") for _ in deliveries]

        def close(self) -> None:
            pass

    produce(engine, [NewEvent("user.seen", {"n": 1})])
    drainer_for(runtime, Refusing()).run_batch()
    (send,) = by_name(spans.get_finished_spans(), "send ")
    assert send.status.status_code is StatusCode.ERROR
    assert send.attributes["error.type"] == "PermanentPublishError"


def test_process_span_without_a_stored_context_starts_a_trace(spans):
    from pipeline.envelope import ReceivedEvent

    event = ReceivedEvent(
        id=__import__("uuid").uuid4(),
        type="a",
        version=1,
        data={},
        source="s",
        time="",
        seq=1,
        traceparent="garbage",
    )
    with tracing.process_span(event, "c", 1):
        pass
    (span,) = spans.get_finished_spans()
    assert span.parent is None and span.context.is_valid


# -- state gauges ----------------------------------------------------------------------------


def samples(collector: StateCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector.collect()
        for s in family.samples
    }


def value(collected, name: str, **labels: str) -> float | None:
    return collected.get((name, tuple(sorted(labels.items()))))


def test_state_collector_follows_backlog_dead_letters_and_queues(engine, runtime, settings):
    collector = StateCollector(settings, lambda: ["pipeline.audit", "pipeline.billing"])
    try:
        start = samples(collector)
        assert value(start, "pipeline_outbox_backlog", status="pending") == 0
        assert value(start, "pipeline_outbox_backlog", status="publishing") == 0
        assert value(start, "pipeline_dead_letters_waiting", stage="publish") == 0
        assert value(start, "pipeline_dead_letters_waiting", stage="consume") == 0
        assert value(start, "pipeline_queue_depth", queue="pipeline.audit") == 0
        assert value(start, "pipeline_queue_depth", queue="pipeline.audit.DQ") == 0
        assert value(start, "pipeline_dead_letter_queue_depth", queue="pipeline.billing") == 0
        assert value(start, "pipeline_state_up", source="postgres", transport="redis") == 1
        assert value(start, "pipeline_state_up", source="redis", transport="redis") == 1
        assert value(start, "pipeline_outbox_oldest_pending_age_seconds") == 0

        produce(engine, [NewEvent("order.placed", {"i": i}) for i in range(5)])
        collector.refresh()
        now = samples(collector)
        assert value(now, "pipeline_outbox_backlog", status="pending") == 5
        assert value(now, "pipeline_outbox_oldest_pending_age_seconds") > 0

        class Refusing:
            def deliver(self, deliveries: list[Delivery]):
                return [PermanentPublishError("refused") for _ in deliveries]

            def close(self) -> None:
                pass

        refusing = drainer_for(runtime, Refusing())
        refusing.run_batch(limit=1)  # the first event is dead-lettered at publish
        drainer_for(runtime).run_batch()  # the other four are delivered
        client = redis.Redis.from_url(settings.require_redis_url())
        client.zadd(f"{settings.redis_namespace}:pipeline.audit.XQ", {"m1": time.time()})
        client.close()
        collector.refresh()
        after = samples(collector)
        assert value(after, "pipeline_outbox_backlog", status="pending") == 0
        assert value(after, "pipeline_dead_letters_waiting", stage="publish") == 1
        assert value(after, "pipeline_dead_letters_waiting", stage="consume") == 0
        assert value(after, "pipeline_queue_depth", queue="pipeline.audit") == 1  # one message
        assert value(after, "pipeline_queue_depth", queue="pipeline.billing") == 1
        assert value(after, "pipeline_dead_letter_queue_depth", queue="pipeline.audit") == 1
        assert value(after, "pipeline_outbox_oldest_pending_age_seconds") == 0
    finally:
        collector.close()


def test_broker_publish_time_and_reachability_name_the_transport(engine, any_runtime):
    """A batch's time on the broker (RabbitMQ: publish and confirm round) and the broker's
    ``pipeline_state_up`` series carry the transport's name, on Redis and on RabbitMQ."""
    settings = any_runtime.settings
    transport = "rabbitmq" if settings.require_broker_url().startswith("amqp") else "redis"

    def batches_timed() -> float:
        labels = {"transport": transport}
        return (
            metrics.REGISTRY.get_sample_value("pipeline_broker_publish_seconds_count", labels)
            or 0.0
        )

    drainer = drainer_for(any_runtime)
    before = batches_timed()
    produce(engine, [NewEvent("order.placed", {"i": i}) for i in range(3)])
    assert drainer.run_batch().claimed == 3
    assert batches_timed() == before + 1
    collector = StateCollector(settings, lambda: ["pipeline.audit", "pipeline.billing"])
    try:
        collected = samples(collector)
    finally:
        collector.close()
    assert value(collected, "pipeline_state_up", source="redis", transport=transport) == 1
    assert value(collected, "pipeline_state_up", source="postgres", transport=transport) == 1


def test_state_collector_queries_at_most_once_per_interval(settings):
    clock = [100.0]
    collector = StateCollector(settings, list, interval=5.0, clock=lambda: clock[0])
    try:
        for _ in range(10):
            collector.collect()
        assert collector.refreshes == 1
        clock[0] += 4.9
        collector.collect()
        assert collector.refreshes == 1
        clock[0] += 0.2
        collector.collect()
        assert collector.refreshes == 2
        assert list(collector.describe())  # describing never queries
        assert collector.refreshes == 2
    finally:
        collector.close()


def test_state_collector_reports_an_unreachable_source_instead_of_stale_values(settings):
    down = settings.replace(
        database_url=f"postgresql://u:pw@127.0.0.1:{free_port()}/x",
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
    )
    collector = StateCollector(down, lambda: ["pipeline.audit"])
    try:
        collected = samples(collector)
    finally:
        collector.close()
    assert value(collected, "pipeline_state_up", source="postgres", transport="redis") == 0
    assert value(collected, "pipeline_state_up", source="redis", transport="redis") == 0
    assert not [name for name, _ in collected if name.startswith("pipeline_outbox")]
    assert not [name for name, _ in collected if name.startswith("pipeline_queue")]


# -- endpoints -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def scrape_when_up(url: str, process: subprocess.Popen[bytes], log: Path) -> str:
    def attempt() -> str | None:
        assert process.poll() is None, log.read_text()
        try:
            return scrape(url)
        except OSError:
            return None

    return wait_until(attempt, timeout=60, interval=0.2)


def documented_metrics() -> dict[str, dict[str, str]]:
    """The reference table of docs/metrics.md: name -> {type, labels, exported_by}."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    rows: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        match = re.match(r"^\| `(pipeline_\w+)` \| (\w+) \| ([^|]*) \| ([^|]*) \|", line)
        if match:
            name, kind, labels, exported_by = match.groups()
            rows[name] = {"type": kind, "labels": labels.strip(), "exported_by": exported_by}
    assert len(rows) >= 20, "docs/metrics.md reference table not found"
    return rows


def families(text: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (pipeline_\w+) (\w+)$", text, re.MULTILINE))


def has_samples(text: str, name: str) -> bool:
    return (
        re.search(rf"^{name}(_total|_bucket|_count|_sum)?(\{{| )", text, re.MULTILINE) is not None
    )


def series(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` with exactly ``labels`` in an exposition, or None."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


def promtool_check(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text.encode(), capture_output=True, check=False
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def check_against_docs(text: str, process: str) -> None:
    docs = documented_metrics()
    exported = families(text)
    undocumented = sorted(set(exported) - set(docs))
    assert not undocumented, f"exported but not in docs/metrics.md: {undocumented}"
    for name, type_ in exported.items():
        assert docs[name]["type"] == type_, f"{name} is a {type_}, documented {docs[name]['type']}"
    for name, row in docs.items():
        if process not in row["exported_by"]:
            continue
        if row["labels"] == "—" or "from start" in row["labels"]:
            assert has_samples(text, name), f"{name} should be exported from the start"
        elif process == "relay":  # a single-process registry lists every family it holds
            assert name in exported, f"{name} missing from the {process}'s output"


def test_relay_metrics_endpoint_passes_promtool_and_matches_the_docs(settings, tmp_path):
    port = free_port()
    log = tmp_path / "relay.log"
    relay = start_process(
        cli_argv("relay", "--metrics-port", str(port)),
        pipeline_env(settings, APP),
        log,
    )
    try:
        text = scrape_when_up(f"http://127.0.0.1:{port}/metrics", relay, log)
        text = wait_until(  # the listener connects right after start
            lambda: (
                (t := scrape(f"http://127.0.0.1:{port}/metrics"))
                and "pipeline_relay_listener_connected 1.0" in t
                and t
            ),
            timeout=30,
        )
    finally:
        stop_process(relay)
    assert relay.returncode == 0, log.read_text()
    promtool_check(text)
    check_against_docs(text, "relay")
    for source in ("notify", "poll", "reconnect"):
        assert f'pipeline_relay_wakeups_total{{source="{source}"}}' in text
    for queue in ("pipeline.audit", "pipeline.billing", "pipeline.publish"):
        assert f'pipeline_queue_depth{{queue="{queue}"}} 0.0' in text
        assert f'pipeline_dead_letter_queue_depth{{queue="{queue}"}} 0.0' in text
    assert 'pipeline_state_up{source="postgres",transport="redis"} 1.0' in text
    assert series(text, "pipeline_broker_publish_seconds_count", transport="redis") is not None
    # Labelled counters exist at 0 for their known label sets before any failure.
    for event_type in ("order.placed", "order.paid", CANARY_EVENT_TYPE):
        for error_class in ("PublisherUnavailable", "PermanentPublishError"):
            failures = series(
                text,
                "pipeline_publish_failures_total",
                event_type=event_type,
                error_class=error_class,
            )
            assert failures == 0.0, (event_type, error_class)
        assert series(text, "pipeline_events_unrouted_total", event_type=event_type) == 0.0


def test_worker_metrics_aggregate_dramatiq_processes_that_stop_cleanly_on_sigterm(
    engine, settings, tmp_path
):
    """The worker's endpoint sums the metric files of its Dramatiq processes; SIGTERM then
    stops them cleanly: exit 0, every process gone, each one's heartbeat row in
    ``worker_state`` removed on the way out (a killed one's would stay), the temporary
    metrics directory removed."""
    settings = settings.replace(batch_size=50)
    configure(settings)
    port = free_port()
    worker_log = tmp_path / "worker.log"
    worker = start_process(
        worker_argv(2, 2, "--metrics-port", str(port)),
        pipeline_env(settings, APP),
        worker_log,
    )
    # The relay runs in this process: it only hands the worker processes their publishing.
    runtime = build_runtime(settings, app_registry(APP), set_global_broker=False)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        scrape_when_up(url, worker, worker_log)
        with running_relay(runtime, runtime.registry, mode="workers"):
            produce(
                engine,
                [NewEvent("order.placed", {"i": i}, aggregate_id=str(i)) for i in range(300)],
            )

            def published() -> float:
                found = re.search(
                    r'^pipeline_events_published_total\{event_type="order.placed"\} (\S+)$',
                    scrape(url),
                    re.MULTILINE,
                )
                return float(found.group(1)) if found else 0.0

            wait_until(lambda: published() == 300, timeout=60, interval=0.2)
            text = scrape(url)
            multiproc_dir = Path(
                re.search(r"PROMETHEUS_MULTIPROC_DIR=(\S+)", _environ_of(worker)).group(1)
            )
            assert len(list(multiproc_dir.glob("*.db"))) >= 2  # files of several processes
        children = child_pids(worker.pid)
        assert children
        wait_until(lambda: worker_rows(engine) == 2, timeout=60, alive=[worker])
    finally:
        stop_process(worker)  # SIGTERM (a SIGKILL, after 20 s, would not exit 0)
        runtime.close()
    assert worker.returncode == 0, worker_log.read_text()
    assert worker_rows(engine) == 0
    for pid in children:
        assert (
            not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        )
    assert not multiproc_dir.exists(), "the temporary multiprocess directory is removed"
    promtool_check(text)
    check_against_docs(text, "worker")
    canary_queue = f"pipeline.{CANARY_CONSUMER}"
    for error_class in ("OperationalError", "InterfaceError", "ConnectionError"):
        retries = series(
            text,
            "pipeline_inbox_infrastructure_retries_total",
            consumer=CANARY_CONSUMER,
            error_class=error_class,
        )
        assert retries == 0.0, error_class
    assert series(text, "pipeline_inbox_duplicates_dropped_total", queue=canary_queue) == 0.0
    assert series(text, "pipeline_deliveries_lost_total", queue=canary_queue) == 0.0
    failures = series(
        text,
        "pipeline_publish_failures_total",
        event_type="order.paid",
        error_class="PublisherUnavailable",
    )
    assert failures == 0.0


def child_pids(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _environ_of(process: subprocess.Popen[bytes]) -> str:
    """The environment of the dramatiq child of a `pipeline worker` process."""
    children = child_pids(process.pid)
    assert children, "pipeline worker has no dramatiq child"
    return Path(f"/proc/{children[0]}/environ").read_bytes().replace(b"\0", b" ").decode()


def worker_rows(engine) -> int:
    with engine.connect() as conn:
        return int(conn.exec_driver_sql("SELECT count(*) FROM pipeline.worker_state").scalar())


def test_metrics_server_binds_loopback_by_default(settings):
    assert Settings().metrics_host == "127.0.0.1"
    server = metrics.start_metrics_server(settings, "relay", port=free_port())
    assert server is not None
    try:
        assert server.host == "127.0.0.1"
        assert "pipeline_relay_wakeups_total" in scrape(server.url)
    finally:
        server.close()
    assert metrics.start_metrics_server(settings, "relay", port=0) is None
    assert metrics.start_metrics_server(settings.replace(metrics_port=0), "relay") is None


def test_metrics_server_unregisters_its_collectors_on_close(settings):
    collector = StateCollector(settings, list)
    for _ in range(2):  # a second server can register a collector again
        server = metrics.start_metrics_server(
            settings, "relay", port=free_port(), collectors=[collector]
        )
        assert server is not None
        assert "pipeline_outbox_backlog" in scrape(server.url)
        server.close()
    collector.close()


def test_prepare_multiprocess_dir_cleans_only_stale_metric_files(settings, tmp_path, monkeypatch):
    monkeypatch.delenv(metrics.MULTIPROC_ENV, raising=False)
    (tmp_path / "counter_123.db").write_bytes(b"x")
    (tmp_path / "keep.txt").write_text("mine")
    path = metrics.prepare_multiprocess_dir(settings.replace(metrics_multiproc_dir=str(tmp_path)))
    assert path == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    import os

    assert os.environ[metrics.MULTIPROC_ENV] == str(tmp_path)
    monkeypatch.delenv(metrics.MULTIPROC_ENV)
    fresh = metrics.prepare_multiprocess_dir(settings)
    try:
        assert fresh.is_dir() and fresh.name.startswith("pipeline-metrics-")
    finally:
        metrics.remove_multiprocess_dir(fresh)
    assert not fresh.exists()
    metrics.remove_multiprocess_dir(tmp_path)  # never removes a directory it did not create
    assert tmp_path.exists()


# -- pipeline status -------------------------------------------------------------------------


def run_status(env: dict[str, str], *args: str) -> Ran:
    """``pipeline status ARGS`` in this process (the command, not its process, is tested)."""
    return run_cli(["status", *args], env)


def test_status_json_reports_state_and_exit_codes(engine, runtime, settings):
    env = pipeline_env(settings, APP)
    healthy = run_status(env, "--json")
    assert healthy.returncode == 0, healthy.stderr
    report = json.loads(healthy.stdout)
    assert set(report) == {
        "healthy",
        "problems",
        "backlog",
        "oldest_pending_age_seconds",
        "dead_letters",
        "relays",
        "queues",
        "owed",
        "keys_held",
        "interval_seconds",
        "consumers",
        "unrouted",
        "workers",
    }
    assert report["healthy"] is True and report["problems"] == []
    assert report["owed"] == {} and report["keys_held"] == {} and report["unrouted"] == {}
    assert report["backlog"] == {"pending": 0, "publishing": 0}
    assert report["dead_letters"] == {"publish": 0, "consume": 0}
    assert report["relays"] == [] and report["workers"] == []
    assert report["queues"]["pipeline.audit"] == {"ready": 0, "delayed": 0, "dead": 0}
    assert "pipeline.publish" in report["queues"]

    produce(engine, [NewEvent("order.placed", {"i": i}) for i in range(3)])
    with psycopg.connect(settings.require_database_url(), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pipeline.relay_state (relay_id, busy, host, pid) "
            "VALUES ('r1', true, 'h', 7)"
        )
    report = json.loads(run_status(env, "--json").stdout)
    assert report["backlog"]["pending"] == 3 and report["healthy"] is True
    (relay,) = report["relays"]
    assert relay["relay_id"] == "r1" and relay["busy"] is True and relay["pid"] == 7
    assert relay["heartbeat_age_seconds"] >= 0
    old = run_status(env, "--json", "--max-pending-age", "0")
    assert old.returncode == 1
    assert "oldest unsent event" in json.loads(old.stdout)["problems"][0]

    class Refusing:
        def deliver(self, deliveries):
            return [PermanentPublishError("refused") for _ in deliveries]

        def close(self) -> None:
            pass

    drainer_for(runtime, Refusing()).run_batch(limit=1)
    dead = run_status(env, "--json")
    assert dead.returncode == 1
    report = json.loads(dead.stdout)
    assert report["dead_letters"]["publish"] == 1 and report["healthy"] is False
    # The problem names commands that exist, and the listing it names finds the dead letter.
    (problem,) = [p for p in report["problems"] if "dead letters" in p]
    command = problem.split("`")[1]
    assert command == "pipeline dlq list --waiting"
    listed = run_cli([*command.split()[1:], "--json"], env)
    assert listed.returncode == 0, listed.stderr
    assert [(d["stage"], d["error_class"]) for d in json.loads(listed.stdout)] == [
        ("publish", "PermanentPublishError")
    ]
    assert "`pipeline dlq replay --dry-run`" in problem
    assert run_status(env, "--json", "--max-dead-letters", "1").returncode == 0
    human = run_status(env)
    assert human.returncode == 1 and "UNHEALTHY" in human.stdout and "r1" in human.stdout


def test_status_names_an_unreachable_database_in_one_line_without_its_password(settings):
    env = pipeline_env(settings, APP)
    env["PIPELINE_DATABASE_URL"] = f"postgresql://app:S3cretPassw0rd@127.0.0.1:{free_port()}/db"
    result = run_cli_process(["status", "--json"], env)  # end to end: what a shell sees
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "S3cretPassw0rd" not in result.stderr
    assert "cannot connect to Postgres at 127.0.0.1" in lines[0]


def test_status_without_the_schema_says_to_upgrade(empty_database_url, settings):
    env = pipeline_env(settings, APP, PIPELINE_DATABASE_URL=empty_database_url)
    result = run_status(env)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "pipeline: error: the pipeline schema 'pipeline' is not installed: "
        "run `pipeline db upgrade`"
    ]


def test_status_with_redis_down_is_one_line(settings):
    env = pipeline_env(
        settings, APP, PIPELINE_REDIS_URL=f"redis://:pw123@127.0.0.1:{free_port()}/0"
    )
    result = run_status(env)
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert "cannot use Redis at redis://:***@127.0.0.1" in line and "pw123" not in line
