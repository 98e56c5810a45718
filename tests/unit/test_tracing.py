"""Tracing set-up and the no-provider path.

OpenTelemetry allows one global tracer provider per process, so each test starts from the
state of a fresh interpreter (``fresh_opentelemetry``: no provider, no ``OTEL_*`` settings,
the module's caches empty) and the state before it is put back afterwards. Only the
console exporter's test runs a subprocess: what it checks is what a process prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from opentelemetry import context, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util._once import Once

from pipeline import NewEvent, Settings
from pipeline.envelope import OutboxEvent, ReceivedEvent
from pipeline.errors import ConfigurationError
from pipeline.observability import tracing
from pipeline.outbox import prepare_rows
from tests.support import ROOT, OtlpReceiver, otlp_attributes


def headers() -> dict[str, str]:
    rows = prepare_rows([NewEvent("order.placed", {"secret": "hunter2"})], Settings())
    return dict(json.loads(rows[0]["headers"]))


def _clear_caches() -> None:
    tracing._tracer.cache_clear()  # a proxy tracer latches on to the provider it found
    tracing._new_traces.cache_clear()  # the sampler, read from the environment once


@pytest.fixture(autouse=True)
def fresh_opentelemetry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """OpenTelemetry as a new process has it; what the test installs is shut down after."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    monkeypatch.setattr(trace, "_TRACER_PROVIDER_SET_ONCE", Once())
    monkeypatch.setattr(tracing, "_configured", None)
    monkeypatch.setattr(tracing, "_installed", None)
    _clear_caches()
    token = context.attach(context.Context())
    try:
        yield
    finally:
        context.detach(token)
        tracing.shutdown_tracing()
        installed = trace._TRACER_PROVIDER
        if isinstance(installed, TracerProvider):
            installed.shutdown()
        _clear_caches()  # monkeypatch then puts the previous provider back


CONSOLE_PROCESS = """
import json
from pipeline import NewEvent, Settings
from pipeline.observability import tracing
from pipeline.outbox import prepare_rows
def headers():
    rows = prepare_rows([NewEvent("order.placed", {"secret": "hunter2"})], Settings())
    return json.loads(rows[0]["headers"])
first = tracing.configure_tracing(Settings(), "pipeline-test")
assert tracing.configure_tracing(Settings(), "other") is first
assert headers()["traceparent"].startswith("00-")
tracing.shutdown_tracing()
"""


def test_console_exporter_prints_create_spans_and_configuration_is_idempotent():
    """A process configured for the console prints its spans on its own stdout."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [sys.executable, "-c", CONSOLE_PROCESS],
        env={
            **base,
            "PYTHONPATH": str(ROOT),
            "OTEL_TRACES_EXPORTER": "console",
            "OTEL_SERVICE_NAME": "from-env",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert '"name": "create order.placed"' in result.stdout
    assert '"service.name": "from-env"' in result.stdout  # OTEL_SERVICE_NAME wins
    assert "hunter2" not in result.stdout


INCOMING = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_without_a_provider_spans_are_no_ops_and_the_callers_context_propagates():
    carrier = {"traceparent": INCOMING, "tracestate": "k=v"}
    token = context.attach(TraceContextTextMapPropagator().extract(carrier))
    try:
        stored = headers()
    finally:
        context.detach(token)
    assert stored["traceparent"] == INCOMING, stored
    assert stored["tracestate"] == "k=v", stored
    with tracing.send_span("q", []) as span:
        assert not span.is_recording()


def test_exporter_none_installs_no_provider_and_events_still_get_a_context():
    assert tracing.configure_tracing(Settings(), "pipeline-test") is None
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    traceparent = headers()["traceparent"]
    assert traceparent.startswith("00-") and len(traceparent) == 55


def received(
    traceparent: str | None = None,
    tracestate: str | None = None,
    *,
    event_id: uuid.UUID | None = None,
    data: object = None,
) -> ReceivedEvent:
    return ReceivedEvent(
        id=event_id or uuid.uuid4(),
        type="order.placed",
        version=1,
        data=data if data is not None else {},
        source="s",
        time="2026-01-01T00:00:00+00:00",
        seq=1,
        traceparent=traceparent,
        tracestate=tracestate,
    )


def test_without_a_provider_a_workflow_made_outside_any_trace_is_one_trace():
    """No provider, no current span: the event gets a new trace that its consumers continue."""
    created = tracing.start_create_span("order.placed", "e1")
    assert not created.is_recording()
    stored = tracing.span_headers(created)["traceparent"]
    assert int(stored[-2:], 16) & 1, stored  # sampled, as the default sampler samples a root
    assert headers()["traceparent"].split("-")[1] != stored.split("-")[1]  # a trace each
    event = received(stored)
    with tracing.process_span(event, "billing", 1) as span:
        assert not span.is_recording()
        assert trace.get_current_span() is span
        follow_up = headers()["traceparent"]
    assert follow_up.split("-")[1] == stored.split("-")[1], (follow_up, stored)
    with tracing.send_span("q", []) as send:
        assert not send.get_span_context().is_valid
    memory = InMemorySpanExporter()  # a provider installed later is used from then on
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    trace.set_tracer_provider(provider)
    with tracing.process_span(event, "billing", 1) as span:
        assert span.is_recording()
    (process,) = memory.get_finished_spans()
    assert process.name == "process order.placed"
    assert f"{process.context.trace_id:032x}" == stored.split("-")[1]


@pytest.mark.parametrize(
    ("sampler", "expected"),
    [
        ({}, "all"),
        ({"OTEL_TRACES_SAMPLER": "always_off"}, "none"),
        (
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"},
            "none",
        ),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"}, "ratio"),
    ],
)
def test_a_new_trace_without_a_provider_is_sampled_as_the_configured_sampler_decides(
    sampler: dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch
):
    for name, value in sampler.items():
        monkeypatch.setenv(name, value)
    reference = TraceIdRatioBased(0.5)
    rows = []
    for stored in [headers() for _ in range(400)]:
        _, trace_hex, _, flags = stored["traceparent"].split("-")
        by_ratio = reference.should_sample(None, int(trace_hex, 16), "x").decision
        rows.append((bool(int(flags, 16) & 1), by_ratio is Decision.RECORD_AND_SAMPLE))
    sampled = [flag for flag, _ in rows]
    if expected == "all":
        assert all(sampled)
    elif expected == "none":
        assert not any(sampled)
    else:  # each trace's flag is the ratio sampler's decision for its trace id
        assert sampled == [by_ratio for _, by_ratio in rows]
        assert 0 < sum(sampled) < len(sampled)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_TRACES_EXPORTER": "jaeger"}, "OTEL_TRACES_EXPORTER: unsupported exporter 'jaeger'"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "OTEL_EXPORTER_OTLP_PROTOCOL: 'grpc' is not supported",
        ),
    ],
)
def test_bad_tracing_settings_are_clear_errors(
    env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError) as raised:
        tracing.configure_tracing(Settings(), "x")
    assert message in str(raised.value)
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def test_sdk_disabled_leaves_tracing_off(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert tracing.configure_tracing(Settings(), "x") is None
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert "traceparent" not in headers()
    assert capsys.readouterr().out == ""


def export_a_workflow() -> str:
    """Configure tracing from the environment, then create, send and process one event."""
    tracing.configure_tracing(Settings(), "pipeline-test")
    row = prepare_rows([NewEvent("order.placed", {"secret": "hunter2"})], Settings())[0]
    outbox = OutboxEvent(
        id=row["id"],
        seq=1,
        aggregate_type=None,
        aggregate_id=None,
        ordering_key=None,
        event_type="order.placed",
        event_version=1,
        payload_json=row["payload"],
        headers_json=row["headers"],
        attempts=0,
        created_at=datetime.now(UTC),
    )
    with tracing.send_span("pipeline.billing", [outbox]):
        pass
    event = received(outbox.headers["traceparent"], event_id=row["id"], data={"secret": "hunter2"})
    with tracing.process_span(event, "billing", 2) as span:
        tracing.record_retry(span, ValueError("card hunter2 declined"), 0.5)
    tracing.shutdown_tracing()  # flushes the batch to the collector
    return str(row["id"])


def test_otlp_http_export_reaches_a_collector(
    otlp_receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
):
    """The official exporter posts the pipeline's spans; decoded, they carry no payload."""
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.endpoint)
    event_id = export_a_workflow()
    posted = otlp_receiver.received
    assert posted, "nothing was exported"
    assert {(path, content_type) for path, content_type, _ in posted} == {
        ("/v1/traces", "application/x-protobuf")
    }
    assert not any(b"hunter2" in body for _, _, body in posted)
    spans = {span.name: (resource, span) for resource, span in otlp_receiver.spans()}
    assert sorted(spans) == ["create order.placed", "process order.placed", "send pipeline.billing"]
    for resource, _ in spans.values():
        assert resource["service.name"] == "pipeline-test"
        assert resource["pipeline.schema"] == "pipeline"
    _, create = spans["create order.placed"]
    _, send = spans["send pipeline.billing"]
    _, process = spans["process order.placed"]
    assert [create.kind, send.kind, process.kind] == [
        create.SPAN_KIND_PRODUCER,
        create.SPAN_KIND_CLIENT,
        create.SPAN_KIND_CONSUMER,
    ]
    assert otlp_attributes(create) == {
        "messaging.system": "dramatiq",
        "messaging.operation.type": "create",
        "messaging.operation.name": "create",
        "messaging.destination.name": "order.placed",
        "messaging.message.id": event_id,
        "messaging.message.conversation_id": event_id,
    }
    assert otlp_attributes(send) == {
        "messaging.system": "dramatiq",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": "pipeline.billing",
        "messaging.batch.message_count": 1,
    }
    (link,) = send.links
    assert link.span_id == create.span_id and otlp_attributes(link) == {
        "messaging.message.id": event_id
    }
    assert send.parent_span_id == create.span_id  # one event, one trace: a child in it
    assert process.parent_span_id == create.span_id
    assert create.trace_id == send.trace_id == process.trace_id
    assert otlp_attributes(process)["messaging.consumer.group.name"] == "billing"
    assert otlp_attributes(process)["pipeline.attempt"] == 2
    assert otlp_attributes(process)["error.type"] == "ValueError"
    (retry,) = process.events
    assert retry.name == "pipeline.retry"
    assert otlp_attributes(retry) == {
        "error.type": "ValueError",
        "pipeline.retry.delay_seconds": 0.5,
    }
    assert process.status.message == "ValueError"


def test_without_a_provider_a_process_span_hands_the_creation_context_to_follow_ups():
    event = received(INCOMING, "k=v")
    with tracing.process_span(event, "c", 1) as span:
        assert not span.is_recording()
        assert trace.get_current_span() is span
        stored = headers()
    assert stored["traceparent"] == INCOMING, stored
    assert stored["tracestate"] == "k=v", stored
    after = headers()["traceparent"]  # detached again after the block: a new trace
    assert after.split("-")[1] != INCOMING.split("-")[1], after
    with pytest.raises(KeyError), tracing.process_span(received(), "c", 1):
        raise KeyError("handler failed")
    assert trace.get_current_span() is trace.INVALID_SPAN  # the failed block detached too


TRACEPARENTS = [
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
    " 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01 ",
    "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-future",  # later versions may add
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",  # version 00 may not
    "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
    "00-00000000000000000000000000000000-b7ad6b7169203331-01",
    "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333-01",
    "00-+af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "garbage",
    "",
    "\n00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-" + "x" * 600,
]


@pytest.mark.parametrize("traceparent", TRACEPARENTS)
def test_stored_traceparents_are_read_as_opentelemetrys_propagator_reads_them(traceparent: str):
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from pipeline.observability.tracing import TRACEPARENT_MAX_LENGTH, remote_span_context

    if len(traceparent) > TRACEPARENT_MAX_LENGTH:  # OpenTelemetry >= 1.45.2 rejects it too
        assert remote_span_context(traceparent, "k=v") is None
        return
    for tracestate in ("k=v,a=b", "k=" + "v" * 9000):
        carrier = {"traceparent": traceparent, "tracestate": tracestate}
        expected = trace.get_current_span(TraceContextTextMapPropagator().extract(carrier))
        expected_context = expected.get_span_context()
        ours = remote_span_context(traceparent, tracestate)
        if not expected_context.is_valid:
            assert ours is None
        else:
            assert ours == expected_context
            assert ours.is_remote and ours.trace_flags == expected_context.trace_flags
