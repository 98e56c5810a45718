"""The sitting's summary restates its reports and judges each goal on every round."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.sitting_summary import main


def write(path: Path, report: object) -> None:
    path.write_text(json.dumps(report))


def spread(*values: float) -> dict[str, object]:
    ordered = sorted(values)
    return {
        "by_round": list(values),
        "median": ordered[len(ordered) // 2],
        "min": ordered[0],
        "max": ordered[-1],
    }


def row(system: str, per_s: list[float], cpu: list[float], latency: dict) -> dict[str, object]:
    return {
        "system": system,
        "events_per_s_over_rounds": spread(*per_s),
        "machine_cpu_ms_per_event_over_rounds": spread(*cpu),
        "latency_over_rounds": latency,
    }


def at(p50: list[float], p99: list[float], cpu: list[float] | None = None) -> dict[str, object]:
    figures = {"p50_ms": spread(*p50), "p99_ms": spread(*p99)}
    if cpu:
        figures["machine_cpu_ms_per_event"] = spread(*cpu)
    return figures


def peers(pipeline_per_s: list[float]) -> dict[str, object]:
    return {
        "summary": [
            row(
                "pipeline (observability_default)",
                pipeline_per_s,
                [0.6, 0.6, 0.6],
                {
                    "200": at([1.6, 1.6, 1.6], [4.0, 4.0, 4.0], cpu=[1.0, 1.5, 1.1]),
                    "1000": at([2.0, 2.0, 2.0], [9.0, 16.0, 12.0]),
                },
            ),
            row(
                "pgqueuer",
                [1000.0, 1000.0, 1000.0],
                [1.0, 1.0, 1.0],
                {"200": at([1.0, 1.0, 1.0], [2.0, 2.0, 2.0]), "1000": at([3, 3, 3], [6, 6, 6])},
            ),
            row("pgbench", [10_000.0, 10_000.0, 10_000.0], [0.1, 0.1, 0.1], {}),
            row("pgbench (prepared)", [12_000.0, 12_000.0, 12_000.0], [0.1, 0.1, 0.1], {}),
        ]
    }


def throughput(per_s: float, cpu: float) -> dict[str, object]:
    run = {
        "end_to_end_per_s": per_s,
        "machine_cpu_ms_per_event": cpu,
        "cpu_ms_per_event_by_component": {"producers": cpu / 2, "workers": cpu / 2},
    }
    return {"results": {"observability_default": {"throughput": run}}}


def test_a_goal_met_by_the_median_but_missed_in_one_round_is_not_met_every_round(tmp_path):
    for round_number, (core, session) in enumerate([(2800, 2500), (2600, 2600)], start=1):
        write(tmp_path / f"api_core_round_{round_number}.json", throughput(core, 0.7))
        write(tmp_path / f"api_session_round_{round_number}.json", throughput(session, 0.8))
    write(tmp_path / "peers.json", peers([2500.0, 1900.0, 2100.0]))
    write(tmp_path / "peers_contended.json", peers([1500.0, 1400.0, 1300.0]))
    runs = [{"batch_size": 500, "drainers": 2, "events_per_s": 40_000.0}]
    write(tmp_path / "relay_round_1.json", {"throughput": {"runs": runs}})
    idle = {"seconds": 30, "relay_and_workers_percent_of_one_core": 0.9}
    write(tmp_path / "idle.json", {"results": {"observability_default": {"idle": idle}}})

    assert main([str(tmp_path)]) == 0

    summary = json.loads((tmp_path / "summary.json").read_text())
    ratios = summary["api"]["session_over_core"]["end_to_end_per_s"]["by_round"]
    assert ratios == [round(2500 / 2800, 3), 1.0]
    goals = summary["goals"]
    quiet = goals["quiet: throughput_over_pgqueuer"]
    assert quiet["by_round"] == [2.5, 1.9, 2.1]  # within each round, not of the medians
    assert quiet["median_meets_goal"] is True and quiet["every_round_meets_goal"] is False
    assert goals["contended: throughput_over_pgqueuer"]["median"] == 1.4
    assert goals["quiet: p50_at_200_over_pgqueuer"]["median"] == 1.6  # goal 1.5: missed
    assert goals["quiet: p50_at_200_over_pgqueuer"]["median_meets_goal"] is False
    assert goals["quiet: p99_at_1000_over_pgqueuer"]["by_round"] == [1.5, 2.667, 2.0]
    assert "contended: p99_at_1000_over_pgqueuer" not in goals  # compared quiet only
    cpu = goals["quiet: cpu_per_event_at_200_over_full_throughput"]
    assert cpu["by_round"] == [1.667, 2.5, 1.833]
    assert goals["quiet: throughput_over_pgbench_commits"]["by_round"] == [0.25, 0.19, 0.21]
    assert goals["relay_events_per_s"]["median"] == 40_000.0
    assert goals["idle_relay_and_workers_percent_of_one_core"]["every_round_meets_goal"] is True
    assert "tracing_as_shipped_throughput_ratio" not in goals  # no overhead report: not guessed
    table = (tmp_path / "summary.md").read_text()
    assert "| quiet: throughput_over_pgqueuer | 2 | 2.1 [1.9-2.5] | yes | no |" in table
    assert "contended machine:" in table
    assert "| pgbench | 10,000 [10,000-10,000] | 0.1 [0.1-0.1] |" in table
