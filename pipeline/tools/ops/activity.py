"""Per-consumer activity over a recent interval, for ``pipeline status``.

Every figure is counted in Postgres, so it covers all workers wherever they run:
handler runs committed (``inbox.processed_at``), failed handler attempts (the attempt
history, stage consume), duplicate deliveries acknowledged without running the handler
and deliveries the ledger sweep sent again (``delivery_log``, written only on those
paths), and consume-stage dead letters. Rows older than their retention are pruned, so
an interval longer than ``PIPELINE_ATTEMPTS_RETENTION_SECONDS`` undercounts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import psycopg

from pipeline.db.stores.diagnostics import DiagnosticsStore

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_DURATION_SECONDS = 100 * 365 * 86400
_KINDS = {"duplicate": "duplicates", "redelivery": "redeliveries"}


def parse_duration(text: str) -> float:
    """Seconds in ``30s``, ``5m``, ``2h``, ``7d`` or a plain number of seconds."""
    match = _DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a duration (e.g. 30s, 5m, 2h, 7d)")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds > MAX_DURATION_SECONDS:
        raise ValueError(f"{text!r} is longer than 100 years")
    return seconds


@dataclass
class ConsumerActivity:
    processed: int = 0
    processed_per_second: float = 0.0
    failures: int = 0
    duplicates: int = 0
    redeliveries: int = 0
    dead_letters: int = 0

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["processed_per_second"] = round(self.processed_per_second, 3)
        return data


def read_activity(
    conn: psycopg.Connection[Any], schema: str, interval: float, consumers: Iterable[str] = ()
) -> dict[str, ConsumerActivity]:
    """Each consumer's figures for the last ``interval`` seconds; ``consumers`` are listed
    even when nothing happened to them."""
    found = {name: ConsumerActivity() for name in consumers}
    for consumer, kind, count in DiagnosticsStore(schema).activity(conn, interval):
        activity = found.setdefault(consumer, ConsumerActivity())
        setattr(activity, _KINDS.get(kind, kind), count)
    for activity in found.values():
        activity.processed_per_second = activity.processed / interval
    return dict(sorted(found.items()))


def format_activity(activity: dict[str, ConsumerActivity], interval: float) -> list[str]:
    """Lines of the human-readable report (a table, one consumer a row)."""
    if not activity:
        return [f"consumers (last {_span(interval)}): none known (pass --app)"]
    width = max(len(name) for name in activity)
    lines = [
        f"consumers (last {_span(interval)}):",
        f"  {'consumer':<{width}}  processed    rate/s  failures  duplicates  "
        "redeliveries  dead letters",
    ]
    for name, a in activity.items():
        lines.append(
            f"  {name:<{width}}  {a.processed:>9}  {a.processed_per_second:>8.2f}  "
            f"{a.failures:>8}  {a.duplicates:>10}  {a.redeliveries:>12}  {a.dead_letters:>12}"
        )
    return lines


def _span(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
