"""The floor under every system in the sitting: raw single-INSERT commits, by ``pgbench``.

Eight clients (as many as the producers) each commit one INSERT of a small JSON row per
transaction for the sitting's duration, on the same server and durability settings as the
systems; once with the simple query protocol and once with prepared statements. A system's
events/s over this rate says how much of the database's commit rate it turns into
delivered events (every system here pays at least one such commit per event, the outbox
write or the job insert).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import psycopg

from benchmarks import harness
from pipeline.config import libpq_url

TABLE = "raw_commits"
SCRIPT = f'INSERT INTO {TABLE} (payload) VALUES (\'{{"n": 1, "note": "benchmark"}}\');\n'
PROTOCOLS = {"default": "simple", "prepared": "prepared"}
"""Report mode -> pgbench ``--protocol``: ``default`` keeps the summary's plain row name."""
SETTINGS = {
    "tool": "pgbench -n (no vacuum), one INSERT of a small jsonb row per transaction",
    "table": f"{TABLE} (id bigserial primary key, payload jsonb, created_at timestamptz)",
    "protocols": "simple (row 'pgbench'), prepared (row 'pgbench (prepared)')",
}
SEMANTICS = ["Not a queue: the commit rate every system's per-event commit is bounded by."]


def pgbench_binary() -> str | None:
    """``pgbench`` on the PATH or beside a Postgres installation's other binaries."""
    found = shutil.which("pgbench")
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/pgbench"), reverse=True)
    return str(candidates[0]) if candidates else None


def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Both protocols against the system's own database; the rate pgbench reports (tps
    without connection set-up) and the machine's CPU per commit."""
    binary = pgbench_binary()
    if binary is None:
        return {
            "status": "not installed",
            "error": "pgbench not found (Debian: postgresql-client)",
            "install": "apt-get install postgresql-client",
        }
    conninfo = libpq_url(url)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {TABLE} (id bigserial PRIMARY KEY, payload jsonb,"
            " created_at timestamptz NOT NULL DEFAULT now())"
        )
    script = Path(tempfile.mkdtemp(prefix="peers-pgbench-")) / "insert.sql"
    script.write_text(SCRIPT)
    runs = {}
    for mode, protocol in PROTOCOLS.items():
        runs[mode] = {"throughput": run_once(binary, conninfo, script, protocol, args)}
        runs[mode]["latency"] = []
    return {
        "status": "measured",
        "versions": {"pgbench": _version(binary)},
        "settings": {**SETTINGS, "clients": args.producers, "duration_s": args.duration},
        "runs": runs,
        "semantics": SEMANTICS,
    }


def run_once(
    binary: str, conninfo: str, script: Path, protocol: str, args: argparse.Namespace
) -> dict[str, Any]:
    clients = str(args.producers)
    command = [binary, "-n", "-c", clients, "-j", clients, "-T", str(int(args.duration))]
    busy = harness.machine_busy_seconds()
    done = subprocess.run(
        [*command, "-M", protocol, "-f", str(script), conninfo],
        capture_output=True,
        text=True,
        timeout=args.duration * 10 + 60,
        check=False,
    )
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"pgbench exited {done.returncode}: {harness.without_passwords(tail)}")
    busy = harness.machine_busy_seconds() - busy
    tps = _number(r"tps = ([\d.]+) \(without initial connection time\)", done.stdout)
    committed = _number(r"number of transactions actually processed: (\d+)", done.stdout)
    return {
        "protocol": protocol,
        "end_to_end_per_s": round(tps, 1),
        "committed": int(committed),
        "machine_cpu_ms_per_event": round(busy * 1000 / max(committed, 1), 3),
    }


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    if match is None:
        raise RuntimeError(f"pgbench printed no {pattern!r}")
    return float(match.group(1))


def _version(binary: str) -> str:
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    return done.stdout.strip()
