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
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib
import json
import os
import re
import shlex
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
import redis
from psycopg import sql

from benchmarks.end_to_end import durability, servers
from benchmarks.peers import common
from benchmarks.producer_cost import _code_version, _machine

ROOT = common.ROOT
PEERS = {
    "pgqueuer": "benchmarks.peers.pgqueuer_peer",
    "faststream-outbox": "benchmarks.peers.faststream_outbox_peer",
}
SYSTEMS = ("pipeline", *PEERS)
PIPELINE_SEMANTICS = [
    "An event bus with a transactional outbox and an idempotent inbox: every subscribed "
    "consumer gets each event (fan-out), its handler's database effects commit once per "
    "(consumer, event), and events of one ordering key are published in commit order.",
    "Postgres for the outbox and inbox, Redis (Dramatiq) for transport; a relay process "
    "publishes, worker processes consume.",
    "Each event carries a W3C trace context and a CloudEvents envelope.",
]


def without_passwords(text: str) -> str:
    """``text`` with the password of every URL in it replaced (reports are shared)."""
    return re.sub(r"://([^:/@\s]*):[^@/\s]+@", r"://\1:***@", text)


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


def redis_info(url: str) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    try:
        server = client.info("server")
        persistence = client.info("persistence")
    finally:
        client.close()
    return {
        "redis_version": server.get("redis_version"),
        "aof_enabled": persistence.get("aof_enabled"),
        "rdb_changes_since_last_save": persistence.get("rdb_changes_since_last_save"),
    }


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
    processes = common.Processes(module.commands(url, redis_url, namespace), logs, {})
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


def measure(system: str, url: str, redis_url: str, args: argparse.Namespace) -> dict[str, Any]:
    namespace = f"peers_{system.replace('-', '_')}_{os.getpid()}"
    load = {"loadavg_before": os.getloadavg()}
    try:
        if system == "pipeline":
            result = run_pipeline(url, redis_url, namespace, args)
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
                "system": system if mode == "default" else f"{system} ({mode})",
                "events_per_s": run["throughput"]["end_to_end_per_s"],
                "machine_cpu_ms_per_event": run["throughput"]["machine_cpu_ms_per_event"],
            }
            for point in run["latency"]:
                rate = int(point["offered_events_per_s"])
                row[f"{rate}/s p50 ms"] = point["latency_ms"]["p50"]
                row[f"{rate}/s p99 ms"] = point["latency_ms"]["p99"]
                row[f"{rate}/s commits/s"] = point["achieved_commit_rate"]
                # Handled within 2 s of the last commit, and the producers kept the rate.
                row[f"{rate}/s sustained"] = bool(
                    point["sustained"] and point["achieved_commit_rate"] >= 0.95 * rate
                )
            rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rates", default="200,1000")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument(
        "--observability",
        default="default",
        help="the pipeline's runs (end_to_end.py --observability): default = as shipped",
    )
    parser.add_argument("--database-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--note", default="", help="recorded in the report (e.g. machine load)")
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/peers.json"))
    args = parser.parse_args(argv)
    systems = args.systems.split(",")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    results: dict[str, Any] = {}
    with servers(args.database_url, args.redis_url) as (admin_url, redis_url):
        server = {"postgres": durability(admin_url), "redis": redis_info(redis_url)}
        for system in systems:
            name = f"peers_{system.replace('-', '_')}_{os.getpid()}"
            with own_database(admin_url, name) as url:
                results[system] = measure(system, url, redis_url, args)
            print(f"{system}: {results[system].get('status')}", file=sys.stderr)
    report = {
        "benchmark": "peers",
        "date": started,
        "command": without_passwords(
            shlex.join([sys.executable, "-m", "benchmarks.peers", *sys.argv[1:]])
        ),
        "note": args.note,
        "machine": _machine(),
        "code": _code_version(),
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
        "summary": summary_rows(results),
        "results": results,
    }
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary"], indent=2))
    return 0
