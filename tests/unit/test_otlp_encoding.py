"""The hand-written OTLP encoder against the official one, and the HTTP exporter.

Encoding is checked as parsed-message equality with
``opentelemetry.exporter.otlp.proto.common.trace_encoder.encode_spans`` over real
SDK spans; the exporter runs against a local ``http.server``.
"""

from __future__ import annotations

import gzip
import http.server
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import (
    encode_spans as official_encode_spans,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from pipeline.observability import tracing
from pipeline.observability.otlp import OTLPHttpSpanExporter, encode_spans, parse_headers

REMOTE = SpanContext(
    0x0AF7651916CD43DD8448EB211C80319C,
    0xB7AD6B7169203331,
    is_remote=True,
    trace_flags=TraceFlags(TraceFlags.SAMPLED),
    trace_state=TraceState([("vendor", "opaque"), ("other", "x-1")]),
)
LOCAL = SpanContext(0x1, 0xFFFFFFFFFFFFFFFF, is_remote=False)
EVERY_TYPE = {
    "str": "dramatiq",
    "empty": "",
    "unicode": "zürich ✓ 東京 🚀",
    "long": "x" * 300,  # two-byte length varints
    "huge": "y" * 20_000,  # three-byte length varints
    "k" * 130: "long key",
    "true": True,
    "false": False,
    "zero": 0,
    "small": 7,
    "big": 2**40 + 3,
    "negative": -1,
    "int64.min": -(2**63),
    "int64.max": 2**63 - 1,
    "float": 1.5,
    "float.zero": 0.0,
    "float.negative": -2.25e-300,
    "strings": ["a", "", "ü"],
    "ints": [1, -2, 2**62],
    "floats": [0.5, -1.0],
    "bools": [True, False],
    "empty.array": [],
}


def _provider(resource: Resource, **limits: int) -> tuple[TracerProvider, InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=resource, span_limits=SpanLimits(**limits))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return provider, memory


def _sdk_spans() -> list[ReadableSpan]:
    """Varied spans from two resources and three scopes, finished in interleaved order."""
    first, first_memory = _provider(Resource.create({"service.name": "relay", "n": 3}))
    second, second_memory = _provider(
        Resource({"service.name": "worker"}, schema_url="https://opentelemetry.io/schemas/1.21.0"),
        max_attributes=3,
        max_events=1,
        max_links=1,
        max_event_attributes=1,
        max_link_attributes=1,
    )
    pipeline = first.get_tracer("pipeline")
    versioned = first.get_tracer(
        "app", "1.2.3", schema_url="https://example.com/schema", attributes={"scope.attr": 1}
    )
    other = second.get_tracer("pipeline")

    with pipeline.start_as_current_span(
        "root", kind=SpanKind.SERVER, attributes=EVERY_TYPE
    ) as root:
        root.add_event("plain")
        root.add_event("with attributes", {"error.type": "ValueError", "delay": 0.5, "n": -3})
        root.add_event("stamped", timestamp=1_700_000_000_000_000_001)
        root.set_status(Status(StatusCode.ERROR, "dead-lettered"))
        with pipeline.start_as_current_span("local child", kind=SpanKind.INTERNAL) as child:
            child.set_status(Status(StatusCode.OK))
        for kind in (SpanKind.CLIENT, SpanKind.PRODUCER, SpanKind.CONSUMER):
            versioned.start_span(f"kind {kind.name}", kind=kind).end()

    remote_parent = trace.set_span_in_context(trace.NonRecordingSpan(REMOTE))
    links = [
        Link(REMOTE, {"messaging.message.id": "0f8fad5b-d9cb-469f-a165-70867728950e"}),
        Link(LOCAL),
        Link(REMOTE, {"strings": ["a", "b"], "n": 2**63 - 1, "f": 3.0, "b": False}),
    ]
    with pipeline.start_as_current_span(
        "process order.placed",
        context=remote_parent,
        kind=SpanKind.CONSUMER,
        links=links,
        attributes={"messaging.batch.message_count": 3},
    ):
        with other.start_as_current_span("nested in another resource") as nested:
            nested.set_attribute("pipeline.duplicate", True)
    with other.start_as_current_span(
        "limited",
        context=remote_parent,
        links=links,
        attributes={f"a{i}": i for i in range(5)},
    ) as limited:
        limited.add_event("e1", {"x": 1, "y": 2})
        limited.add_event("e2")
    with pipeline.start_as_current_span("", kind=SpanKind.PRODUCER):  # empty name
        pass
    return [*first_memory.get_finished_spans(), *second_memory.get_finished_spans()]


def _hand_built_spans() -> list[ReadableSpan]:
    """Spans outside the SDK's own containers: plain dicts, no scope, not ended, odd values."""
    resource = Resource.create({"service.name": "hand"})
    unicode_trap = "\udc80"  # a lone surrogate: not UTF-8, so dropped by both encoders
    return [
        ReadableSpan(
            name="hand built",
            context=SpanContext(2**128 - 1, 2**64 - 1, is_remote=False),
            parent=REMOTE,
            resource=resource,
            attributes={
                "bytes": b"\x00\xff",
                "mapping": {"inner": "v", "n": 1, "nested": {"deep": [1, "two"]}},
                "none": None,
                "with none": ["a", None],
                "too big": 2**63,
                "not encodable": object(),  # type: ignore[dict-item]
                "bad text": unicode_trap,
                unicode_trap: "bad key",
                "after": "kept",
            },
            events=(Event("evt", {"k": "v"}, timestamp=5),),
            links=(Link(LOCAL, {"k": "v"}),),
            kind=SpanKind.CLIENT,
            start_time=10,
            end_time=None,
        ),
        ReadableSpan(name="bare", context=LOCAL, resource=resource),
        ReadableSpan(
            name="scoped",
            context=LOCAL,
            resource=resource,
            instrumentation_scope=InstrumentationScope("hand", None),
            status=Status(StatusCode.ERROR),
            start_time=1,
            end_time=2,
        ),
    ]


def _assert_same_as_official(spans: Sequence[ReadableSpan]) -> None:
    ours = ExportTraceServiceRequest.FromString(encode_spans(spans))
    assert ours == official_encode_spans(spans)


def test_sdk_spans_encode_exactly_like_the_official_encoder() -> None:
    spans = _sdk_spans()
    assert len(spans) == 9
    _assert_same_as_official(spans)
    for span in spans:  # each span alone too, so one mismatch is easy to locate
        _assert_same_as_official([span])


def test_a_large_batch_encodes_exactly_like_the_official_encoder() -> None:
    spans = _sdk_spans() * 60  # resource_spans well over 1 MB: four-byte lengths
    _assert_same_as_official(spans)


def test_batch_shape_groups_by_resource_then_scope() -> None:
    request = ExportTraceServiceRequest.FromString(encode_spans(_sdk_spans()))
    assert [len(r.scope_spans) for r in request.resource_spans] == [2, 1]
    first = request.resource_spans[0]
    assert [s.scope.name for s in first.scope_spans] == ["pipeline", "app"]
    assert first.scope_spans[1].schema_url == "https://example.com/schema"
    assert request.resource_spans[1].schema_url.startswith("https://opentelemetry.io/")


def test_hand_built_spans_and_unencodable_attributes_match_the_official_encoder(
    caplog: pytest.LogCaptureFixture,
) -> None:
    spans = _hand_built_spans()
    _assert_same_as_official(spans)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipeline.tracing.otlp"):
        request = ExportTraceServiceRequest.FromString(encode_spans(spans))
    hand = request.resource_spans[0].scope_spans[0].spans[0]
    keys = [kv.key for kv in hand.attributes]
    assert keys == ["bytes", "mapping", "none", "with none", "after"]
    ours = [r.getMessage() for r in caplog.records if r.name == "pipeline.tracing.otlp"]
    assert len(ours) == 4  # one line per dropped attribute, naming its key, not its value
    assert not any("9223372036854775808" in m or "object at" in m for m in ours)


def test_an_empty_batch_encodes_to_nothing() -> None:
    assert encode_spans([]) == official_encode_spans([]).SerializePartialToString() == b""


def test_equal_resources_share_one_group_even_as_distinct_objects() -> None:
    spans = [
        ReadableSpan(name=f"s{i}", context=LOCAL, resource=Resource({"service.name": "same"}))
        for i in range(3)
    ]
    _assert_same_as_official(spans)
    assert len(ExportTraceServiceRequest.FromString(encode_spans(spans)).resource_spans) == 1


# -- the HTTP exporter -----------------------------------------------------------------------


@dataclass
class _Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class _Collector:
    """What the local collector answers (status codes in turn, then 200) and receives."""

    url: str
    statuses: list[int] = field(default_factory=list)
    received: list[_Received] = field(default_factory=list)


@pytest.fixture
def collector() -> Iterator[_Collector]:
    state = _Collector(url="")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            headers = {k.lower(): v for k, v in self.headers.items()}
            state.received.append(_Received(self.path, headers, body))
            self.send_response(state.statuses.pop(0) if state.statuses else 200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture(autouse=True)
def _clean_otlp_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("OTEL_EXPORTER_OTLP_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def batch() -> list[ReadableSpan]:
    return _sdk_spans()


def test_export_posts_the_encoded_batch_with_the_configured_headers(
    collector: _Collector, batch: list[ReadableSpan], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url + "/")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-ignored=generic")
    headers = "Authorization=Basic%20c2VjcmV0, x-b = 2 "
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", headers)
    exporter = OTLPHttpSpanExporter()
    assert exporter.export(batch) is SpanExportResult.SUCCESS
    (request,) = collector.received
    assert request.path == "/v1/traces"
    assert request.body == encode_spans(batch)
    assert request.headers["content-type"] == "application/x-protobuf"
    assert request.headers["authorization"] == "Basic c2VjcmV0"
    assert request.headers["x-b"] == "2"
    assert "x-ignored" not in request.headers  # the traces variable wins, as officially
    assert "content-encoding" not in request.headers
    exporter.shutdown()


def test_gzip_compression_and_a_traces_endpoint_used_as_is(
    collector: _Collector, batch: list[ReadableSpan], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # not used
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", collector.url + "/custom/path")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    exporter = OTLPHttpSpanExporter()
    assert exporter.export(batch) is SpanExportResult.SUCCESS
    (request,) = collector.received
    assert request.path == "/custom/path"
    assert request.headers["content-encoding"] == "gzip"
    assert gzip.decompress(request.body) == encode_spans(batch)


def test_a_retryable_status_is_retried(collector: _Collector, batch: list[ReadableSpan]) -> None:
    collector.statuses[:] = [503]
    exporter = OTLPHttpSpanExporter(collector.url + "/v1/traces", backoff=0.01)
    assert exporter.export(batch) is SpanExportResult.SUCCESS
    assert len(collector.received) == 2
    assert collector.received[0].body == collector.received[1].body


def test_a_client_error_is_not_retried_and_logs_no_secret(
    collector: _Collector, batch: list[ReadableSpan], caplog: pytest.LogCaptureFixture
) -> None:
    collector.statuses[:] = [400, 400]
    exporter = OTLPHttpSpanExporter(
        collector.url + "/v1/traces", headers={"x-api-key": "hunter2"}, backoff=0.01
    )
    with caplog.at_level(logging.WARNING, logger="pipeline.tracing.otlp"):
        assert exporter.export(batch) is SpanExportResult.FAILURE
    assert len(collector.received) == 1
    (record,) = caplog.records
    assert "HTTP 400" in record.getMessage()
    assert "hunter2" not in caplog.text and "dead-lettered" not in caplog.text


def test_retries_stop_at_the_timeout(collector: _Collector, batch: list[ReadableSpan]) -> None:
    collector.statuses[:] = [503] * 50
    exporter = OTLPHttpSpanExporter(collector.url + "/v1/traces", timeout=0.3, backoff=0.05)
    assert exporter.export(batch) is SpanExportResult.FAILURE
    assert 2 <= len(collector.received) < 10


def test_connection_errors_fail_within_the_timeout(batch: list[ReadableSpan]) -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    closed_port = server.server_address[1]
    server.server_close()  # nothing listens there any more
    exporter = OTLPHttpSpanExporter(
        f"http://127.0.0.1:{closed_port}/v1/traces", timeout=0.5, backoff=0.05
    )
    assert exporter.export(batch) is SpanExportResult.FAILURE


def test_after_shutdown_export_fails_without_a_request(
    collector: _Collector, batch: list[ReadableSpan]
) -> None:
    exporter = OTLPHttpSpanExporter(collector.url + "/v1/traces")
    exporter.shutdown()
    exporter.shutdown()  # repeatable
    assert exporter.export(batch) is SpanExportResult.FAILURE
    assert collector.received == []
    assert exporter.force_flush() is True


def test_settings_come_from_the_standard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "3")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "2.5")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", "/etc/ca.pem")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE", "/etc/client.pem")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CLIENT_KEY", "/etc/client.key")
    exporter = OTLPHttpSpanExporter()
    assert exporter.endpoint == "http://localhost:4318/v1/traces"
    assert exporter._timeout == 2.5
    assert exporter._session.verify == "/etc/ca.pem"
    assert exporter._session.cert == ("/etc/client.pem", "/etc/client.key")


def test_header_parsing_decodes_and_never_logs_values(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pipeline.tracing.otlp"):
        parsed = parse_headers("A=1,, b = x%3Dy ,novalue-secret,=orphan-secret")
    assert parsed == {"a": "1", "b": "x=y"}
    assert len(caplog.records) == 2
    assert "secret" not in caplog.text


def test_tracing_uses_this_exporter_for_otlp() -> None:
    assert isinstance(tracing._exporter("otlp"), OTLPHttpSpanExporter)
