"""What the demo reads back after a run besides its database: the payment API's ledger
and the duplicates the workers' inboxes absorbed (from their Prometheus metrics)."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from pipeline.errors import DemoError
from pipeline.tools.demo.report import CONSUMERS

DUPLICATES_METRIC = "pipeline_inbox_duplicates_total"


def fetch_ledger(api_url: str, run: str) -> dict[str, Any]:
    try:
        response = httpx.get(f"{api_url}/ledger", params={"run": run}, timeout=10.0)
        response.raise_for_status()
        ledger: dict[str, Any] = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise DemoError(f"cannot read the payment API's ledger at {api_url}: {exc}") from None
    return ledger


def multiprocess_duplicates(directory: Path) -> dict[str, int] | None:
    """Per-consumer duplicates from the worker processes' prometheus multiprocess files."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]
    try:
        families = list(registry.collect())
    except (struct.error, OSError, ValueError):  # a file is being created: read again later
        return None
    return _duplicates_from(families)


def scraped_duplicates(url: str) -> dict[str, int] | None:
    """Per-consumer duplicates from a running worker's /metrics endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = httpx.get(url, timeout=5.0)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return _duplicates_from(list(text_string_to_metric_families(response.text)))


def _duplicates_from(families: list[Any]) -> dict[str, int]:
    counts: dict[str, int] = dict.fromkeys(CONSUMERS, 0)
    for family in families:
        for sample in family.samples:
            if sample.name == DUPLICATES_METRIC:
                consumer = sample.labels.get("consumer", "")
                counts[consumer] = counts.get(consumer, 0) + int(sample.value)
    return counts


def duplicates_reader(
    metrics_dir: Path | None, worker_metrics_url: str | None, notes: list[str]
) -> Callable[[], dict[str, int] | None] | None:
    """How to count duplicates absorbed so far: from the workers the demo started (their
    multiprocess files), else from ``--worker-metrics-url`` since now; None if neither."""
    if metrics_dir is not None:
        return lambda: multiprocess_duplicates(metrics_dir)
    url = worker_metrics_url
    if not url:
        notes.append("duplicates absorbed not measured: pass --worker-metrics-url")
        return None
    baseline = scraped_duplicates(url)
    if baseline is None:
        raise DemoError(f"cannot read the workers' metrics at {url}")

    def delta() -> dict[str, int] | None:
        now = scraped_duplicates(url)
        if now is None:
            return None
        return {c: now.get(c, 0) - baseline.get(c, 0) for c in CONSUMERS}

    return delta
