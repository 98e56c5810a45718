"""Section ``producer_with_relay``: what producers pay while a real relay process publishes.

``producer_cost.run_one`` for ``business`` and ``outbox`` (its ``outbox_notify``) while
``python -m pipeline.tools.cli relay --mode inline`` runs; a LISTEN here counts the NOTIFYs
producers sent, and 20 ms samples of relay_state give the relay's busy share.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from benchmarks import producer_cost as pc
from benchmarks.relay_context import BENCH_DIR, EVENT_TYPE, RELAY_APP_NAME, Context
from benchmarks.relay_instruments import cpu_shares
from pipeline.db.migrate import notify_channel


class RelayMonitor:
    """Counts NOTIFYs on the outbox channel and samples the busy flag and the backlog."""

    def __init__(self, ctx: Context) -> None:
        schema = ctx.settings.schema_name
        self.listen_conn = psycopg.connect(ctx.url, autocommit=True)
        self.listen_conn.execute(
            sql.SQL("LISTEN {}").format(sql.Identifier(notify_channel(schema)))
        )
        self.sample_conn = psycopg.connect(ctx.url, autocommit=True)
        self.busy_query = sql.SQL(
            "SELECT coalesce(bool_or(busy AND heartbeat_at > clock_timestamp() - "
            "interval '5 seconds'), false), (SELECT count(*) FROM {} "
            "WHERE status IN ('pending', 'publishing')) FROM {}"
        ).format(sql.Identifier(schema, "outbox"), sql.Identifier(schema, "relay_state"))
        self.notifications: list[float] = []
        self.samples: list[tuple[float, bool, int]] = []
        self.halt = threading.Event()
        self.threads = [
            threading.Thread(target=self._listen, daemon=True),
            threading.Thread(target=self._sample, daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _listen(self) -> None:
        while not self.halt.is_set():
            for _ in self.listen_conn.notifies(timeout=0.2):
                self.notifications.append(time.monotonic())

    def _sample(self) -> None:
        while not self.halt.wait(0.02):
            with contextlib.suppress(psycopg.Error):
                row = self.sample_conn.execute(self.busy_query).fetchone()
                if row is not None:
                    self.samples.append((time.monotonic(), bool(row[0]), int(row[1])))

    def window(self, start: float, end: float) -> dict[str, Any]:
        inside = [s for s in self.samples if start <= s[0] < end]
        return {
            "notifies": sum(1 for t in self.notifications if start <= t < end),
            "busy_fraction": (
                round(sum(1 for s in inside if s[1]) / len(inside), 3) if inside else None
            ),
            "busy_samples": len(inside),
            "backlog_max": max((s[2] for s in inside), default=None),
            "backlog_at_end": inside[-1][2] if inside else None,
        }

    def close(self) -> None:
        self.halt.set()
        for thread in self.threads:
            thread.join(timeout=5)
        self.listen_conn.close()
        self.sample_conn.close()


class WindowProbe:
    """Stands in for producer_cost._sample to learn run_one's exact measurement window."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, pc.CpuSample]] = []

    def __call__(self) -> pc.CpuSample:
        sample = ORIGINAL_SAMPLE()
        self.marks.append((time.monotonic(), sample))
        return sample


ORIGINAL_SAMPLE = pc._sample


def start_relay_process(ctx: Context, log: Path) -> subprocess.Popen[bytes]:
    """``python -m pipeline.tools.cli relay --mode inline`` with bench_app's route."""
    env = dict(os.environ)
    env.update(
        PIPELINE_DATABASE_URL=ctx.url,
        PIPELINE_REDIS_URL=ctx.settings.require_redis_url(),
        PIPELINE_REDIS_NAMESPACE=ctx.settings.redis_namespace,
        PIPELINE_SCHEMA_NAME=ctx.settings.schema_name,
        PIPELINE_APP_MODULES="bench_app",
        PIPELINE_METRICS_PORT="0",  # no /metrics endpoint: not on the publishing path
        PGAPPNAME=RELAY_APP_NAME,  # libpq: lets pg_stat_activity name the relay's backends
        PYTHONPATH=os.pathsep.join(filter(None, [str(BENCH_DIR), env.get("PYTHONPATH")])),
    )
    with log.open("wb") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "pipeline.tools.cli", "relay", "--mode", "inline"],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    relay_state = sql.Identifier(ctx.settings.schema_name, "relay_state")
    deadline = time.monotonic() + 60
    while True:
        row = ctx.bench.admin.execute(
            sql.SQL("SELECT 1 FROM {} WHERE pid = %s").format(relay_state), (process.pid,)
        ).fetchone()
        if row is not None:
            return process
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"relay process did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)


def settle_relay(ctx: Context, timeout: float = 20.0) -> None:
    """Drop any backlog and wait until the relay has handed off (not busy), so the next
    run's probe commit NOTIFYs as producer_cost expects."""
    ctx.bench.admin.execute(sql.SQL("TRUNCATE {}").format(ctx.outbox))
    busy = sql.SQL(
        "SELECT EXISTS (SELECT 1 FROM {} WHERE busy AND heartbeat_at > clock_timestamp() "
        "- interval '5 seconds')"
    ).format(sql.Identifier(ctx.settings.schema_name, "relay_state"))
    deadline = time.monotonic() + timeout
    while ctx.bench.admin.execute(busy).fetchone() == (True,) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)


def publish_lag(ctx: Context, wait: float = 30.0) -> dict[str, Any]:
    """Wait for the relay to finish the backlog; insert -> sent lag by the server's clock."""
    started = time.monotonic()
    pending = sql.SQL("SELECT count(*) FROM {} WHERE status IN ('pending', 'publishing')").format(
        ctx.outbox
    )
    left = -1
    while time.monotonic() - started < wait:
        row = ctx.bench.admin.execute(pending).fetchone()
        left = int(row[0]) if row else 0
        if left == 0:
            break
        time.sleep(0.1)
    row = ctx.bench.admin.execute(
        sql.SQL(
            "SELECT count(*), percentile_cont(array[0.5, 0.99]) WITHIN GROUP "
            "(ORDER BY extract(epoch FROM published_at - created_at)), "
            "max(extract(epoch FROM published_at - created_at)) "
            "FROM {} WHERE status = 'sent' AND event_type = %s"
        ).format(ctx.outbox),
        (EVENT_TYPE,),
    ).fetchone()
    count, quantiles, worst = row if row else (0, None, None)
    return {
        "drained_after_run_s": round(time.monotonic() - started, 2),
        "unsent_left": left,
        "events_sent": int(count),
        "insert_to_sent_p50_ms": pc._ms(float(quantiles[0])) if quantiles else None,
        "insert_to_sent_p99_ms": pc._ms(float(quantiles[1])) if quantiles else None,
        "insert_to_sent_max_ms": pc._ms(float(worst)) if worst is not None else None,
    }


def run_producer_with_relay(
    ctx: Context, clients_list: Sequence[int], duration: float, max_processes: int
) -> dict[str, Any]:
    """producer_cost's business vs outbox runs while a real relay process publishes."""
    ctx.reset()
    log = Path(tempfile.mkdtemp(prefix="relay-bench-")) / "relay.log"
    relay = start_relay_process(ctx, log)
    monitor = RelayMonitor(ctx)
    probe = WindowProbe()
    pc._sample = probe  # run_one samples CPU exactly at its window's start and end
    runs: list[dict[str, Any]] = []
    try:
        for clients in clients_list:
            for mode, label in (("business", "business"), ("outbox_notify", "outbox")):
                settle_relay(ctx)
                probe.marks.clear()
                run = pc.run_one(ctx.bench, mode, clients, max_processes, duration, ctx.server_pid)
                (start, before), (end, after) = probe.marks[-2:]
                run["mode"] = label
                run["producer_cost_mode"] = mode
                backends = [
                    int(pid)
                    for (pid,) in ctx.bench.admin.execute(
                        "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                        (RELAY_APP_NAME,),
                    ).fetchall()
                ]
                run["relay"] = {
                    **monitor.window(start, end),
                    "relay_process_cpu_pct": cpu_shares(before, after, [relay.pid]),
                    "relay_backends_cpu_pct": cpu_shares(before, after, backends),
                }
                other = run["cpu"].get("other_pct")
                run["relay"]["other_tenants_cpu_pct"] = (
                    round(other - run["relay"]["relay_process_cpu_pct"], 1)
                    if other is not None
                    else None
                )
                run["relay"]["notifies_per_commit"] = (
                    round(run["relay"]["notifies"] / run["commits"], 4) if run["commits"] else None
                )
                if mode != "business":
                    run["relay"].update(publish_lag(ctx))
                if relay.poll() is not None:
                    raise RuntimeError(f"relay process exited: {log.read_text()[-2000:]}")
                runs.append(run)
                r = run["relay"]
                print(
                    f"  with relay {label:<9} clients={clients:<3} {run['tx_per_s']:>7.0f} tx/s "
                    f"commit p50 {run['latency_ms']['commit_p50']} ms  notifies {r['notifies']} "
                    f"busy {r['busy_fraction']} backlog max {r['backlog_max']}",
                    flush=True,
                )
    finally:
        pc._sample = ORIGINAL_SAMPLE
        monitor.close()
        if relay.poll() is None:
            relay.send_signal(signal.SIGTERM)
            try:
                relay.wait(timeout=20)
            except subprocess.TimeoutExpired:
                relay.kill()
                relay.wait()
    rate = {(r["mode"], r["clients"]): r["tx_per_s"] for r in runs}
    ratios = {
        str(c): round(rate[("outbox", c)] / rate[("business", c)], 3)
        if rate.get(("business", c))
        else None
        for c in clients_list
        if ("outbox", c) in rate
    }
    return {
        "method": (
            "producer_cost.run_one for modes business and outbox_notify (reported as "
            "'outbox': add_event in the transaction, NOTIFY trigger installed, no fake "
            "heartbeat) while `python -m pipeline.tools.cli relay --mode inline` (routes from "
            "benchmarks/bench_app.py) publishes; before each run the outbox is truncated and "
            "the relay allowed to hand off. notifies = NOTIFYs received by a LISTEN here "
            "during the window; busy_fraction = share of 20 ms samples of relay_state in "
            "which the trigger would skip NOTIFY"
        ),
        "duration_s": duration,
        "relay_log": str(log),
        "runs": runs,
        "ratios_outbox_over_business": ratios,
    }
