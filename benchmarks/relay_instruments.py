"""How the relay benchmark measures without changing the relay: timing and CPU shares.

:class:`Phases` sums wall time per named phase; :class:`TimedConnection` wraps the
relay's psycopg connection to time its named queries and transactions; the CPU helpers
turn ``producer_cost``'s /proc samples into shares of the machine.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg

from benchmarks import producer_cost as pc
from benchmarks.relay_context import SQL_NAMES, Context
from pipeline.db.queries import queries_for
from pipeline.observability import metrics


def latency_summary(values: Sequence[float]) -> dict[str, Any]:
    """Count, p50/p90/p99/max/mean in milliseconds of durations given in seconds."""
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50_ms": pc._ms(pc._percentile(values, 0.50)),
        "p90_ms": pc._ms(pc._percentile(values, 0.90)),
        "p99_ms": pc._ms(pc._percentile(values, 0.99)),
        "max_ms": pc._ms(max(values)),
        "min_ms": pc._ms(min(values)),
        "mean_ms": pc._ms(sum(values) / len(values)),
    }


def wakeups() -> dict[str, float]:
    """This process's relay wake-up counters by source (for deltas)."""
    return {
        source: metrics.relay_wakeups.labels(source)._value.get()
        for source in ("notify", "poll", "reconnect")
    }


def cpu_shares(before: pc.CpuSample, after: pc.CpuSample, pids: Sequence[int]) -> float:
    """Percent of the machine's CPU capacity used by ``pids`` between two samples."""
    total = after.machine[2] - before.machine[2]
    used = sum(
        after.processes[pid][2] - before.processes[pid][2]
        for pid in pids
        if pid in after.processes and pid in before.processes
    )
    return round(100 * used / total, 1) if total > 0 else 0.0


def cpu_report(
    before: pc.CpuSample,
    after: pc.CpuSample,
    events: int,
    relay_pids: Sequence[int],
    ctx: Context,
    producer_pids: Sequence[int] = (),
) -> dict[str, Any]:
    """producer_cost's CPU report, its "producers" being the relay's processes.

    Producer processes, when given, are reported apart and left out of ``other``;
    ``other`` is then other tenants of the machine (and this script's parent).
    """
    raw = pc._cpu_report(before, after, events, [*relay_pids, *producer_pids], ctx.server_pid)
    renamed = {
        key.replace("producers_", "relay_").replace("_per_tx", "_per_event"): value
        for key, value in raw.items()
    }
    if producer_pids:
        renamed["relay_pct"] = cpu_shares(before, after, relay_pids)
        renamed["producers_pct"] = cpu_shares(before, after, producer_pids)
        renamed.pop("relay_cpu_ms_per_event", None)
    if ctx.redis_pid is not None:
        renamed["redis_pct"] = cpu_shares(before, after, [ctx.redis_pid])
    return renamed


class Phases:
    """Wall time per named phase, summed over a drain, and call counts."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
        self.calls[name] += 1

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - started)

        return timed

    def merge(self, other: dict[str, float]) -> None:
        for name, seconds in other.items():
            self.seconds[name] += seconds

    def report(self, batches: int, wall: float) -> dict[str, Any]:
        """Per-batch milliseconds and share of the drain's wall time of each phase."""
        s = self.seconds
        claim_sql = s["sql:claim"]
        settle_sql = s["sql:mark_sent"]
        parts = {  # the claim is one autocommit statement: no transaction of its own
            "claim_sql": claim_sql,
            "claim_python": s["claim"] - claim_sql,
            "encode_json": s["encode"],
            "redis_pipeline": s["deliver"] - s["encode"],
            "mark_sent_sql": settle_sql,
            "mark_sent_begin_commit": s["tx:mark_sent"],
            "settle_python": s["settle"] - settle_sql - s["tx:mark_sent"],
        }
        parts["other_python"] = max(0.0, wall - sum(parts.values()))
        return {
            name: {
                "ms_per_batch": round(1000 * value / batches, 3) if batches else None,
                "pct": round(100 * value / wall, 1) if wall else None,
            }
            for name, value in parts.items()
        }


class TimedConnection:
    """Delegates to a psycopg connection, timing the relay's named queries and transactions.

    ``tx:<name>`` is a transaction's BEGIN plus COMMIT (the WAL flush), named after the last
    named query run inside it.
    """

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        schema: str,
        phases: Phases,
        log: list[tuple[str, float, float]] | None = None,
    ) -> None:
        self._conn = conn
        self._phases = phases
        self._log = log  # (query name, start, end) of every query, when given
        queries = queries_for(schema)
        self._names = {id(queries[name]): name for name in SQL_NAMES}
        self._last = "other"

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        name = self._names.get(id(query), "other")
        self._last = name
        started = time.perf_counter()
        try:
            return self._conn.execute(query, params, **kwargs)
        finally:
            ended = time.perf_counter()
            self._phases.add(f"sql:{name}", ended - started)
            if self._log is not None:
                self._log.append((name, started, ended))

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Any]:
        started = time.perf_counter()
        inside = sum(self._phases.seconds[f"sql:{n}"] for n in (*SQL_NAMES, "other"))
        with self._conn.transaction() as tx:
            yield tx
        spent = sum(self._phases.seconds[f"sql:{n}"] for n in (*SQL_NAMES, "other")) - inside
        self._phases.add(f"tx:{self._last}", time.perf_counter() - started - spent)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)
