"""What the demo reads back after a run besides its database: the payment API's ledger
and the duplicates the workers' inboxes absorbed (read by :mod:`pipeline.tools.harness.outcomes`),
from the workers it started or from ``--worker-metrics-url``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from pipeline.errors import DemoError
from pipeline.tools.demo.report import CONSUMERS
from pipeline.tools.harness import outcomes


def fetch_ledger(api_url: str, run: str) -> dict[str, Any]:
    try:
        return outcomes.fetch_ledger(api_url, run)
    except outcomes.LedgerUnavailable as exc:
        raise DemoError(f"cannot read the payment API's ledger at {api_url}: {exc}") from None


def scraped_duplicates(url: str) -> dict[str, int] | None:
    """Per-consumer duplicates from a running worker's /metrics endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = httpx.get(url, timeout=5.0)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return outcomes.duplicates_in(text_string_to_metric_families(response.text), CONSUMERS)


def duplicates_reader(
    metrics_dir: Path | None, worker_metrics_url: str | None, notes: list[str]
) -> Callable[[], dict[str, int] | None] | None:
    """How to count duplicates absorbed so far: from the workers the demo started (their
    multiprocess files), else from ``--worker-metrics-url`` since now; None if neither."""
    if metrics_dir is not None:
        return lambda: outcomes.multiprocess_duplicates([metrics_dir], CONSUMERS)
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
