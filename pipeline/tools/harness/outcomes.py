"""What a demo or drill run reads back besides its database: the payment API's ledger, and
the duplicates the workers' inboxes absorbed (from their Prometheus metrics)."""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx

DUPLICATES_METRIC = "pipeline_inbox_duplicates_total"


class LedgerUnavailable(Exception):
    """The payment API's ledger could not be read."""


def fetch_ledger(api_url: str, run: str, timeout: float = 10.0) -> dict[str, Any]:
    """The payment API's ledger of one run (``GET /ledger?run=``)."""
    try:
        response = httpx.get(f"{api_url}/ledger", params={"run": run}, timeout=timeout)
        response.raise_for_status()
        ledger: dict[str, Any] = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise LedgerUnavailable(str(exc)) from None
    return ledger


def duplicates_in(families: Iterable[Any], consumers: Sequence[str]) -> dict[str, int]:
    """Duplicates absorbed per consumer in these metric families (every consumer listed)."""
    counts: Counter[str] = Counter(dict.fromkeys(consumers, 0))
    for family in families:
        for sample in family.samples:
            if sample.name == DUPLICATES_METRIC:
                counts[sample.labels.get("consumer", "")] += int(sample.value)
    return dict(counts)


def multiprocess_duplicates(
    directories: Sequence[Path], consumers: Sequence[str]
) -> dict[str, int] | None:
    """Duplicates per consumer, summed over the worker processes' prometheus multiprocess
    directories (one per worker incarnation); None when none could be read."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    families: list[Any] = []
    readable = False
    for directory in directories:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]
        try:
            families += list(registry.collect())
        except (struct.error, OSError, ValueError):  # a file being created, or cut short
            continue
        readable = True
    return duplicates_in(families, consumers) if readable else None
