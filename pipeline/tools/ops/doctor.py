"""``pipeline doctor``: check a deployment for what silently loses, delays or stalls events.

Each check gives a :class:`Finding`: ``ok``, ``info`` (a fact to know, e.g. how the
broker persists), ``warning`` (a risk the deployment may have chosen, with its fix; the
command still exits 0) or ``problem`` (with its fix); any problem makes the command exit
non-zero.
What is checked, and how:

* **schema**: migrations applied and none newer than this code; ``functions.sql`` as
  shipped; every index declared in ``pipeline/db/tables.py`` present and valid; the
  triggers and functions of ``functions.sql`` present and enabled.
* **listen**: the relay LISTENs on ``PIPELINE_DATABASE_URL``. A NOTIFY sent on a second
  connection must reach a LISTEN on a first within two seconds — behind a
  transaction-pooling PgBouncer it does not (the LISTEN's server connection goes back
  to the pool). A pooler is also recognised by the process id it reports at connection
  time differing from the server's ``pg_backend_pid()`` (PgBouncer invents its own);
  session pooling passes the round trip and is reported as info.
* **notify queue**: ``pg_notification_queue_usage()`` above half full is a problem.
* **settings**: inbox retention at least every known consumer's retry horizon (the rule
  of :mod:`pipeline.policy`, which workers, relays and ``pipeline prune`` enforce), and the
  lease at least ten times a full batch's estimated publish time (measured round trips
  to Postgres and the broker plus the measured cost of encoding a batch); a stalled server is
  not covered: it is bounded by the clients' timeouts, and a lease that expires only
  publishes again, which the inbox absorbs.
* **the broker**, by the transport's own checks (:meth:`Transport.diagnose`). Redis:
  reachable; ``maxmemory-policy`` must be ``noeviction``; persistence (``appendonly``,
  ``appendfsync``, ``save``) is stated with its consequence. RabbitMQ
  (:mod:`pipeline.transport.amqp.health`): reachable; confirms on; every queue a quorum
  queue (each classic one named); ``consumer_timeout`` above the longest a worker holds a
  message; a majority of the cluster's members running.
* **message key**: ``PIPELINE_MESSAGE_KEY`` as this process sees it (run the doctor with
  the relays' and workers' settings): unset is a warning (anyone who can write to the
  broker can make handlers run), ``insecure`` is that choice made on purpose (info), and
  so is a ``PIPELINE_MESSAGE_KEY_PREVIOUS=insecure`` left after a key was introduced
  (warning: workers still accept unsigned messages).
* **clock**: this host's clock against the database's (queue messages carry the host's
  time, the delivery ledger the database's; it allows one second).
* **relay and worker clocks**: each live relay's and worker process's clock against the
  database's, as its heartbeat last measured it (``clock_offset``); more than one second
  off is a problem naming the process, its host and pid.
* **dead letters** waiting, and the **canary**'s last arrival.
"""

from __future__ import annotations

import re
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from importlib import resources
from typing import Any, Literal

import psycopg
from psycopg import sql
from sqlalchemy import MetaData
from sqlalchemy.dialects import postgresql
from sqlalchemy.schema import CreateIndex

from pipeline.config import Settings
from pipeline.db.connect import connect, describe_server, driver_reason
from pipeline.db.migrate import (
    FUNCTIONS_VERSION,
    available_migrations,
    functions_checksum,
)
from pipeline.db.stores.diagnostics import DiagnosticsStore
from pipeline.db.stores.heartbeats import HeartbeatStore, Kind, ProcessInfo
from pipeline.db.tables import metadata
from pipeline.envelope import OutboxEvent, encode_envelope
from pipeline.errors import ServiceUnavailableError
from pipeline.policy import (
    ConsumerPolicy,
    consumer_with_longest_horizon,
    retention_problems,
)
from pipeline.registry import CANARY_CONSUMER
from pipeline.signing import MessageKeys
from pipeline.tools.ops.relays import clock_skew, process_state
from pipeline.transport.factory import transport_class

Status = Literal["ok", "info", "warning", "problem"]

LISTEN_TIMEOUT = 2.0
NOTIFY_QUEUE_LIMIT = 0.5
CLOCK_SKEW_LIMIT = 1.0
LEASE_SAFETY = 10.0
CANARY_MISSED = 3  # canary intervals without an arrival before it is a problem
CANARY_MIN_AGE = 60.0  # ...and at least this many seconds


@dataclass
class Finding:
    check: str
    status: Status
    summary: str
    fix: str = ""


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not any(f.status == "problem" for f in self.findings)

    def add(self, check: str, status: Status, summary: str, fix: str = "") -> None:
        self.findings.append(Finding(check, status, summary, fix))

    def as_json(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "findings": [asdict(f) for f in self.findings]}


def run_doctor(
    settings: Settings,
    consumers: Sequence[ConsumerPolicy],
    *,
    clock: Callable[[], float] = time.time,
) -> Report:
    """Every check against the configured servers; ``consumers``: the known consumers."""
    report = Report()
    pg_rtt = None
    try:
        # No server-side prepared statements: they break behind a transaction pooler.
        with connect(settings, autocommit=True, prepare_threshold=None) as conn:
            conn.execute("SET statement_timeout = '10s'")
            pg_rtt = _round_trip(lambda: conn.execute("SELECT 1").fetchone())
            if _check_schema(conn, settings.schema_name, report):
                _check_dead_letters(conn, settings.schema_name, report)
                _check_canary(conn, settings, report)
                _check_processes(conn, settings, report, "relay")
                _check_processes(conn, settings, report, "worker")
            _check_server(conn, settings, report, clock)
    except ServiceUnavailableError as exc:
        report.add("postgres", "problem", str(exc), "start Postgres or fix PIPELINE_DATABASE_URL")
    except psycopg.Error as exc:
        url = settings.require_database_url()
        report.add(
            "postgres",
            "problem",
            f"a check failed at {describe_server(url)}: {type(exc).__name__}: "
            f"{driver_reason(exc, url)}",
            "see the checks above; rerun once Postgres answers",
        )
    else:
        _check_listen(settings, report)
    broker_rtt = _check_broker(settings, consumers, report)
    _check_retention(settings, consumers, report)
    check_message_key(settings, report)
    _check_lease(settings, len(consumers), pg_rtt, broker_rtt, report)
    return report


def check_deployment(settings: Settings) -> Report:
    """``pipeline doctor``: every check, with the registered consumers' policies."""
    from pipeline.tools.ops.consumers import consumer_policies

    return run_doctor(settings, consumer_policies(settings))


# -- schema ----------------------------------------------------------------------------------
def _check_schema(conn: psycopg.Connection[Any], schema: str, report: Report) -> bool:
    """Migrations, indexes, triggers; False when the schema is not installed at all."""
    try:
        recorded = DiagnosticsStore(schema).migrations(conn)
    except psycopg.errors.UndefinedTable:
        report.add(
            "schema",
            "problem",
            f"the pipeline schema {schema!r} is not installed",
            "run `pipeline db upgrade`",
        )
        return False
    shipped = [m.version for m in available_migrations()]
    pending = [v for v in shipped if v not in recorded]
    newer = sorted(v for v in recorded if v > max(shipped))
    current = max((v for v in recorded if v != FUNCTIONS_VERSION), default=0)
    if newer:
        report.add(
            "schema",
            "problem",
            f"schema {schema!r} is at migration {newer[-1]}, newer than this code "
            f"(latest {max(shipped)})",
            "upgrade the pipeline package on this host",
        )
    elif pending:
        report.add(
            "schema",
            "problem",
            f"schema {schema!r} is at migration {current}; pending: {pending}",
            "run `pipeline db upgrade`",
        )
    elif recorded.get(FUNCTIONS_VERSION) != functions_checksum(schema):
        report.add(
            "schema",
            "problem",
            "the schema's functions and triggers differ from this version's functions.sql",
            "run `pipeline db upgrade`",
        )
    else:
        report.add("schema", "ok", f"schema {schema!r} at migration {current}, up to date")
    _check_indexes(conn, schema, report)
    _check_triggers(conn, schema, report)
    return True


def _check_indexes(conn: psycopg.Connection[Any], schema: str, report: Report) -> None:
    found = DiagnosticsStore(schema).indexes(conn)
    declared = declared_indexes(schema)
    missing = [name for name in declared if name not in found]
    invalid = sorted(name for name, valid in found.items() if not valid)
    for name in missing:
        report.add(
            "indexes",
            "problem",
            f"index {name} is missing",
            declared[name] or f"restore the primary key of {name.removesuffix('_pkey')}",
        )
    for name in invalid:
        report.add(
            "indexes",
            "problem",
            f"index {name} is invalid (an interrupted CREATE INDEX CONCURRENTLY)",
            f"DROP INDEX CONCURRENTLY {_qualified(schema, name)}; then create it again",
        )
    if not missing and not invalid:
        report.add("indexes", "ok", f"all {len(declared)} declared indexes present and valid")


@lru_cache(maxsize=8)
def declared_indexes(schema: str) -> dict[str, str]:
    """Index name -> the statement that creates it (empty for primary keys)."""
    translated = MetaData()
    statements: dict[str, str] = {}
    for table in metadata.sorted_tables:
        copy = table.to_metadata(translated, schema=schema)
        if copy.primary_key.columns:
            statements[str(copy.primary_key.name or f"{copy.name}_pkey")] = ""
        for index in sorted(copy.indexes, key=lambda i: str(i.name)):
            ddl = str(CreateIndex(index).compile(dialect=postgresql.dialect()))  # type: ignore[no-untyped-call]
            statements[str(index.name)] = ddl.replace(
                "CREATE INDEX", "CREATE INDEX CONCURRENTLY", 1
            )
    return statements


def declared_triggers() -> dict[str, str]:
    """Trigger name -> table, as ``functions.sql`` creates them."""
    text = (resources.files("pipeline.db") / "functions.sql").read_text("utf-8")
    return dict(re.findall(r"CREATE TRIGGER (\w+) .*?\bON (\w+)", text, re.DOTALL))


def declared_functions() -> list[str]:
    text = (resources.files("pipeline.db") / "functions.sql").read_text("utf-8")
    return re.findall(r"CREATE OR REPLACE FUNCTION (\w+)", text)


def _check_triggers(conn: psycopg.Connection[Any], schema: str, report: Report) -> None:
    store = DiagnosticsStore(schema)
    found = store.triggers(conn)
    functions = store.functions(conn)
    table = _qualified(schema, "schema_migrations")
    reapply = (
        f"remove the functions' checksum row (version {FUNCTIONS_VERSION}) from {table}; then "
        "`pipeline db upgrade` re-applies functions.sql"
    )
    problems = 0
    for name, table in declared_triggers().items():
        if name not in found or found[name][0] != table:
            report.add("triggers", "problem", f"trigger {name} on {table} is missing", reapply)
            problems += 1
        elif not found[name][1]:
            report.add(
                "triggers",
                "problem",
                f"trigger {name} on {table} is disabled",
                f"ALTER TABLE {_qualified(schema, table)} ENABLE TRIGGER {name}",
            )
            problems += 1
    for name in declared_functions():
        if name not in functions:
            report.add("triggers", "problem", f"function {name} is missing", reapply)
            problems += 1
    if not problems:
        report.add("triggers", "ok", "the outbox triggers and functions are present and enabled")


def _qualified(schema: str, name: str) -> str:
    return sql.Identifier(schema, name).as_string()


# -- database state --------------------------------------------------------------------------
def _check_dead_letters(conn: psycopg.Connection[Any], schema: str, report: Report) -> None:
    counts = DiagnosticsStore(schema).dead_letters_waiting(conn)
    total = sum(counts.values())
    if total:
        stages = ", ".join(f"{n} at {stage}" for stage, n in sorted(counts.items()))
        report.add(
            "dead_letters",
            "problem",
            f"{total} dead letters waiting ({stages})",
            "inspect them with `pipeline dlq list` and `pipeline dlq show ID`, fix the cause, "
            "then `pipeline dlq replay --dry-run` and `pipeline dlq replay`",
        )
    else:
        report.add("dead_letters", "ok", "no dead letters waiting")


START_HINTS = {
    "relay": "start `pipeline relay` (events wait in the outbox until one runs)",
    "worker": "start `pipeline worker` (deliveries wait on the broker until one runs)",
}


def _check_processes(
    conn: psycopg.Connection[Any], settings: Settings, report: Report, kind: Kind
) -> None:
    """The relays' or worker processes' heartbeats: alive, stale (a problem) or gone."""
    check = f"{kind}s"
    states = [(p, process_state(p)) for p in HeartbeatStore(settings, kind).processes(conn)]
    alive = [p for p, state in states if state in ("busy", "idle")]
    stale = [p for p, state in states if state == "stale"]
    gone = [p for p, state in states if state == "gone"]
    for process in stale:
        report.add(
            check,
            "problem",
            f"{kind} {process.process_id} ({process.host} pid {process.pid}) has not refreshed "
            f"its heartbeat for {process.heartbeat_age_seconds:.0f}s",
            f"check that process: a live {kind} refreshes its heartbeat every few seconds, "
            "idle or busy; it may be paused, stuck, cut off from Postgres, or killed",
        )
    for process in alive:
        _check_process_clock(process, kind, report)
    if alive:
        busy = sum(state == "busy" for _, state in states)
        report.add(
            check,
            "ok",
            f"{len(alive)} {kind}(s) alive ({busy} busy, {len(alive) - busy} idle)"
            + _gone_note(kind, gone),
        )
    elif not stale:
        report.add(
            check, "info", f"no {kind} is running" + _gone_note(kind, gone), START_HINTS[kind]
        )


def _check_process_clock(process: ProcessInfo, kind: Kind, report: Report) -> None:
    """A live process whose clock its heartbeat found more than a second off the database's."""
    skew = clock_skew(process)
    if skew:
        report.add(
            f"{kind}_clock",
            "problem",
            f"{kind} {process.process_id} ({process.host} pid {process.pid}): its clock is {skew}",
            f"synchronise the clock of {process.host} with the database server's (NTP/chrony): "
            "queue messages and publishing slots carry the host's time, the outbox and the "
            "delivery ledger the database's",
        )


def _gone_note(kind: str, gone: list[ProcessInfo]) -> str:
    return f"; {len(gone)} gone (rows left by {kind}s that did not stop cleanly)" if gone else ""


def _check_canary(conn: psycopg.Connection[Any], settings: Settings, report: Report) -> None:
    interval = settings.canary_interval
    if not interval:
        report.add(
            "canary",
            "info",
            "the end-to-end canary is off (PIPELINE_CANARY_INTERVAL=0)",
            "set PIPELINE_CANARY_INTERVAL (default 15) to detect a stalled pipeline",
        )
        return
    age = DiagnosticsStore(settings.schema_name).last_processed_age(conn, CANARY_CONSUMER)
    allowed = max(CANARY_MISSED * interval, CANARY_MIN_AGE)
    fix = (
        "check that a relay and a worker are running (`pipeline status`), and that the "
        "workers consume the pipeline.pipeline_canary queue"
    )
    if age is None:
        report.add("canary", "problem", "no canary event has ever completed the path", fix)
    elif age > allowed:
        report.add(
            "canary",
            "problem",
            f"the last canary completed {age:.0f}s ago (over {allowed:.0f}s)",
            fix,
        )
    else:
        report.add("canary", "ok", f"the last canary completed {age:.1f}s ago")


def _check_server(
    conn: psycopg.Connection[Any], settings: Settings, report: Report, clock: Callable[[], float]
) -> None:
    store = DiagnosticsStore(settings.schema_name)
    before = clock()
    database_time, queue_usage, server_pid = store.server(conn)
    after = clock()
    skew = database_time - (before + after) / 2
    if abs(skew) > CLOCK_SKEW_LIMIT + (after - before) / 2:
        report.add(
            "clock",
            "problem",
            f"this host's clock is {abs(skew):.1f}s {'behind' if skew > 0 else 'ahead of'} "
            "the database's",
            "synchronise clocks (NTP/chrony) on this host and the database server: the "
            "delivery ledger allows one second between them",
        )
    else:
        report.add("clock", "ok", f"clock skew to the database {skew * 1000:+.0f} ms")
    if queue_usage > NOTIFY_QUEUE_LIMIT:
        report.add(
            "notify_queue",
            "problem",
            f"the notification queue is {queue_usage:.0%} full",
            "a session LISTENs without reading (or holds a long transaction): find it in "
            "pg_stat_activity and end it; a full queue makes every NOTIFY (every outbox "
            "insert while relays are idle) fail",
        )
    else:
        report.add("notify_queue", "ok", f"notification queue {queue_usage:.1%} full")
    if conn.info.backend_pid != server_pid:
        report.add(
            "pooler",
            "info",
            f"a connection pooler sits between this host and Postgres at "
            f"{describe_server(settings.require_database_url())} (it reports process "
            f"{conn.info.backend_pid}, the server {server_pid})",
            "the relay's LISTEN needs a direct or session-pooled connection",
        )


def _check_listen(settings: Settings, report: Report) -> None:
    """A NOTIFY on one connection must reach a LISTEN on another (see the module docstring)."""
    channel = f"pipeline_doctor_{uuid.uuid4().hex[:12]}"
    where = describe_server(settings.require_database_url())
    try:
        with (
            connect(settings, autocommit=True, prepare_threshold=None) as listener,
            connect(settings, autocommit=True, prepare_threshold=None) as sender,
        ):
            listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            sender.execute("SELECT pg_notify(%s, 'doctor')", (channel,))
            arrived = list(listener.notifies(timeout=LISTEN_TIMEOUT, stop_after=1))
    except (psycopg.Error, ServiceUnavailableError) as exc:
        report.add(
            "listen",
            "problem",
            f"LISTEN/NOTIFY failed at {where}: {type(exc).__name__}",
            "give the relay a direct (or session-pooled) PIPELINE_DATABASE_URL",
        )
        return
    if not arrived:
        report.add(
            "listen",
            "problem",
            f"a NOTIFY did not reach a LISTEN within {LISTEN_TIMEOUT:.0f}s at {where}: the URL "
            "goes through a transaction pooler (e.g. PgBouncer pool_mode=transaction)",
            "point the relay's PIPELINE_DATABASE_URL at Postgres directly or at a "
            "session-pooled PgBouncer database; producers and workers may keep the pooler",
        )
    else:
        report.add("listen", "ok", f"LISTEN/NOTIFY works at {where}")


# -- broker ----------------------------------------------------------------------------------
DRAMATIQ_TIME_LIMIT_MS = 600_000  # Dramatiq's TimeLimit for an actor that sets none


def longest_hold_ms(settings: Settings, consumers: Sequence[ConsumerPolicy]) -> int:
    """The longest a worker may hold one message unacknowledged while running it: a
    handler's time limit (Dramatiq's ten minutes where none is declared), the publishing
    actor's lease. Delays (a retry's backoff) are not counted: the RabbitMQ consumer holds
    a delayed message at most half the ``consumer_timeout`` it is told, and puts one due
    later back on the delay queue."""
    holds = [int(settings.lease_seconds * 1000)]
    for policy in consumers:
        limit = policy.time_limit
        holds.append(DRAMATIQ_TIME_LIMIT_MS if limit is None else int(limit * 1000))
    return max(holds)


def _check_broker(
    settings: Settings, consumers: Sequence[ConsumerPolicy], report: Report
) -> float | None:
    """The transport's own checks (Redis or RabbitMQ); returns the measured round trip."""
    if settings.broker_url is None:
        report.add(
            "redis",
            "problem",
            "PIPELINE_BROKER_URL is not set (or its older name PIPELINE_REDIS_URL)",
            "set PIPELINE_BROKER_URL",
        )
        return None
    diagnosis = transport_class(settings.require_broker_url()).diagnose(
        settings, longest_hold_ms(settings, consumers)
    )
    for finding in diagnosis.findings:
        report.add(finding.check, finding.status, finding.summary, finding.fix)
    return diagnosis.round_trip


# -- settings --------------------------------------------------------------------------------
def _check_retention(
    settings: Settings, consumers: Sequence[ConsumerPolicy], report: Report
) -> None:
    """The retention rule's first problem, in the words a worker would refuse with."""
    problems = retention_problems(settings, consumers)
    if problems:
        first = problems[0]
        report.add(
            "inbox_retention",
            "problem",
            first.summary,
            f"{first.fix} (workers, relays and `pipeline prune` refuse to run until then)",
        )
        return
    longest = consumer_with_longest_horizon(consumers)
    covered = (
        f" of consumer {longest.consumer!r} ({longest.retry_horizon:g}s)"
        if longest is not None
        else " (no consumer known: pass --app)"
    )
    report.add(
        "inbox_retention",
        "ok",
        f"inbox retention {settings.inbox_retention_seconds}s covers the longest retry "
        f"horizon{covered}",
    )


def check_message_key(settings: Settings, report: Report) -> None:
    """Whether workers can tell the relays' messages from anyone else's (docs/security.md)."""
    keys = MessageKeys.from_settings(settings)
    if not keys.explicit:
        report.add(
            "message_key",
            "warning",
            "PIPELINE_MESSAGE_KEY is not set: messages are not signed, so anyone who can "
            "write to the broker can make handlers run on events that were never produced",
            "set the same PIPELINE_MESSAGE_KEY (at least 32 characters) on relays and "
            "workers, or PIPELINE_MESSAGE_KEY=insecure to accept unsigned messages on purpose",
        )
    elif not keys.signing:
        off = settings.message_key.get_secret_value() if settings.message_key else ""
        report.add(
            "message_key",
            "info",
            f"PIPELINE_MESSAGE_KEY={off}: messages are not signed, on purpose; the broker "
            "is trusted like the database",
        )
    elif keys.accept_unsigned:
        report.add(
            "message_key",
            "warning",
            "PIPELINE_MESSAGE_KEY_PREVIOUS=insecure: messages are signed, but workers still "
            "accept unsigned ones (meant only while a key is introduced)",
            "once every relay signs, unset PIPELINE_MESSAGE_KEY_PREVIOUS on the workers",
        )
    else:
        rotation = " and the previous one" if keys.previous else ""
        report.add(
            "message_key",
            "ok",
            f"messages are signed; workers accept the current key{rotation} only",
        )


def _check_lease(
    settings: Settings,
    consumers: int,
    pg_rtt: float | None,
    broker_rtt: float | None,
    report: Report,
) -> None:
    if pg_rtt is None or broker_rtt is None:
        return  # the unreachable server is already a problem
    estimate = 2 * pg_rtt + broker_rtt + settings.batch_size * max(consumers, 1) * _encode_cost()
    needed = LEASE_SAFETY * estimate
    if settings.lease_seconds < needed:
        report.add(
            "lease",
            "problem",
            f"PIPELINE_LEASE_SECONDS={settings.lease_seconds:g} is under {LEASE_SAFETY:g}x a "
            f"full batch's estimated publish time ({estimate * 1000:.1f} ms): leases may "
            "expire mid-publish and another relay publish the same events again",
            f"raise PIPELINE_LEASE_SECONDS to at least {needed:.1f} (default 30), or lower "
            "PIPELINE_BATCH_SIZE",
        )
    else:
        report.add(
            "lease",
            "ok",
            f"lease {settings.lease_seconds:g}s; a full batch of {settings.batch_size} is "
            f"estimated at {estimate * 1000:.1f} ms",
        )


def _encode_cost(samples: int = 200) -> float:
    """Seconds to encode one envelope of a 1 KiB payload, measured here."""
    event = OutboxEvent(
        id=uuid.uuid4(),
        seq=1,
        aggregate_type="order",
        aggregate_id="1",
        ordering_key="order:1",
        event_type="doctor.sample",
        event_version=1,
        payload_json='{"data":"' + "x" * 1024 + '"}',
        headers_json="{}",
        attempts=1,
        created_at=datetime.now(UTC),
    )
    started = time.perf_counter()
    for _ in range(samples):
        encode_envelope(event, "/pipeline/doctor")
    return (time.perf_counter() - started) / samples


def _round_trip(call: Callable[[], object], samples: int = 5) -> float:
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def format_report(report: Report) -> str:
    """The human-readable report: one line per finding, its fix indented below."""
    marks = {"ok": "ok     ", "info": "info   ", "warning": "WARNING", "problem": "PROBLEM"}
    lines = [f"pipeline doctor: {'healthy' if report.healthy else 'PROBLEMS FOUND'}"]
    for finding in report.findings:
        lines.append(f"  {marks[finding.status]} {finding.check}: {finding.summary}")
        if finding.fix and finding.status != "ok":
            lines.append(f"          fix: {finding.fix}")
    return "\n".join(lines)
