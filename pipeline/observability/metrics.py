"""Prometheus metrics of the observability contract (docs/metrics.md lists each one).

Names use the ``pipeline_`` prefix, base units and ``_total`` counters; labels are
low-cardinality (event type, consumer, stage, error class, source), never ids.
Metric objects are module-level so every process shares one set; in Dramatiq's
multi-process workers ``prometheus_client``'s multiprocess mode aggregates them
(``PROMETHEUS_MULTIPROC_DIR``, set up by ``pipeline worker``).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)

events_published = Counter(
    "pipeline_events_published_total",
    "Events whose every copy the broker accepted (marked sent).",
    ["event_type"],
)
events_unrouted = Counter(
    "pipeline_events_unrouted_total",
    "Events marked sent without any subscribed consumer.",
    ["event_type"],
)
publish_attempts = Counter(
    "pipeline_publish_attempts_total",
    "Delivery attempts of events by the publisher, successful or not.",
    ["event_type"],
)
publish_failures = Counter(
    "pipeline_publish_failures_total",
    "Failed delivery attempts, by error class.",
    ["event_type", "error_class"],
)
publish_batch_size = Histogram(
    "pipeline_publish_batch_events",
    "Events claimed per publishing batch.",
    buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500),
)
publish_lag = Histogram(
    "pipeline_publish_lag_seconds",
    "Time from the outbox insert to the broker accepting the event.",
    ["event_type"],
    buckets=LATENCY_BUCKETS,
)
dead_letters = Counter(
    "pipeline_dead_letters_total",
    "Events dead-lettered, by stage (publish or consume).",
    ["stage", "event_type", "error_class"],
)
relay_wakeups = Counter(
    "pipeline_relay_wakeups_total",
    "Relay wake-ups by source: notify, poll or reconnect.",
    ["source"],
)
relay_listener_connected = Gauge(
    "pipeline_relay_listener_connected",
    "1 while the relay's LISTEN connection is up.",
    multiprocess_mode="max",
)
relay_listener_reconnects = Counter(
    "pipeline_relay_listener_reconnects_total",
    "Times the relay re-established its LISTEN connection.",
)
