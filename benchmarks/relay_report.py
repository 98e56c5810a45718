"""The relay benchmark's report: goals met or not, markdown tables, the JSON file."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import redis

from benchmarks.relay_context import BENCH_DIR

SEGMENTS = ("total", "wake", "commit_to_notify", "notify_to_claim", "claim", "deliver", "observe")


GOAL_THROUGHPUT = 50_000.0


GOAL_IDLE_P50_MS = 3.0


GOAL_RATIO = 0.9


def goals(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's three goals, with the measured value and whether it was met."""
    verdicts: dict[str, Any] = {}
    if "throughput" in report:
        runs = report["throughput"]["runs"]
        best = max(runs, key=lambda r: r["events_per_s"])
        verdicts["relay_throughput"] = {
            "goal": f">= {GOAL_THROUGHPUT:,.0f} events/s",
            "best": best["events_per_s"],
            "best_config": {"batch_size": best["batch_size"], "drainers": best["drainers"]},
            "met": best["events_per_s"] >= GOAL_THROUGHPUT,
        }
    if "wakeup_latency" in report:
        notify = next(c for c in report["wakeup_latency"]["cases"] if c["case"] == "notify")
        p50 = notify["latency"].get("p50_ms")
        notified = notify["breakdown"].get("notified", {}).get("total", {})
        verdicts["idle_wakeup_p50"] = {
            "goal": f"p50 <= {GOAL_IDLE_P50_MS} ms (notify path, idle)",
            "p50_ms": p50,
            "p50_ms_events_woken_by_their_notify": notified.get("p50_ms"),
            "met": p50 is not None and p50 <= GOAL_IDLE_P50_MS,
        }
    if "producer_with_relay" in report:
        ratio = report["producer_with_relay"]["ratios_outbox_over_business"].get("32")
        verdicts["producer_cost_32"] = {
            "goal": f"outbox/business >= {GOAL_RATIO} at 32 producers, real relay running",
            "ratio": ratio,
            "met": ratio is not None and ratio >= GOAL_RATIO,
        }
    return verdicts


def print_tables(report: dict[str, Any]) -> None:
    """Markdown tables of the results (docs/benchmarks.md copies them)."""
    if "throughput" in report:
        print(
            "\n| batch_size | drainers | events | seconds | events/s | messages/s | "
            "relay CPU | Postgres CPU | other CPU | verified |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in report["throughput"]["runs"]:
            cpu = r["cpu"]
            print(
                f"| {r['batch_size']} | {r['drainers']} | {r['events']:,} | {r['seconds']} | "
                f"{r['events_per_s']:,.0f} | {r['messages_per_s']:,.0f} | "
                f"{cpu.get('relay_pct')}% | {cpu.get('postgres_pct')}% | "
                f"{cpu.get('other_pct')}% | {r['verified']} |"
            )
        names = list(report["throughput"]["runs"][0]["phases"])
        print("\n| batch_size | drainers | " + " | ".join(names) + " |")
        print("|---:|---:|" + "---:|" * len(names))
        for r in report["throughput"]["runs"]:
            cells = [
                f"{r['phases'][n]['ms_per_batch']} ms ({r['phases'][n]['pct']}%)" for n in names
            ]
            print(f"| {r['batch_size']} | {r['drainers']} | " + " | ".join(cells) + " |")
    if "wakeup_latency" in report:
        print(
            "\n| case | events | offered/s | p50 ms | p90 ms | p99 ms | max ms | relay wake-ups |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for c in report["wakeup_latency"]["cases"]:
            lat = c["latency"]
            wake = ", ".join(f"{k} {v}" for k, v in c["relay_wakeups"].items() if v)
            print(
                f"| {c['case']} | {lat['n']} | {c['offered_per_s']} | {lat.get('p50_ms')} | "
                f"{lat.get('p90_ms')} | {lat.get('p99_ms')} | {lat.get('max_ms')} | {wake} |"
            )
        print("\n| case | events | " + " | ".join(f"{n} p50/p99 ms" for n in SEGMENTS) + " |")
        print("|---|---:|" + "---:|" * len(SEGMENTS))
        for c in report["wakeup_latency"]["cases"]:
            for group, named in c["breakdown"].items():
                cells = [
                    f"{named[n].get('p50_ms')} / {named[n].get('p99_ms')}" if n in named else ""
                    for n in SEGMENTS
                ]
                count = named["total"]["n"]
                print(f"| {c['case']} ({group}) | {count} | " + " | ".join(cells) + " |")
    if "producer_with_relay" in report:
        section = report["producer_with_relay"]
        print(
            "\n| clients | mode | tx/s | commit p50 ms | commit p99 ms | NOTIFYs | "
            "relay busy | backlog max | relay CPU (process + its backends) | other CPU | "
            "outbox/business |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in section["runs"]:
            rel = r["relay"]
            ratio = (
                section["ratios_outbox_over_business"].get(str(r["clients"]))
                if r["mode"] == "outbox"
                else None
            )
            print(
                f"| {r['clients']} | {r['mode']} | {r['tx_per_s']:,.0f} | "
                f"{r['latency_ms']['commit_p50']} | {r['latency_ms']['commit_p99']} | "
                f"{rel['notifies']} | {rel['busy_fraction']} | {rel['backlog_max']} | "
                f"{rel['relay_process_cpu_pct']}% + {rel['relay_backends_cpu_pct']}% | "
                f"{rel.get('other_tenants_cpu_pct')}% | {ratio if ratio is not None else ''} |"
            )
    print("\ngoals:", json.dumps(report.get("goals", {}), indent=2))


def write_report(report: dict[str, Any], output: Path, started_at: dt.datetime) -> None:
    report["goals"] = goals(report)
    report["elapsed_s"] = round((dt.datetime.now(dt.UTC) - started_at).total_seconds(), 1)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2, default=str) + "\n")


def code_state() -> dict[str, Any]:
    """The commit measured and any uncommitted changes to it (others edit the tree too)."""
    root = BENCH_DIR.parent

    def git(*args: str) -> str:
        result = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=False
        )
        return result.stdout.strip() if result.returncode == 0 else ""

    diff = git("diff", "HEAD", "--", "pipeline")
    return {
        "git_head": git("rev-parse", "HEAD"),
        "pipeline_changed_files": git("status", "--porcelain", "--", "pipeline").splitlines(),
        "pipeline_diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
    }


def redis_info(client: redis.Redis) -> dict[str, Any]:
    info = client.info()
    return {k: info.get(k) for k in ("redis_version", "appendonly", "maxmemory_policy")} | {
        "save": client.config_get("save").get("save"),
        "appendfsync": client.config_get("appendfsync").get("appendfsync"),
    }
