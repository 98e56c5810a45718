"""The sitting's summary restates its reports and judges each goal on every round."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.sitting_summary import main


def write(path: Path, report: object) -> None:
    path.write_text(json.dumps(report))


def throughput(per_s: float, cpu: float) -> dict[str, object]:
    run = {
        "end_to_end_per_s": per_s,
        "machine_cpu_ms_per_event": cpu,
        "cpu_ms_per_event_by_component": {"producers": cpu / 2, "workers": cpu / 2},
    }
    return {"results": {"observability_default": {"throughput": run}}}


def test_a_goal_met_by_the_median_but_missed_in_one_round_is_not_met_every_round(tmp_path):
    p99 = {"by_round": [9.0, 16.0, 12.0], "median": 12.0, "min": 9.0, "max": 16.0}
    write(
        tmp_path / "peers.json",
        {
            "summary": [
                {
                    "system": "pipeline (observability_default)",
                    "events_per_s_over_rounds": {"median": 3600.0, "min": 3550.0, "max": 3700.0},
                    "machine_cpu_ms_per_event_over_rounds": {
                        "median": 0.6,
                        "min": 0.5,
                        "max": 0.7,
                    },
                    "latency_over_rounds": {"1000": {"p99_ms": p99, "p50_ms": p99}},
                }
            ]
        },
    )
    for round_number, (core, session) in enumerate([(2800, 2500), (2600, 2600)], start=1):
        write(tmp_path / f"api_core_round_{round_number}.json", throughput(core, 0.7))
        write(tmp_path / f"api_session_round_{round_number}.json", throughput(session, 0.8))
    runs = [{"batch_size": 500, "drainers": 2, "events_per_s": 40_000.0}]
    write(tmp_path / "relay_round_1.json", {"throughput": {"runs": runs}})

    assert main([str(tmp_path)]) == 0

    summary = json.loads((tmp_path / "summary.json").read_text())
    goals = summary["goals"]
    assert goals["p99_ms_at_1000"]["median_meets_goal"] is True
    assert goals["p99_ms_at_1000"]["every_round_meets_goal"] is False
    assert goals["end_to_end_events_per_s"]["every_round_meets_goal"] is True
    assert goals["machine_cpu_ms_per_event"]["every_round_meets_goal"] is False
    assert goals["relay_events_per_s"]["median"] == 40_000.0
    assert "tracing_as_shipped_throughput_ratio" not in goals  # no overhead report: not guessed
    ratios = summary["api"]["session_over_core"]["end_to_end_per_s"]["by_round"]
    assert ratios == [round(2500 / 2800, 3), 1.0]
    table = (tmp_path / "summary.md").read_text()
    assert "| p99_ms_at_1000 | 15 | 12 [9-16] | yes | no |" in table
    assert "| pipeline (observability_default) | 3,600 [3,550-3,700] |" in table
