"""Metric updates for a message's events, read back through prometheus_client."""

from __future__ import annotations

import uuid

import pytest

from pipeline.envelope import ReceivedEvent
from pipeline.observability import metrics


def _event(event_type: str, created: str) -> ReceivedEvent:
    return ReceivedEvent(
        id=uuid.uuid4(), type=event_type, version=1, data={}, source="t", time=created, seq=1
    )


def test_record_processed_counts_each_type_once_per_event() -> None:
    consumer = f"metrics-test-{uuid.uuid4().hex[:8]}"
    done = [
        (_event("a.happened", "2026-01-01T00:00:00+00:00"), 0.002),
        (_event("a.happened", "2026-01-01T00:00:00+00:00"), 0.003),
        (_event("b.happened", "not a time"), 0.5),
    ]
    metrics.record_processed(consumer, done)

    def value(metric: str, event_type: str, suffix: str) -> float:
        for family in getattr(metrics, metric).collect():
            for sample in family.samples:
                if (
                    sample.name == family.name + suffix
                    and sample.labels.get("consumer") == consumer
                    and sample.labels.get("event_type") == event_type
                ):
                    return float(sample.value)
        raise AssertionError(f"{metric}{suffix} {event_type} missing")

    assert value("inbox_processed", "a.happened", "_total") == 2
    assert value("inbox_processed", "b.happened", "_total") == 1
    assert value("handler_duration", "a.happened", "_count") == 2
    assert value("handler_duration", "a.happened", "_sum") == pytest.approx(0.005)
    assert value("handler_duration", "b.happened", "_count") == 1
    assert value("end_to_end_latency", "a.happened", "_count") == 2
    assert value("end_to_end_latency", "a.happened", "_sum") > 2 * 3600  # created long ago
    # An unparsable creation time leaves that event out of the latency histogram only.
    assert value("end_to_end_latency", "b.happened", "_count") == 0
