"""Tracing set-up and the no-provider path, each in a fresh interpreter.

OpenTelemetry allows one global tracer provider per process, so every case that
depends on which provider is (or is not) installed runs as a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support import ROOT, OtlpReceiver, otlp_attributes

PRODUCE = """
import json
from pipeline import NewEvent, Settings
from pipeline.outbox import prepare_rows
def headers():
    rows = prepare_rows([NewEvent("order.placed", {"secret": "hunter2"})], Settings())
    return json.loads(rows[0]["headers"])
"""


def run(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run(
        [sys.executable, "-c", PRODUCE + textwrap.dedent(script)],
        env={**base, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_without_a_provider_spans_are_no_ops_and_the_callers_context_propagates():
    result = run(
        """
        from opentelemetry import context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        from pipeline.observability import tracing
        incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        carrier = {"traceparent": incoming, "tracestate": "k=v"}
        ctx = TraceContextTextMapPropagator().extract(carrier)
        token = context.attach(ctx)
        stored = headers()
        assert stored["traceparent"] == incoming, stored
        assert stored["tracestate"] == "k=v", stored
        context.detach(token)
        with tracing.send_span("q", []) as span:
            assert not span.is_recording()
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_console_exporter_prints_create_spans_and_configuration_is_idempotent():
    result = run(
        """
        from pipeline import Settings
        from pipeline.observability import tracing
        first = tracing.configure_tracing(Settings(), "pipeline-test")
        assert tracing.configure_tracing(Settings(), "other") is first
        assert headers()["traceparent"].startswith("00-")
        tracing.shutdown_tracing()
        """,
        OTEL_TRACES_EXPORTER="console",
        OTEL_SERVICE_NAME="from-env",
    )
    assert result.returncode == 0, result.stderr
    assert '"name": "create order.placed"' in result.stdout
    assert '"service.name": "from-env"' in result.stdout  # OTEL_SERVICE_NAME wins
    assert "hunter2" not in result.stdout


def test_exporter_none_installs_no_provider_and_events_still_get_a_context():
    result = run(
        """
        from opentelemetry import trace
        from pipeline import Settings
        from pipeline.observability import tracing
        assert tracing.configure_tracing(Settings(), "pipeline-test") is None
        assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
        print(headers()["traceparent"])
        tracing.shutdown_tracing()
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("00-") and len(result.stdout.strip()) == 55


def test_without_a_provider_a_workflow_made_outside_any_trace_is_one_trace():
    """No provider, no current span: the event gets a new trace that its consumers continue."""
    result = run(
        """
        import uuid
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from pipeline.envelope import ReceivedEvent
        from pipeline.observability import tracing
        created = tracing.start_create_span("order.placed", "e1")
        assert not created.is_recording()
        stored = tracing.span_headers(created)["traceparent"]
        assert int(stored[-2:], 16) & 1, stored  # sampled, as the default sampler samples a root
        assert headers()["traceparent"].split("-")[1] != stored.split("-")[1]  # a trace each
        event = ReceivedEvent(
            id=uuid.uuid4(), type="order.placed", version=1, data={}, source="s",
            time="2026-01-01T00:00:00+00:00", seq=1, traceparent=stored,
        )
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
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


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
    sampler: dict[str, str], expected: str
):
    result = run(
        """
        import json
        from opentelemetry.sdk.trace.sampling import Decision, TraceIdRatioBased
        made = [headers() for _ in range(400)]
        reference = TraceIdRatioBased(0.5)
        rows = []
        for stored in made:
            _, trace_hex, _, flags = stored["traceparent"].split("-")
            by_ratio = reference.should_sample(None, int(trace_hex, 16), "x").decision
            rows.append([int(flags, 16) & 1, by_ratio is Decision.RECORD_AND_SAMPLE])
        print(json.dumps(rows))
        """,
        **sampler,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    sampled = [bool(flag) for flag, _ in rows]
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
def test_bad_tracing_settings_are_clear_errors(env: dict[str, str], message: str):
    result = run(
        """
        from pipeline import Settings
        from pipeline.errors import ConfigurationError
        from pipeline.observability import tracing
        try:
            tracing.configure_tracing(Settings(), "x")
        except ConfigurationError as exc:
            print(exc)
        """,
        **env,
    )
    assert result.returncode == 0, result.stderr
    assert message in result.stdout


def test_sdk_disabled_leaves_tracing_off():
    result = run(
        """
        from pipeline import Settings
        from pipeline.observability import tracing
        assert tracing.configure_tracing(Settings(), "x") is None
        assert "traceparent" not in headers()
        """,
        OTEL_SDK_DISABLED="true",
        OTEL_TRACES_EXPORTER="console",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""


EXPORT_A_WORKFLOW = """
import uuid
from datetime import datetime, timezone
from pipeline import Settings
from pipeline.envelope import OutboxEvent, ReceivedEvent
from pipeline.observability import tracing
tracing.configure_tracing(Settings(), "pipeline-test")
row = prepare_rows([NewEvent("order.placed", {"secret": "hunter2"})], Settings())[0]
outbox = OutboxEvent(
    id=row["id"], seq=1, aggregate_type=None, aggregate_id=None, ordering_key=None,
    event_type="order.placed", event_version=1, payload_json=row["payload"],
    headers_json=row["headers"], attempts=0, created_at=datetime.now(timezone.utc),
)
with tracing.send_span("pipeline.billing", [outbox]):
    pass
received = ReceivedEvent(
    id=row["id"], type="order.placed", version=1, data={"secret": "hunter2"}, source="s",
    time="2026-01-01T00:00:00+00:00", seq=1, traceparent=outbox.headers["traceparent"],
)
with tracing.process_span(received, "billing", 2) as span:
    tracing.record_retry(span, ValueError("card hunter2 declined"), 0.5)
print(row["id"])
tracing.shutdown_tracing()
"""


def test_otlp_http_export_reaches_a_collector(otlp_receiver: OtlpReceiver):
    """The official exporter posts the pipeline's spans; decoded, they carry no payload."""
    result = run(
        EXPORT_A_WORKFLOW,
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp_receiver.endpoint,
    )
    assert result.returncode == 0, result.stderr
    event_id = result.stdout.strip()
    received = otlp_receiver.received
    assert received, "nothing was exported"
    assert {(path, content_type) for path, content_type, _ in received} == {
        ("/v1/traces", "application/x-protobuf")
    }
    assert not any(b"hunter2" in body for _, _, body in received)
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
    result = run(
        """
        import uuid
        from opentelemetry import trace
        from pipeline.envelope import ReceivedEvent
        from pipeline.observability import tracing
        incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        event = ReceivedEvent(id=uuid.uuid4(), type="a", version=1, data={}, source="s",
                              time="", seq=1, traceparent=incoming, tracestate="k=v")
        with tracing.process_span(event, "c", 1) as span:
            assert not span.is_recording()
            assert trace.get_current_span() is span
            stored = headers()
        assert stored["traceparent"] == incoming, stored
        assert stored["tracestate"] == "k=v", stored
        after = headers()["traceparent"]  # detached again after the block: a new trace
        assert after.split("-")[1] != incoming.split("-")[1], after
        plain = ReceivedEvent(id=uuid.uuid4(), type="a", version=1, data={}, source="s",
                              time="", seq=1)
        try:
            with tracing.process_span(plain, "c", 1):
                raise KeyError("handler failed")
        except KeyError:
            print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


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
