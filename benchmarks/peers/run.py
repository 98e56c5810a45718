"""The pipeline and its peers on one workload, in one sitting: ``python -m benchmarks.peers``.

Workload (that of ``benchmarks/end_to_end.py``): 8 producers, one event per producer
transaction, a consumer whose handler records ``time.time()`` on entry and writes one
row. For each system: a closed loop (sustained throughput, drained rate) and open loops
at 200 and 1,000 events/s (latency from the producer's commit returning to the handler's
start, p50 / p99).

Servers: a throwaway durable Postgres (fsync, synchronous_commit and full_page_writes
on) and Redis, started here and deleted afterwards, unless ``--database-url`` /
``--redis-url`` are given. Every system gets a database of its own, created here and
dropped afterwards (so a given URL needs a role that may create databases), and Redis
keys under a namespace of its own, deleted afterwards. The pipeline is measured by
running ``benchmarks/end_to_end.py`` itself against its database.

A peer that cannot be imported (``pip install -e '.[peers]'`` installs them) or fails is
recorded with its error; the others still run.

``--rounds N`` repeats the whole sitting N times, every system once per round, and
rotates the order (round r starts at system r mod the number of systems): on a shared
machine the load drifts within minutes, and a system always measured first or last would
carry that drift as if it were its own. The report keeps every round and summarises each
number as its median and range over the rounds; it is rewritten after every round.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

from benchmarks import harness
from benchmarks.harness import rotated, spread, without_passwords
from benchmarks.peers import common, raw_commits
from pipeline.transport.namespace import delete_namespace

ROOT = common.ROOT
PEERS = {
    "pgqueuer": "benchmarks.peers.pgqueuer_peer",
    "faststream-outbox": "benchmarks.peers.faststream_outbox_peer",
}
SYSTEMS = ("pipeline", *PEERS, "pgbench")
PIPELINE_SEMANTICS = [
    "An event bus with a transactional outbox and an idempotent inbox: every subscribed "
    "consumer gets each event (fan-out), its handler's database effects commit once per "
    "(consumer, event), and events of one ordering key are published in commit order.",
    "Postgres for the outbox and inbox, Redis (Dramatiq) for transport; a relay process "
    "publishes, worker processes consume.",
    "Each event carries a W3C trace context and a CloudEvents envelope.",
]


def database_url(base: str, name: str) -> str:
    parts = urlsplit(base)
    return urlunsplit(parts._replace(path=f"/{name}"))


@contextmanager
def own_database(admin_url: str, name: str) -> Iterator[str]:
    """A fresh database for one system, dropped afterwards (whatever the system left)."""
    drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(drop)
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield database_url(admin_url, name)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(drop)


def versions(names: Sequence[str]) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def run_pipeline(url: str, redis_url: str, namespace: str, args: argparse.Namespace) -> Any:
    """``benchmarks/end_to_end.py`` with the same workload, as its own command line runs it."""
    output = Path(tempfile.mkdtemp(prefix="peers-pipeline-")) / "end_to_end.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.end_to_end",
        "--rates",
        args.rates,
        "--duration",
        str(args.duration),
        "--producers",
        str(args.producers),
        "--events-per-transaction",
        "1",
        "--observability",
        args.observability,
        "--database-url",
        url,
        "--redis-url",
        redis_url,
        "--output",
        str(output),
    ]
    env = {**os.environ, "PIPELINE_REDIS_NAMESPACE": namespace, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600, check=False
    )
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"end_to_end.py exited {done.returncode}: {' | '.join(tail)}")
    report = json.loads(output.read_text())
    runs = {}
    for mode, result in report["results"].items():
        runs[mode] = {
            "throughput": result["throughput"],
            "latency": result["latency"],
        }
    return {
        "status": "measured",
        "versions": versions(("outbox-pipeline", "dramatiq", "redis", "sqlalchemy", "psycopg")),
        "settings": report["setup"],
        "runs": runs,
        "end_to_end_command": without_passwords(report["command"]),
        "code": report["code"],
        "semantics": PIPELINE_SEMANTICS,
    }


def run_peer(
    module: ModuleType, url: str, redis_url: str, namespace: str, args: argparse.Namespace
) -> dict[str, Any]:
    asyncio.run(module.install(url))
    common.create_handled_table(url)
    logs = Path(tempfile.mkdtemp(prefix=f"peers-{module.NAME}-"))
    processes = common.consumer_processes(module.commands(url, redis_url, namespace), logs)
    try:
        common.warm_up(module.__name__, url, module.reset, processes)
        latency = [
            common.measure_rate(
                module.__name__, url, module.reset, float(rate), args.duration, args.producers
            )
            for rate in args.rates.split(",")
        ]
        throughput = common.measure_throughput(
            module.__name__, url, module.reset, args.duration, args.producers
        )
        processes.check_alive()
    finally:
        processes.stop()
        if hasattr(module, "cleanup_redis"):
            module.cleanup_redis(redis_url, namespace)
    return {
        "status": "measured",
        "versions": versions(module.DISTRIBUTIONS),
        "settings": module.SETTINGS,
        "runs": {"default": {"throughput": throughput, "latency": latency}},
        "logs": str(logs),
        "semantics": module.SEMANTICS,
    }


def measure(
    system: str, url: str, redis_url: str, namespace: str, args: argparse.Namespace
) -> dict[str, Any]:
    load = {"loadavg_before": os.getloadavg()}
    try:
        if system == "pipeline":
            try:
                result = run_pipeline(url, redis_url, namespace, args)
            finally:
                delete_namespace(redis_url, namespace)
        elif system == "pgbench":
            result = raw_commits.measure(url, args)
        else:
            try:
                module = importlib.import_module(PEERS[system])
            except ImportError as exc:
                return {
                    "status": "not installed",
                    "error": f"{type(exc).__name__}: {exc}",
                    "install": "pip install -e '.[peers]'",
                }
            result = run_peer(module, url, redis_url, namespace, args)
    except Exception as exc:  # one peer's failure is a result, not the end of the run
        error = without_passwords(f"{type(exc).__name__}: {exc}")
        return {"status": "failed", "error": error, **load}
    return {**result, **load, "loadavg_after": os.getloadavg()}


def row_label(system: str, mode: str) -> str:
    """The summary's name for one run: the pipeline runs once per observability mode."""
    return system if mode == "default" else f"{system} ({mode})"


def summary_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per system and run: drained events/s, latency p50 / p99 per offered rate.

    A rate counts as sustained here only if the producers also committed at least 95 %
    of it: a system whose commits cannot keep up is not offered the rate at all.
    """
    rows = []
    for system, result in results.items():
        if result.get("status") != "measured":
            rows.append({"system": system, "status": result.get("status")})
            continue
        for mode, run in result["runs"].items():
            row: dict[str, Any] = {
                "system": row_label(system, mode),
                "events_per_s": run["throughput"]["end_to_end_per_s"],
                "machine_cpu_ms_per_event": run["throughput"]["machine_cpu_ms_per_event"],
            }
            if "cpu_ms_per_event_by_component" in run["throughput"]:
                by_component = run["throughput"]["cpu_ms_per_event_by_component"]
                row["cpu_ms_per_event_by_component"] = by_component
            for point in run["latency"]:
                rate = int(point["offered_events_per_s"])
                row[f"{rate}/s p50 ms"] = point["latency_ms"]["p50"]
                row[f"{rate}/s p99 ms"] = point["latency_ms"]["p99"]
                row[f"{rate}/s commits/s"] = point["achieved_commit_rate"]
                row[f"{rate}/s CPU ms/event"] = point.get("machine_cpu_ms_per_event")
                # Handled within 2 s of the last commit, and the producers kept the rate.
                row[f"{rate}/s sustained"] = bool(
                    point["sustained"] and point["achieved_commit_rate"] >= 0.95 * rate
                )
            rows.append(row)
    return rows


def measure_round(
    round_index: int,
    systems: Sequence[str],
    admin_url: str,
    redis_url: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Every system once, in this round's order, each on a fresh database and namespace.

    The names carry the round, so nothing one round leaves behind is seen by the next.
    """
    order = rotated(systems, round_index)
    results: dict[str, Any] = {}
    for system in order:
        name = f"peers_{system.replace('-', '_')}_{os.getpid()}_r{round_index}"
        with own_database(admin_url, name) as url:
            results[system] = measure(system, url, redis_url, name, args)
        print(f"round {round_index}: {system}: {results[system].get('status')}", file=sys.stderr)
    return {
        "round": round_index,
        "order": order,
        "summary": summary_rows(results),
        "results": results,
    }


def labels_of(system: str, rounds: Sequence[dict[str, Any]]) -> list[str]:
    """The summary rows a system measured in any round, in order of first appearance."""
    labels: list[str] = []
    for done in rounds:
        result = done["results"].get(system, {})
        if result.get("status") != "measured":
            continue
        for mode in result["runs"]:
            if row_label(system, mode) not in labels:
                labels.append(row_label(system, mode))
    return labels


def rows_by_round(label: str, rounds: Sequence[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """The row called ``label`` in each round's summary; ``None`` where it has none."""
    found: list[dict[str, Any] | None] = []
    for done in rounds:
        rows = [r for r in done["summary"] if r["system"] == label and "events_per_s" in r]
        found.append(rows[0] if rows else None)
    return found


def rate_summary(rate: int, rows: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """One offered rate over the rounds: p50 and p99 spreads and the worst p99."""
    p50 = spread([row.get(f"{rate}/s p50 ms") if row else None for row in rows])
    p99 = spread([row.get(f"{rate}/s p99 ms") if row else None for row in rows])
    commits = spread([row.get(f"{rate}/s commits/s") if row else None for row in rows])
    cpu = spread([row.get(f"{rate}/s CPU ms/event") if row else None for row in rows])
    return {
        "p50_ms": p50,
        "p99_ms": p99,
        "p99_max_over_rounds": p99["max"],
        "commits_per_s": commits,
        "machine_cpu_ms_per_event": cpu,
        "sustained_by_round": [row.get(f"{rate}/s sustained") if row else None for row in rows],
    }


def combined_row(
    label: str, rows: Sequence[dict[str, Any] | None], rates: Sequence[int]
) -> dict[str, Any]:
    """One system's row over all rounds.

    The fields of a single round's row are kept, holding medians over the rounds (so a
    one-round report reads as before); a rate counts as sustained only if it was in every
    round that measured it. The per-round values and their ranges are added beside them.
    """
    throughput = spread([row["events_per_s"] if row else None for row in rows])
    cpu = spread([row["machine_cpu_ms_per_event"] if row else None for row in rows])
    combined: dict[str, Any] = {
        "system": label,
        "events_per_s": throughput["median"],
        "machine_cpu_ms_per_event": cpu["median"],
    }
    latency: dict[str, Any] = {}
    for rate in rates:
        latency[str(rate)] = at_rate = rate_summary(rate, rows)
        sustained = [s for s in at_rate["sustained_by_round"] if s is not None]
        combined[f"{rate}/s p50 ms"] = at_rate["p50_ms"]["median"]
        combined[f"{rate}/s p99 ms"] = at_rate["p99_ms"]["median"]
        combined[f"{rate}/s commits/s"] = at_rate["commits_per_s"]["median"]
        combined[f"{rate}/s sustained"] = bool(sustained) and all(sustained)
    combined["rounds_measured"] = sum(row is not None for row in rows)
    combined["events_per_s_over_rounds"] = throughput
    combined["machine_cpu_ms_per_event_over_rounds"] = cpu
    combined["latency_over_rounds"] = latency
    if any(row and "cpu_ms_per_event_by_component" in row for row in rows):
        combined["cpu_ms_per_event_by_component_by_round"] = [
            row.get("cpu_ms_per_event_by_component") if row else None for row in rows
        ]
    return combined


def throughput_ratios(
    rows: Sequence[dict[str, Any] | None], peer_rows: Sequence[dict[str, Any] | None]
) -> dict[str, Any]:
    """Pipeline / peer drained events/s within each round, and the median of those ratios.

    Ratios are taken within a round (same minutes, same machine load) before the median,
    which is steadier on a shared machine than a ratio of medians.
    """
    ratios: list[float | None] = []
    for ours, theirs in zip(rows, peer_rows, strict=True):
        if ours and theirs and theirs["events_per_s"]:
            ratios.append(round(ours["events_per_s"] / theirs["events_per_s"], 3))
        else:
            ratios.append(None)
    return spread(ratios)


def rounds_summary(
    systems: Sequence[str], rounds: Sequence[dict[str, Any]], rates: Sequence[int]
) -> list[dict[str, Any]]:
    """One row per system (and pipeline mode) over every round so far; see ``combined_row``.

    A system that measured nothing in any round gets a status row, as in ``summary_rows``.
    The pipeline's rows also carry its throughput over each peer's, round by round.
    """
    summary: list[dict[str, Any]] = []
    rows_of: dict[str, list[dict[str, Any] | None]] = {}
    for system in systems:
        statuses = [done["results"].get(system, {}).get("status") for done in rounds]
        labels = labels_of(system, rounds)
        if not labels:
            summary.append({"system": system, "status": statuses[-1], "status_by_round": statuses})
        for label in labels:
            rows_of[label] = rows_by_round(label, rounds)
            summary.append(
                {**combined_row(label, rows_of[label], rates), "status_by_round": statuses}
            )
    peers = [label for label in rows_of if not label.startswith("pipeline")]
    for row in summary:
        if row["system"].startswith("pipeline") and row["system"] in rows_of:
            row["events_per_s_over_peer"] = {
                peer: throughput_ratios(rows_of[row["system"]], rows_of[peer]) for peer in peers
            }
    return summary


def _range(stats: dict[str, Any], digits: int) -> str:
    if stats["median"] is None:
        return "-"
    return f"{stats['median']:.{digits}f} [{stats['min']:.{digits}f}-{stats['max']:.{digits}f}]"


def _worst(stats: dict[str, Any]) -> str:
    if stats["median"] is None:
        return "-"
    return f"{stats['median']:.1f} ({stats['max']:.1f})"


def summary_table(summary: Sequence[dict[str, Any]], rates: Sequence[int]) -> str:
    """The summary for a terminal: medians, with [min-max] or (worst) over the rounds."""
    header = ["system", "events/s median [min-max]"]
    for rate in rates:
        header += [f"{rate}/s p50 ms (worst)", f"{rate}/s p99 ms (worst)"]
    lines = [header]
    for row in summary:
        if "events_per_s_over_rounds" not in row:
            lines.append([row["system"], str(row.get("status")), *["-"] * (2 * len(rates))])
            continue
        line = [row["system"], _range(row["events_per_s_over_rounds"], 1)]
        for rate in rates:
            at_rate = row["latency_over_rounds"][str(rate)]
            line += [_worst(at_rate["p50_ms"]), _worst(at_rate["p99_ms"])]
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def report_header(
    args: argparse.Namespace, argv: Sequence[str] | None, server: dict[str, Any]
) -> dict[str, Any]:
    """Everything the report says about the sitting, before any result."""
    return {
        **harness.header("peers", argv),
        "note": args.note,
        "servers": server,
        "servers_started_here": {
            "postgres": args.database_url is None,
            "redis": args.redis_url is None,
        },
        "workload": {
            "producers": args.producers,
            "events_per_transaction": 1,
            "duration_s": args.duration,
            "rates": [float(r) for r in args.rates.split(",")],
            "latency": "producer's commit returned -> handler start (time.time(), one clock)",
            "throughput": "closed loop; events handled / (last handler start - first commit)",
            "handler": "records its start time and writes one row",
        },
        "contended": (
            f"{args.contended} process(es) spinning on the CPU beside every system, for the "
            "whole sitting"
            if args.contended
            else "no"
        ),
        "rounds_requested": args.rounds,
        "order": "round r starts at system r mod the number of systems, then wraps",
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rates", default="200,1000")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every system this many times, rotating the order each round",
    )
    parser.add_argument(
        "--observability",
        default="default",
        help="the pipeline's runs (end_to_end.py --observability): default = as shipped",
    )
    parser.add_argument(
        "--contended",
        type=int,
        default=0,
        help="CPU hogs (processes spinning on one core each) running beside every system",
    )
    parser.add_argument("--database-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--note", default="", help="recorded in the report (e.g. machine load)")
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/peers.json"))
    args = parser.parse_args(argv)
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    systems = args.systems.split(",")
    rates = [int(float(r)) for r in args.rates.split(",")]
    output = Path(args.output)
    rounds: list[dict[str, Any]] = []
    with (
        harness.cpu_hogs(args.contended),
        harness.servers(args.database_url, args.redis_url) as servers,
    ):
        admin_url, redis_url = servers.database_url, servers.redis_url
        server = {"postgres": harness.durability(admin_url), "redis": harness.redis_info(redis_url)}
        report = report_header(args, argv, server)
        for round_index in range(args.rounds):
            rounds.append(measure_round(round_index, systems, admin_url, redis_url, args))
            report["complete"] = round_index + 1 == args.rounds
            report["summary"] = rounds_summary(systems, rounds, rates)
            report["rounds"] = rounds
            harness.write_report(output, report)
    print(summary_table(report["summary"], rates))
    return 0
