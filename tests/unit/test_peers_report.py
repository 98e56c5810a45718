"""The peers benchmark's report: no passwords, one database per system, honest summaries."""

from __future__ import annotations

from benchmarks.peers.run import database_url, summary_rows, without_passwords


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
