"""Tracing set-up and the no-provider path, each in a fresh interpreter.

OpenTelemetry allows one global tracer provider per process, so every case that
depends on which provider is (or is not) installed runs as a subprocess.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest

from tests.support import ROOT

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


class _Collector(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, str, bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, self.headers["Content-Type"], body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def otlp_collector() -> Iterator[tuple[str, list[tuple[str, str, bytes]]]]:
    received: ClassVar[list[tuple[str, str, bytes]]] = []
    handler = type("Handler", (_Collector,), {"received": received})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def test_otlp_http_export_reaches_a_collector(otlp_collector):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    endpoint, received = otlp_collector
    result = run(
        """
        from pipeline import Settings
        from pipeline.observability import tracing
        tracing.configure_tracing(Settings(), "pipeline-test")
        headers()
        tracing.shutdown_tracing()
        """,
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
    )
    assert result.returncode == 0, result.stderr
    assert received, "nothing was exported"
    path, content_type, body = received[0]
    assert path == "/v1/traces" and content_type == "application/x-protobuf"
    request = ExportTraceServiceRequest.FromString(body)
    (resource_spans,) = request.resource_spans
    service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert service["service.name"] == "pipeline-test"
    names = [s.name for scope in resource_spans.scope_spans for s in scope.spans]
    assert names == ["create order.placed"]
    assert b"hunter2" not in body


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
