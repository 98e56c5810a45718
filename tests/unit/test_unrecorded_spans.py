"""Unrecorded spans (a pipeline provider with no processor) carry the SDK's context."""

from __future__ import annotations

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import SpanKind, TraceFlags, TraceState

from pipeline.observability.spans import PipelineTracerProvider
from tests.unit.samplers import BUILT_IN_SAMPLERS

LOW_TRACE_ID = 0x0000000000000000_0FFFFFFFFFFFFFFF  # sampled at ratio 0.5
HIGH_TRACE_ID = 0xFFFFFFFFFFFFFFFF_FFFFFFFFFFFFFFFF  # not sampled at ratio 0.5


class _SameIds(RandomIdGenerator):
    """Root trace ids from a fixed list, so the SDK and the pipeline see the same ones."""

    def __init__(self, trace_ids: list[int]) -> None:
        self.trace_ids = list(trace_ids)

    def generate_trace_id(self) -> int:
        return self.trace_ids.pop(0)


class _StateWriter(Sampler):
    """Samples every trace and writes its own trace state (not the parent's)."""

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None):  # type: ignore[no-untyped-def]
        return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, TraceState([("me", "1")]))

    def get_description(self) -> str:
        return "state-writer"


class _NotRandomIds(_SameIds):
    def is_trace_id_random(self) -> bool:
        return False


def _parent(flags: int | None, trace_id: int, state: str = "") -> otel_context.Context | None:
    if flags is None:
        return None
    if flags < 0:  # an explicitly invalid parent: a root, as with none
        return trace.set_span_in_context(trace.INVALID_SPAN)
    span_context = trace.SpanContext(
        trace_id,
        0xB7AD6B7169203331,
        is_remote=True,
        trace_flags=TraceFlags(flags),
        trace_state=TraceState.from_header([state]) if state else None,
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context))


SAMPLERS = {**BUILT_IN_SAMPLERS, "state-writer": _StateWriter()}


@pytest.mark.parametrize("sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
@pytest.mark.parametrize(
    ("parent_flags", "state"),
    [(None, ""), (-1, ""), (0x01, ""), (0x00, ""), (0x01, "vendor=abc"), (0x03, "")],
    ids=[
        "root",
        "invalid-parent",
        "sampled-parent",
        "unsampled-parent",
        "parent-with-state",
        "random-id-parent",
    ],
)
@pytest.mark.parametrize("trace_id", [LOW_TRACE_ID, HIGH_TRACE_ID], ids=["low", "high"])
@pytest.mark.parametrize("id_generator", [_SameIds, _NotRandomIds], ids=["random", "not-random"])
def test_ids_flags_and_state_match_the_sdks(
    sampler: Sampler,
    parent_flags: int | None,
    state: str,
    trace_id: int,
    id_generator: type[_SameIds],
) -> None:
    """``trace_id`` is the root's (from the id generator) or the parent's."""
    sdk = TracerProvider(sampler=sampler, id_generator=id_generator([trace_id]))
    ours = PipelineTracerProvider(sampler=sampler, id_generator=id_generator([trace_id]))
    parent = _parent(parent_flags, trace_id, state)
    attributes = {"messaging.destination.name": "order.placed"}

    expected = (
        sdk.get_tracer("pipeline")
        .start_span("create order.placed", parent, SpanKind.PRODUCER, attributes)
        .get_span_context()
    )
    span = ours.pipeline_spans.start("create order.placed", SpanKind.PRODUCER, parent, attributes)
    actual = span.get_span_context()

    assert not span.is_recording()
    assert actual.trace_id == expected.trace_id
    assert actual.trace_flags == expected.trace_flags
    assert actual.trace_state == expected.trace_state
    assert actual.is_remote is False and actual.is_valid
    if parent is not None:
        assert actual.span_id != trace.get_current_span(parent).get_span_context().span_id


def test_with_no_parent_given_the_current_span_is_the_parent() -> None:
    provider = PipelineTracerProvider()
    current = trace.NonRecordingSpan(
        trace.SpanContext(LOW_TRACE_ID, 0x1234, is_remote=False, trace_flags=TraceFlags(1))
    )
    token = otel_context.attach(trace.set_span_in_context(current))
    try:
        span = provider.pipeline_spans.start("create x", SpanKind.PRODUCER, None, {})
    finally:
        otel_context.detach(token)
    assert span.get_span_context().trace_id == LOW_TRACE_ID
    assert span.get_span_context().trace_flags.sampled


def test_the_sdks_samplers_are_decided_without_a_call_and_others_are_called() -> None:
    """Guards the comparisons: built-in samplers take the factory's own decision, while a
    subclass with its own ``should_sample`` (or any other sampler) is asked."""
    from opentelemetry.sdk.trace.sampling import (
        ALWAYS_ON,
        Decision,
        ParentBased,
        ParentBasedTraceIdRatio,
        SamplingResult,
        TraceIdRatioBased,
    )

    from pipeline.observability.spans import _builtin_decision

    class Stubborn(ParentBased):
        def should_sample(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return SamplingResult(Decision.RECORD_ONLY)

    remote_unsampled = trace.SpanContext(1, 2, is_remote=True)
    low, high = 1, (1 << 64) - 1  # a ratio sampler compares the low 64 bits
    root = trace.INVALID_SPAN_CONTEXT
    assert _builtin_decision(ParentBased(ALWAYS_ON), root, low) is Decision.RECORD_AND_SAMPLE
    assert _builtin_decision(ParentBased(ALWAYS_ON), remote_unsampled, low) is Decision.DROP
    assert _builtin_decision(TraceIdRatioBased(0.5), root, low) is Decision.RECORD_AND_SAMPLE
    assert _builtin_decision(TraceIdRatioBased(0.5), root, high) is Decision.DROP
    at_bound = TraceIdRatioBased(0.5).bound  # below the bound is sampled, the bound is not
    assert _builtin_decision(TraceIdRatioBased(0.5), root, at_bound) is Decision.DROP
    assert (
        _builtin_decision(TraceIdRatioBased(0.5), root, at_bound - 1) is Decision.RECORD_AND_SAMPLE
    )
    assert _builtin_decision(ParentBasedTraceIdRatio(0.5), root, high) is Decision.DROP
    assert _builtin_decision(Stubborn(ALWAYS_ON), root, low) is None
    patched = ParentBased(ALWAYS_ON)
    patched.should_sample = Stubborn(ALWAYS_ON).should_sample  # type: ignore[method-assign]
    assert _builtin_decision(patched, root, low) is None
    assert _builtin_decision(ParentBased(Stubborn(ALWAYS_ON)), root, low) is None
