"""``pipeline status``: one read of the pipeline's state, judged against thresholds.

Healthy means: no dead letters (publish or consume stage, not yet replayed), nothing
in Dramatiq's dead-letter sets, the oldest unsent event younger than the threshold, and
no delivery owed to a consumer past the redelivery horizon (an event sent, but with no
outcome for one of its consumers: the broker lost it, or no worker runs that consumer), and no
event sent to no consumer (unless ``PIPELINE_ALLOW_UNROUTED`` says that is meant).
Relays and worker processes are listed as busy or idle (alive: a live one refreshes its
heartbeat every couple of seconds, busy or idle), stale (no heartbeat for
``PIPELINE_HEARTBEAT_STALE_SECONDS``: paused, stuck, or cut off from Postgres; a problem)
or gone (its row outlived its process; listed only).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.config import Settings
from pipeline.db.connect import connect
from pipeline.db.stores.heartbeats import HeartbeatStore, ProcessInfo
from pipeline.db.stores.state import StateStore
from pipeline.db.stores.unrouted import UnroutedStore
from pipeline.driver_errors import wrap_driver_errors
from pipeline.policy import redelivery_horizon
from pipeline.tools.ops.activity import ConsumerActivity, format_activity, read_activity
from pipeline.tools.ops.relays import clock_skew, process_state
from pipeline.tools.ops.text import printable_lines
from pipeline.transport.base import QueueDepth
from pipeline.transport.factory import open_transport


@dataclass
class Thresholds:
    max_pending_age_seconds: float = 300.0
    max_dead_letters: int = 0


@dataclass
class Status:
    healthy: bool
    problems: list[str]
    backlog: dict[str, int]
    oldest_pending_age_seconds: float
    dead_letters: dict[str, int]
    relays: list[ProcessInfo]
    queues: dict[str, QueueDepth] | None = field(default=None)
    owed: dict[str, int] = field(default_factory=dict)
    keys_held: dict[str, int] = field(default_factory=dict)
    interval_seconds: float = 300.0
    consumers: dict[str, ConsumerActivity] = field(default_factory=dict)
    unrouted: dict[str, int] = field(default_factory=dict)
    workers: list[ProcessInfo] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["oldest_pending_age_seconds"] = round(self.oldest_pending_age_seconds, 3)
        data["consumers"] = {name: a.as_json() for name, a in self.consumers.items()}
        data["relays"] = [_process_json(info, "relay_id") for info in self.relays]
        data["workers"] = [_process_json(info, "worker_id") for info in self.workers]
        return data


def _process_json(info: ProcessInfo, id_name: str) -> dict[str, Any]:
    return {
        id_name: info.process_id,
        "host": info.host,
        "pid": info.pid,
        "busy": info.busy,
        "heartbeat_age_seconds": round(info.heartbeat_age_seconds, 3),
        "clock_offset_seconds": None if info.clock_offset is None else round(info.clock_offset, 3),
        "state": process_state(info),
    }


def read_status(
    settings: Settings,
    queues: list[str],
    thresholds: Thresholds,
    *,
    interval: float = 300.0,
    consumers: list[str] | None = None,
) -> Status:
    """Read Postgres (and the broker, when configured) once; raises PipelineError subclasses.

    Per-consumer activity covers the last ``interval`` seconds (``consumers`` are listed
    even when idle).
    """
    with wrap_driver_errors(settings), connect(settings, autocommit=True) as conn:
        conn.execute("SET statement_timeout = '10s'")
        database = StateStore(settings.schema_name).snapshot(conn, redelivery_horizon(settings))
        relays = HeartbeatStore(settings, "relay").processes(conn)
        workers = HeartbeatStore(settings, "worker").processes(conn)
        activity = read_activity(conn, settings.schema_name, interval, consumers or ())
        unrouted = UnroutedStore(settings.schema_name).counts(conn)
    depths: dict[str, QueueDepth] | None = None
    if settings.broker_url is not None:
        transport = open_transport(settings, middleware=[], timeout=5.0)
        try:
            known = set(queues) | transport.queues_holding_messages()
            depths = transport.queue_depths(known)
        finally:
            transport.close()
    problems: list[str] = []
    dead_total = sum(database.dead_letters.values())
    if dead_total > thresholds.max_dead_letters:
        stages = ", ".join(f"{n} at {s}" for s, n in database.dead_letters.items() if n)
        problems.append(
            f"{dead_total} dead letters ({stages}): list them with `pipeline dlq list --waiting`;"
            " `pipeline dlq replay --dry-run` shows what a replay would do"
        )
    if database.oldest_pending_age_seconds > thresholds.max_pending_age_seconds:
        problems.append(
            f"oldest unsent event is {database.oldest_pending_age_seconds:.0f}s old "
            f"(threshold {thresholds.max_pending_age_seconds:.0f}s)"
        )
    horizon = redelivery_horizon(settings)
    for consumer, owed in sorted(database.owed.items()):
        if owed:
            held = database.keys_held.get(consumer, 0)
            problems.append(
                f"{owed} deliveries to {consumer} have no outcome after {horizon:.0f}s"
                + (f", holding back {held} ordering keys" if held else "")
                + ": the relay's ledger sweep sends them again; if this persists, check that "
                "workers run this consumer"
            )
    if unrouted and not settings.allow_unrouted:
        types = ", ".join(f"{t} ({n})" for t, n in sorted(unrouted.items()))
        problems.append(
            f"{sum(unrouted.values())} events were sent to no consumer: {types}; list them "
            "with `pipeline dlq unrouted`, and once their consumers run, send them again with "
            "`pipeline dlq resend-unrouted --dry-run` (PIPELINE_ALLOW_UNROUTED=1 if meant)"
        )
    for kind, processes in (("relay", relays), ("worker", workers)):
        for process in processes:
            if process_state(process) == "stale":
                problems.append(
                    f"{kind} {process.process_id} ({process.host} pid {process.pid}) has not "
                    f"refreshed its heartbeat for {process.heartbeat_age_seconds:.0f}s: it is "
                    "paused or stuck, cannot reach Postgres, or stopped without removing its row"
                )
    for name, depth in sorted((depths or {}).items()):
        if depth.dead:
            problems.append(f"{depth.dead} messages in Dramatiq's dead-letter set of {name}")
    return Status(
        healthy=not problems,
        problems=problems,
        backlog=database.backlog,
        oldest_pending_age_seconds=database.oldest_pending_age_seconds,
        dead_letters=database.dead_letters,
        relays=relays,
        queues=depths,
        owed={consumer: n for consumer, n in database.owed.items() if n},
        keys_held={consumer: n for consumer, n in database.keys_held.items() if n},
        interval_seconds=interval,
        consumers=activity,
        unrouted=unrouted,
        workers=workers,
    )


def deployment_status(settings: Settings, thresholds: Thresholds, *, interval: float) -> Status:
    """The status of the deployment's registered consumers and queues (``pipeline status``)."""
    from pipeline.relay.actors import PUBLISH_QUEUE_NAME
    from pipeline.tools.ops.consumers import load_registry

    subscriptions = load_registry(settings).all()
    return read_status(
        settings,
        [*(s.queue for s in subscriptions), PUBLISH_QUEUE_NAME],
        thresholds,
        interval=interval,
        consumers=[s.consumer for s in subscriptions],
    )


def format_status(status: Status) -> str:
    """The human-readable report."""
    lines = [f"pipeline: {'healthy' if status.healthy else 'UNHEALTHY'}"]
    lines += [f"  problem: {problem}" for problem in status.problems]
    backlog = ", ".join(f"{k} {v}" for k, v in status.backlog.items())
    lines.append(f"outbox backlog: {backlog}")
    lines.append(f"oldest unsent event: {status.oldest_pending_age_seconds:.1f}s")
    dead = ", ".join(f"{k} {v}" for k, v in status.dead_letters.items())
    lines.append(f"dead letters: {dead}")
    owed = ", ".join(f"{k} {v}" for k, v in sorted(status.owed.items())) or "none"
    lines.append(f"deliveries owed past the horizon: {owed}")
    unrouted = ", ".join(f"{k} {v}" for k, v in sorted(status.unrouted.items())) or "none"
    lines.append(f"events sent to no consumer: {unrouted}")
    lines += format_activity(status.consumers, status.interval_seconds)
    lines += _format_processes("relays", status.relays)
    lines += _format_processes("workers", status.workers)
    if status.queues is None:
        lines.append("queues: PIPELINE_BROKER_URL not set")
    elif status.queues:
        lines.append("queues (messages ready / delayed / dead):")
        for name, depth in sorted(status.queues.items()):
            lines.append(f"  {name}: {depth.ready} / {depth.delayed} / {depth.dead}")
    else:
        lines.append("queues: none known")
    return printable_lines(lines)  # relay ids, hosts and queue names come from the servers


def _format_processes(title: str, processes: list[ProcessInfo]) -> list[str]:
    if not processes:
        return [f"{title}: none running"]
    alive = sum(process_state(p) in ("busy", "idle") for p in processes)
    return [f"{title} ({alive} alive):"] + [
        f"  {p.process_id} ({p.host} pid {p.pid}): {process_state(p)}, "
        f"heartbeat {p.heartbeat_age_seconds:.1f}s ago"
        + (f", clock {skew}" if (skew := clock_skew(p)) else "")
        for p in processes
    ]
