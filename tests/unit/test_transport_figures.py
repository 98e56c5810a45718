"""docs/benchmarks.md's Redis-and-RabbitMQ table states what the sitting's result file holds.

The table is the only place a reader finds the transports' throughput and latency side by
side; a sitting re-run (or a table edited by hand) must not leave the two apart, and the
table must not be dropped while the results stay.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ROWS = {
    "Redis": "redis",
    "RabbitMQ, one node": "rabbitmq",
    "RabbitMQ, three nodes": "rabbitmq-cluster",
}


def spread(figures: dict[str, Any]) -> str:
    """``median [min-max]`` rounded to whole units, as the table writes them."""
    return "{:,} [{:,}-{:,}]".format(*(round(figures[k]) for k in ("median", "min", "max")))


def expected_row(summary: dict[str, Any]) -> list[str]:
    cells = [spread(summary["throughput_events_per_s"])]
    for rate in (200, 1000):
        latency = summary[f"latency_at_{rate}_per_s"]
        cells.append(f"{spread(latency['p50_ms'])} / {spread(latency['p99_ms'])}")
    return cells


def documented_rows() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    section = text.split("## Redis and RabbitMQ", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] in ROWS:
            rows[cells[0]] = cells[1:]
    return rows


def test_the_transport_table_matches_the_sittings_results() -> None:
    results = json.loads(
        (ROOT / "benchmarks" / "results" / "transports" / "end_to_end.json").read_text()
    )
    summary = results["transports_summary"]
    assert "1 event(s) per transaction" in results["setup"]["producers"]
    rows = documented_rows()
    assert set(rows) == set(ROWS), "a transport's row is missing from docs/benchmarks.md"
    for label, transport in ROWS.items():
        assert rows[label] == expected_row(summary[transport]), label


def test_figures_are_written_as_the_table_writes_them() -> None:
    summary = {
        "throughput_events_per_s": {"median": 231.0, "min": 138.0, "max": 337.2},
        "latency_at_200_per_s": {
            "p50_ms": {"median": 60.3, "min": 53.4, "max": 739.1},
            "p99_ms": {"median": 567.7, "min": 473.2, "max": 2199.47},
        },
        "latency_at_1000_per_s": {
            "p50_ms": {"median": 349.5, "min": 127.1, "max": 438.9},
            "p99_ms": {"median": 1964.4, "min": 825.6, "max": 2990.8},
        },
    }
    row = expected_row(summary)
    assert row == [
        "231 [138-337]",
        "60 [53-739] / 568 [473-2,199]",
        "350 [127-439] / 1,964 [826-2,991]",
    ]
