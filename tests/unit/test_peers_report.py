"""The peers benchmark's report: no passwords, one database per system, honest summaries."""

from __future__ import annotations

from benchmarks.peers.run import (
    database_url,
    rotated,
    rounds_summary,
    summary_rows,
    summary_table,
    without_passwords,
)


def test_passwords_are_masked_in_recorded_commands() -> None:
    command = (
        "python -m benchmarks.peers --database-url postgresql://app:s3cret@db:5432/app"
        " --redis-url redis://:hunter2@cache:6379/0"
    )
    masked = without_passwords(command)
    assert "s3cret" not in masked and "hunter2" not in masked
    assert "postgresql://app:***@db:5432/app" in masked
    assert "redis://:***@cache:6379/0" in masked
    assert without_passwords("postgresql://postgres@127.0.0.1:5432/x") == (
        "postgresql://postgres@127.0.0.1:5432/x"
    )


def test_each_system_gets_its_own_database_on_the_same_server() -> None:
    assert (
        database_url("postgresql://app:pw@db:5432/postgres?sslmode=require", "peers_pgqueuer_1")
        == "postgresql://app:pw@db:5432/peers_pgqueuer_1?sslmode=require"
    )


def _point(rate: float, reached: float, sustained: bool = True) -> dict[str, object]:
    return {
        "offered_events_per_s": rate,
        "achieved_commit_rate": reached,
        "sustained": sustained,
        "latency_ms": {"p50": 2.0, "p99": 9.0},
    }


def test_a_rate_the_producers_could_not_commit_is_not_sustained() -> None:
    run = {
        "throughput": {"end_to_end_per_s": 600.0, "machine_cpu_ms_per_event": 3.0},
        "latency": [_point(200, 200.4), _point(1000, 856.4)],
    }
    results = {
        "pgqueuer": {"status": "measured", "runs": {"default": run}},
        "faststream-outbox": {"status": "not installed", "error": "ImportError: x"},
    }
    measured, missing = summary_rows(results)
    assert measured["system"] == "pgqueuer" and measured["events_per_s"] == 600.0
    assert measured["200/s sustained"] is True
    assert measured["1000/s sustained"] is False
    assert measured["1000/s commits/s"] == 856.4
    assert missing == {"system": "faststream-outbox", "status": "not installed"}


def test_each_round_starts_one_system_later() -> None:
    systems = ["pipeline", "pgqueuer", "faststream-outbox"]
    orders = [rotated(systems, r) for r in range(4)]
    assert orders[0] == systems
    assert orders[1] == ["pgqueuer", "faststream-outbox", "pipeline"]
    assert orders[2] == ["faststream-outbox", "pipeline", "pgqueuer"]
    assert orders[3] == systems
    assert {order[0] for order in orders[:3]} == set(systems)


def _round(index: int, pipeline: float | None, peer: float, p99: float) -> dict[str, object]:
    peer_run = {
        "throughput": {"end_to_end_per_s": peer, "machine_cpu_ms_per_event": 3.0},
        "latency": [{**_point(200, 200.1), "latency_ms": {"p50": 2.0, "p99": p99}}],
    }
    results: dict[str, object] = {"pgqueuer": {"status": "measured", "runs": {"default": peer_run}}}
    if pipeline is None:
        results["pipeline"] = {"status": "failed", "error": "RuntimeError: x"}
    else:
        components = {"relay": 0.05, "workers": 0.2}
        run = {
            "throughput": {
                "end_to_end_per_s": pipeline,
                "machine_cpu_ms_per_event": 1.0,
                "cpu_ms_per_event_by_component": components,
            },
            "latency": [_point(200, 200.2, sustained=index != 2)],
        }
        results["pipeline"] = {"status": "measured", "runs": {"observability_default": run}}
    return {"round": index, "results": results, "summary": summary_rows(results)}


def test_rounds_summary_keeps_every_round_and_takes_medians_of_per_round_ratios() -> None:
    rounds = [
        _round(0, 2000.0, 500.0, 9.0),
        _round(1, None, 600.0, 30.0),
        _round(2, 1800.0, 900.0, 12.0),
    ]
    pipeline, pgqueuer = rounds_summary(["pipeline", "pgqueuer"], rounds, [200])
    assert pipeline["system"] == "pipeline (observability_default)"
    assert pipeline["events_per_s_over_rounds"]["by_round"] == [2000.0, None, 1800.0]
    assert pipeline["events_per_s"] == 1900.0 and pipeline["rounds_measured"] == 2
    assert pipeline["status_by_round"] == ["measured", "failed", "measured"]
    assert pipeline["200/s sustained"] is False  # not sustained in round 2
    assert pipeline["cpu_ms_per_event_by_component_by_round"][1] is None
    ratio = pipeline["events_per_s_over_peer"]["pgqueuer"]
    assert ratio["by_round"] == [4.0, None, 2.0] and ratio["median"] == 3.0
    at_200 = pgqueuer["latency_over_rounds"]["200"]
    assert at_200["p99_ms"]["by_round"] == [9.0, 30.0, 12.0]
    assert pgqueuer["200/s p99 ms"] == 12.0 and at_200["p99_max_over_rounds"] == 30.0
    assert pgqueuer["events_per_s"] == 600.0 and pgqueuer["200/s sustained"] is True
    table = summary_table([pipeline, pgqueuer], [200])
    assert "600.0 [500.0-900.0]" in table and "12.0 (30.0)" in table


def test_a_system_never_measured_keeps_its_status() -> None:
    rounds = [_round(0, None, 500.0, 9.0)]
    pipeline, _ = rounds_summary(["pipeline", "pgqueuer"], rounds, [200])
    assert pipeline == {"system": "pipeline", "status": "failed", "status_by_round": ["failed"]}
