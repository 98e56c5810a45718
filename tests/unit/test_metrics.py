"""Batched metric updates against prometheus_client's own per-value ones."""

from __future__ import annotations

import math
import uuid

import pytest
from prometheus_client import CollectorRegistry, Histogram

from pipeline.envelope import ReceivedEvent
from pipeline.observability import metrics

BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0)
AMOUNTS = [
    0.0,
    -0.5,
    0.001,  # exactly on a bound: counted in that bucket (le)
    0.0010001,
    0.05,
    0.05,
    1.0,
    9.99,
    10.0,
    10.5,  # above every finite bound: +Inf only
    math.inf,
    math.nan,  # in no bucket, as observe() does it
]


def _samples(histogram: Histogram) -> dict[tuple[str, str], float]:
    values: dict[tuple[str, str], float] = {}
    for metric in histogram.collect():
        for sample in metric.samples:
            values[(sample.name, sample.labels.get("le", ""))] = sample.value
    return values


def _histogram(name: str) -> Histogram:
    return Histogram(name, "test", buckets=BUCKETS, registry=CollectorRegistry())


@pytest.mark.parametrize("amounts", [AMOUNTS[:-1], AMOUNTS[:1], [], [0.2] * 7])
def test_observe_many_matches_observe_per_value(amounts: list[float]) -> None:
    one_by_one, batched = _histogram("one_by_one"), _histogram("batched")
    for amount in amounts:
        one_by_one.observe(amount)
    metrics.observe_many(batched, amounts)
    expected = {
        (n.replace("one_by_one", "batched"), le): v for (n, le), v in _samples(one_by_one).items()
    }
    got = _samples(batched)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key
    assert got[("batched_count", "")] == len([a for a in amounts if not math.isnan(a)])


def test_observe_many_keeps_nan_out_of_every_bucket() -> None:
    one_by_one, batched = _histogram("one_by_one"), _histogram("batched")
    for amount in AMOUNTS:
        one_by_one.observe(amount)
    metrics.observe_many(batched, AMOUNTS)
    buckets = {le: v for (name, le), v in _samples(batched).items() if name.endswith("_bucket")}
    expected = {le: v for (name, le), v in _samples(one_by_one).items() if name.endswith("_bucket")}
    assert buckets == expected
    assert buckets["+Inf"] == len(AMOUNTS) - 1


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
