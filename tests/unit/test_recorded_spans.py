"""The pipeline's own recorded spans export exactly what the SDK's spans would.

Each scenario runs the pipeline's span functions twice: under a plain SDK provider (the
SDK's ``start_span``) and under the pipeline's provider (``spans.SpanFactory``), with
the same sampler, limits and id sequence. Every exported field must match, and so must
the processors' calls and the SDK's warnings.
"""

from __future__ import annotations

import json
import logging
import uuid
import warnings
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, Decision, Sampler, SamplingResult
from opentelemetry.trace import Status, StatusCode
from opentelemetry.util._once import Once

from pipeline.envelope import OutboxEvent, ReceivedEvent
from pipeline.observability import tracing
from pipeline.observability.spans import PipelineTracerProvider, RecordedSpan
from tests.unit.samplers import BUILT_IN_SAMPLERS

RESOURCE = Resource.create({"service.name": "pipeline-test"})


class _CountingIds(IdGenerator):
    """The same id sequence for both providers; every other trace id is not sampled at 0.5."""

    def __init__(self) -> None:
        self.n = 0

    def generate_span_id(self) -> int:
        self.n += 1
        return 0x1000 + self.n

    def generate_trace_id(self) -> int:
        self.n += 1
        unsampled = self.n % 2 == 0  # TraceIdRatioBased compares the low 64 bits
        return (0xFFFF_FFFF_0000_0000 if unsampled else 0) | self.n


class _RecordOnly(Sampler):
    """Records without sampling, and adds attributes of its own (one a sequence)."""

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None):  # type: ignore[no-untyped-def]
        extra = {**(attributes or {}), "sampler.tags": ["a", "b"], "sampler.ratio": 0.5}
        return SamplingResult(Decision.RECORD_ONLY, extra)

    def get_description(self) -> str:
        return "record-only"


class _Recorder(SpanProcessor):
    """Every started and ended span, sampled or not (the batch processor skips unsampled)."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.ended: list[ReadableSpan] = []

    def on_start(self, span: Any, parent_context: otel_context.Context | None = None) -> None:
        self.started.append(f"{span.name} recording={span.is_recording()}")

    def on_end(self, span: ReadableSpan) -> None:
        self.ended.append(span)


@pytest.fixture
def installed() -> Iterator[Callable[[TracerProvider], None]]:
    """Install a provider globally for one scenario (OpenTelemetry allows one per process)."""
    saved = trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE

    def install(provider: TracerProvider) -> None:
        trace._TRACER_PROVIDER_SET_ONCE = Once()
        trace._TRACER_PROVIDER = None
        trace.set_tracer_provider(provider)
        tracing._tracer.cache_clear()

    yield install
    trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved
    tracing._tracer.cache_clear()


def _outbox_event(traceparent: str | None, n: int) -> OutboxEvent:
    headers = {"traceparent": traceparent} if traceparent else {}
    return OutboxEvent(
        id=uuid.UUID(int=n),
        seq=n,
        aggregate_type=None,
        aggregate_id=None,
        ordering_key=None,
        event_type="order.placed",
        event_version=1,
        payload_json="{}",
        headers_json=json.dumps(headers),
        attempts=0,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
    )


def _received(traceparent: str | None, event_id: int = 1, seq: int = 1) -> ReceivedEvent:
    """An event as a worker receives it, carrying the stored creation context."""
    return ReceivedEvent(
        id=uuid.UUID(int=event_id),
        type="order.placed",
        version=1,
        data={},
        source="test",
        time="2026-01-01T00:00:00Z",
        seq=seq,
        correlation_id="c",
        traceparent=traceparent,
    )


def _workflow() -> None:
    """Every span the pipeline makes, with each way it changes them."""
    app = trace.get_tracer("app").start_span("checkout")
    parent = trace.set_span_in_context(app)
    created = [
        tracing.start_create_span(
            "order.placed", uuid.UUID(int=n), parent=parent, correlation_id="c"
        )
        for n in (1, 2)
    ]
    headers = [tracing.span_headers(span) for span in created]
    for span in created:
        span.end()
    root = tracing.start_create_span("order.placed", uuid.UUID(int=3))  # a trace of its own
    headers.append(tracing.span_headers(root))
    root.end()
    app.end()

    one_trace = [_outbox_event(headers[0].get("traceparent"), 1)]
    mixed = [_outbox_event(h.get("traceparent"), n) for n, h in enumerate(headers, 1)]
    mixed.append(_outbox_event(None, 9))  # no stored context: no link
    with tracing.send_span("pipeline.billing", one_trace):
        pass
    with tracing.send_span("pipeline.billing", [_outbox_event(None, 8)]):  # no links at all
        pass
    with tracing.send_span("pipeline.billing", mixed) as send:
        tracing.record_send_outcome(send, ConnectionError("refused"))
    with pytest.raises(RuntimeError), tracing.send_span("pipeline.billing", one_trace):
        raise RuntimeError("broker down")

    stored = [h.get("traceparent") for h in headers]
    with tracing.process_span(_received(stored[0]), "billing", 1) as span:
        tracing.mark_duplicate(span)
    with tracing.process_span(_received(stored[2]), "billing", 2) as span:
        current = trace.get_current_span()
        current.set_attribute("app.user", "u1")
        current.set_attributes({"app.n": 3, "app.list": [1, 2], "app.long": "x" * 40})
        current.add_event("app.step", {"k": "v", "n": 1}, timestamp=123)
        current.add_link(created[0].get_span_context(), {"why": "because"})
        current.add_link(created[1].get_span_context())  # no attributes
        current.add_link(trace.INVALID_SPAN_CONTEXT)  # invalid: dropped
        current.update_name("process order.placed (renamed)")
        current.record_exception(ValueError("bad"), {"extra": True}, timestamp=456)
        tracing.record_retry(span, TimeoutError(), 1.5)
        follow = tracing.start_create_span("order.paid", uuid.UUID(int=4))  # child of process
        follow.end()
    with tracing.process_span(_received(None), "billing", 3) as span:  # no stored context
        tracing.record_dead_letter(span, "handler failed 5 times")
        span.set_status(Status(StatusCode.OK))
        span.set_status(StatusCode.ERROR, "ignored: OK is final")
    with pytest.raises(KeyError), tracing.process_span(_received(stored[1]), "billing", 4):
        raise KeyError("secret-payload-value")
    with tracing.process_span(_received(stored[1]), "billing", 5) as span:
        span.set_status(StatusCode.ERROR, "described")
        span.set_status(Status(StatusCode.ERROR), "ignored description")
        span.set_status("not a status")  # type: ignore[arg-type]  # ignored
    span.set_attribute("after", "end")  # refused, with the SDK's warning
    span.add_event("after")
    span.update_name("after")
    span.set_status(StatusCode.OK)
    span.end()


def _exported(span: ReadableSpan) -> dict[str, Any]:
    def context(c: trace.SpanContext | None) -> Any:
        if c is None:
            return None
        return (c.trace_id, c.span_id, int(c.trace_flags), c.trace_state.to_header(), c.is_remote)

    def attributes(a: Any) -> Any:
        if a is None:
            return None
        return sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in a.items())

    scope = span.instrumentation_scope
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        info = span.instrumentation_info
    as_json = json.loads(span.to_json())  # what the console exporter prints
    del as_json["start_time"], as_json["end_time"]
    for event in as_json["events"]:
        event["timestamp"] = None
    return {
        "json": as_json,
        "info": (info.name, info.version) if info else None,
        "name": span.name,
        "context": context(span.context),
        "parent": context(span.parent),
        "kind": span.kind,
        "attributes": attributes(span.attributes),
        "dropped_attributes": span.dropped_attributes,
        "events": [
            (
                e.name,
                attributes(e.attributes),
                e.dropped_attributes,
                e.timestamp if e.timestamp in (123, 456) else "now",
            )
            for e in span.events
        ],
        "dropped_events": span.dropped_events,
        "links": [
            (
                context(link.context),
                attributes(link.attributes),
                getattr(link, "dropped_attributes", 0),
            )
            for link in span.links
        ],
        "dropped_links": span.dropped_links,
        "status": (span.status.status_code, span.status.description),
        "resource": dict(span.resource.attributes),
        "scope": (scope.name, scope.version) if scope else None,
        "timed": span.start_time is not None
        and span.end_time is not None
        and span.start_time <= span.end_time,
    }


class _Spy(Sampler):
    """Records what the sampler is asked (the pipeline must ask what the SDK asks)."""

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner
        self.calls: list[Any] = []

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None):  # type: ignore[no-untyped-def]
        parent = trace.get_current_span(parent_context).get_span_context()
        self.calls.append(
            (
                parent.span_id,
                trace_id,
                name,
                kind,
                sorted((attributes or {}).items()),
                type(links).__name__,
                [(link.context.span_id, dict(link.attributes or {})) for link in links or ()],
            )
        )
        return self.inner.should_sample(parent_context, trace_id, name, kind, attributes, links)

    def get_description(self) -> str:
        return self.inner.get_description()


def _run(
    provider_class: type[TracerProvider],
    sampler: Sampler,
    limits: SpanLimits,
    install: Callable[[TracerProvider], None],
    caplog: pytest.LogCaptureFixture,
    *,
    spied: bool = True,
) -> tuple[list[str], list[dict[str, Any]], list[str], list[Any]]:
    """The workflow's spans; ``spied`` wraps the sampler in a spy, so that the factory
    calls it, while an SDK sampler given as it is takes the factory's own decision."""
    spy = _Spy(sampler)
    provider = provider_class(
        sampler=spy if spied else sampler,
        resource=RESOURCE,
        id_generator=_CountingIds(),
        span_limits=limits,
    )
    recorder = _Recorder()
    provider.add_span_processor(recorder)
    install(provider)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="opentelemetry"):
        _workflow()
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry")]
    pipeline_spans = [
        s
        for s in recorder.ended
        if s.instrumentation_scope and s.instrumentation_scope.name == "pipeline"
    ]
    exported = [_exported(s) for s in pipeline_spans]
    return recorder.started, exported, warnings, spy.calls


SAMPLERS = {**BUILT_IN_SAMPLERS, "record_only": _RecordOnly()}
LIMITS = {
    "default": SpanLimits(),
    "tight": SpanLimits(
        max_span_attributes=4,
        max_span_attribute_length=5,
        max_events=1,
        max_links=1,
        max_event_attributes=1,
        max_link_attributes=0,
        max_attribute_length=3,
    ),
    "counts": SpanLimits(max_span_attributes=4, max_events=1, max_links=1, max_link_attributes=0),
    "unlimited": SpanLimits(
        max_span_attributes=SpanLimits.UNSET,
        max_events=SpanLimits.UNSET,
        max_links=SpanLimits.UNSET,
        max_event_attributes=SpanLimits.UNSET,
        max_link_attributes=SpanLimits.UNSET,
    ),
}


@pytest.mark.parametrize("spied", [True, False], ids=["sampler-called", "sampler-as-given"])
@pytest.mark.parametrize("limits", LIMITS.values(), ids=LIMITS.keys())
@pytest.mark.parametrize("sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
def test_the_pipelines_spans_export_what_the_sdks_would(
    sampler: Sampler,
    limits: SpanLimits,
    spied: bool,
    installed: Callable[[TracerProvider], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    expected = _run(TracerProvider, sampler, limits, installed, caplog, spied=spied)
    actual = _run(PipelineTracerProvider, sampler, limits, installed, caplog, spied=spied)
    assert len(actual[1]) == len(expected[1])
    for ours, sdks in zip(actual[1], expected[1], strict=True):  # exported, field by field
        assert {k: v for k, v in ours.items() if v != sdks[k]} == {}, sdks["name"]
    assert actual[0] == expected[0]  # processors' on_start calls
    assert actual[2] == expected[2]  # the SDK's warnings (ended spans)
    assert actual[3] == expected[3]  # what the sampler was asked
    if sampler is not ALWAYS_OFF:
        assert len(actual[1]) >= 10


def test_the_pipelines_provider_records_with_its_own_spans(
    installed: Callable[[TracerProvider], None],
) -> None:
    """Guards the comparison above: it must run the factory, not the SDK's spans."""
    provider = PipelineTracerProvider(resource=RESOURCE)
    recorder = _Recorder()
    provider.add_span_processor(recorder)
    installed(provider)
    span = tracing.start_create_span("order.placed", uuid.UUID(int=1))
    assert isinstance(span, RecordedSpan)
    span.end()
    assert recorder.ended == [span]
    assert recorder.started == ["create order.placed recording=True"]


def test_without_a_processor_nothing_is_recorded(
    installed: Callable[[TracerProvider], None],
) -> None:
    provider = PipelineTracerProvider(resource=RESOURCE)
    installed(provider)
    span = tracing.start_create_span("order.placed", uuid.UUID(int=1))
    assert not span.is_recording() and span.get_span_context().is_valid
    with tracing.send_span("pipeline.billing", [_outbox_event(None, 1)]) as send:
        assert send is trace.INVALID_SPAN


def test_with_the_sdk_disabled_nothing_is_recorded(
    installed: Callable[[TracerProvider], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    provider = PipelineTracerProvider(resource=RESOURCE)
    recorder = _Recorder()
    provider.add_span_processor(recorder)
    installed(provider)
    span = tracing.start_create_span("order.placed", uuid.UUID(int=1))
    span.end()
    with tracing.send_span("pipeline.billing", [_outbox_event(None, 1)]):
        pass
    assert provider.pipeline_spans is None
    assert not span.is_recording()
    assert recorder.started == [] and recorder.ended == []


def test_processors_come_only_from_add_span_processor() -> None:
    from opentelemetry.sdk.trace import SynchronousMultiSpanProcessor

    with pytest.raises(TypeError, match="add_span_processor"):
        PipelineTracerProvider(active_span_processor=SynchronousMultiSpanProcessor())  # type: ignore[arg-type]


def test_the_ratio_sampler_sees_both_sides(
    installed: Callable[[TracerProvider], None], caplog: pytest.LogCaptureFixture
) -> None:
    """Guards the comparison: under ratio sampling some traces are recorded, some not."""
    everything = _run(
        PipelineTracerProvider, SAMPLERS["parentbased_always_on"], SpanLimits(), installed, caplog
    )
    ratio = _run(PipelineTracerProvider, SAMPLERS["traceidratio"], SpanLimits(), installed, caplog)
    assert 0 < len(ratio[1]) < len(everything[1])


def test_spans_from_many_threads_are_each_exported_once_with_their_parents(
    installed: Callable[[TracerProvider], None],
) -> None:
    """Handler threads share the factory and processors: nothing lost, mixed or repeated."""
    import threading

    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = PipelineTracerProvider(resource=RESOURCE)
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=100_000))
    installed(provider)
    threads, per_thread = 8, 250

    def handle(worker: int) -> None:
        for n in range(per_thread):
            created = tracing.start_create_span("order.placed", uuid.UUID(int=worker * 1000 + n))
            headers = tracing.span_headers(created)
            created.end()
            event = _received(headers["traceparent"], worker * 1000 + n, n)
            with tracing.process_span(event, f"consumer-{worker}", 1):
                tracing.start_create_span("order.paid", uuid.UUID(int=n)).end()

    workers = [threading.Thread(target=handle, args=(w,)) for w in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    provider.force_flush()
    spans = exporter.get_finished_spans()
    assert len(spans) == threads * per_thread * 3
    assert len({span.context.span_id for span in spans}) == len(spans)
    by_id = {span.context.span_id: span for span in spans}
    processes = [span for span in spans if span.name == "process order.placed"]
    follow_ups = [span for span in spans if span.name == "create order.paid"]
    assert len(processes) == len(follow_ups) == threads * per_thread
    for follow_up in follow_ups:  # each follow-up is the child of its own thread's span
        parent = by_id[follow_up.parent.span_id]
        assert parent.name == "process order.placed"
        assert parent.context.trace_id == follow_up.context.trace_id
    for process in processes:  # each process span continues its event's create span
        assert by_id[process.parent.span_id].name == "create order.placed"
    provider.shutdown()
