"""Per-call costs too small for an end-to-end run to resolve: ``python -m benchmarks.micro``.

Strategies, each CPU time of one process (a neighbour's load changes it less than wall
time), the cases interleaved over ``--rounds``:

* ``spans``: CPU microseconds per ``create`` span (formatting the ``traceparent`` the row
  stores) and per ``process`` span (parsing it back), ``--spans`` of each, by tracing
  set-up, each in a process of its own set up by ``configure_tracing``: ``off``
  (``OTEL_SDK_DISABLED``), ``none`` (the default: no provider, each event gets a trace
  context of its own), ``otlp`` (the SDK's provider, every span exported by the official
  OTLP/HTTP exporter to a local sink; the export thread's CPU included) and ``sampled``
  (``parentbased_traceidratio`` at 0.1).
* ``drivers``: client CPU per transaction of the database libraries under ``add_event``:
  an ORM ``Session`` against a Core connection (BEGIN, ``SELECT 1``, COMMIT), one INSERT
  through ``Session.execute(text())`` against ``exec_driver_sql``, and psycopg alone in a
  transaction (three round trips) against autocommit (one).
* ``backlog_gate``: what ``PIPELINE_BACKLOG_LIMIT`` adds to ``add_event*``: the per-call
  check (limit off and on) and the bounded count a producer process runs at most once a
  second with a limit, for ``--unsent`` events waiting and each of ``--limits``.
* ``payload_check``: what the outbox's ceiling on payload size adds to a row, by how it is
  enforced (none, a CHECK, a ``BEFORE INSERT OR UPDATE OF payload`` trigger): ``--rows``
  single-row INSERTs of ~1 KiB payloads in one transaction (rows/s), the same rows by
  ``INSERT … SELECT`` and an ``UPDATE`` of their status (server time per row: a CHECK is
  evaluated on every update of the row, the trigger only when the payload changes).
* ``authenticity``: what it costs a worker to know a message is authentic, per message:
  verifying the envelope's HMAC (``EnvelopeSigner.verify`` on a signed ~1 KiB envelope,
  what ships) against one SELECT in an open transaction, as the inbox would run it
  (``exec_driver_sql`` on the session's connection), that the event is in the outbox with
  the same payload (``payload = $2::jsonb``, or the SHA-256 of both payloads' jsonb text),
  the id found by the primary key among ``--outbox-rows`` rows. Wall and client CPU per
  message, and the server backend's CPU (``/proc/<pid>/schedstat``).

Without ``--database-url`` it starts a throwaway durable Postgres (``spans`` needs none).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import timeit
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from pydantic import SecretStr
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from benchmarks import harness
from pipeline.config import Settings
from pipeline.db.migrate import upgrade
from pipeline.db.stores.outbox import OutboxStore
from pipeline.envelope import OutboxEvent, encode_envelope
from pipeline.outbox import BacklogGate
from pipeline.signing import EnvelopeSigner, canonical_json, event_source

SPAN_MODES = ("off", "none", "otlp", "sampled")
TABLE = "bench_dependency_costs"
INSERT_TEXT = text(f"INSERT INTO {TABLE} (n) VALUES (:n)")
INSERT_DRIVER = f"INSERT INTO {TABLE} (n) VALUES (%(n)s)"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- spans --------------------------------------------------------------------------------


def span_child(mode: str, spans: int) -> dict[str, float]:
    """One tracing set-up in this process: CPU per create span and per process span."""
    from opentelemetry import trace

    from pipeline.envelope import ReceivedEvent
    from pipeline.observability import tracing

    sink = harness.OtlpSink()
    if mode == "off":
        os.environ["OTEL_SDK_DISABLED"] = "true"
    elif mode in ("otlp", "sampled"):
        os.environ.update(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint)
        os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = str(2 * spans)  # drop nothing
    if mode == "sampled":
        os.environ.update(
            OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG="0.1"
        )
    tracing.configure_tracing(Settings(), "span-cost")
    flush = getattr(trace.get_tracer_provider(), "force_flush", lambda: True)
    ids = [uuid.uuid4() for _ in range(spans)]
    tracing.start_create_span("warm.up", uuid.uuid4()).end()  # one-time set-up is not per span

    started = _cpu()
    headers = []
    for event_id in ids:
        span = tracing.start_create_span("order.placed", event_id, correlation_id="c-1")
        headers.append(tracing.span_headers(span))
        span.end()
    flush()
    create = (_cpu() - started) / spans

    events = [
        ReceivedEvent(
            id=event_id,
            type="order.placed",
            version=1,
            data={},
            source="span-cost",
            time="2026-01-01T00:00:00Z",
            seq=n,
            correlation_id="c-1",
            traceparent=header.get("traceparent"),
        )
        for n, (event_id, header) in enumerate(zip(ids, headers, strict=True))
    ]
    started = _cpu()
    for event in events:
        with tracing.process_span(event, "billing", 1):
            pass
    flush()
    process = (_cpu() - started) / spans
    tracing.shutdown_tracing()
    sink.shutdown()
    return {"create_us": round(create * 1e6, 2), "process_us": round(process * 1e6, 2)}


def spans(args: argparse.Namespace, url: str | None) -> dict[str, Any]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in SPAN_MODES}
    for _ in range(args.rounds):
        for mode in SPAN_MODES:
            command = [sys.executable, "-m", "benchmarks.micro", "--span-child", mode]
            out = subprocess.run(
                [*command, "--spans", str(args.spans)],
                check=True,
                capture_output=True,
                text=True,
                cwd=harness.ROOT,
                env=environment,
            ).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
    return {
        "unit": "CPU microseconds per span (process CPU, export thread included)",
        "spans_per_run": args.spans,
        "median": {
            mode: {k: statistics.median(r[k] for r in results) for k in ("create_us", "process_us")}
            for mode, results in runs.items()
        },
        "runs": runs,
    }


# -- drivers ------------------------------------------------------------------------------


def driver_cases(engine: Engine, url: str) -> dict[str, Callable[[int], None]]:
    """Each case runs ``n`` transactions (or statements, for the statement cases)."""
    raw = psycopg.connect(url)
    auto = psycopg.connect(url, autocommit=True)

    def orm_session_empty(n: int) -> None:
        for _ in range(n):
            with Session(engine) as session, session.begin():
                session.connection().exec_driver_sql("SELECT 1")

    def core_connection_empty(n: int) -> None:
        for _ in range(n):
            with engine.begin() as connection:
                connection.exec_driver_sql("SELECT 1")

    def session_execute_text(n: int) -> None:
        with Session(engine) as session, session.begin():
            for i in range(n):
                session.execute(INSERT_TEXT, {"n": i})

    def exec_driver_sql(n: int) -> None:
        with engine.begin() as connection:
            for i in range(n):
                connection.exec_driver_sql(INSERT_DRIVER, {"n": i})

    def psycopg_transaction(n: int) -> None:
        for i in range(n):
            with raw.transaction():
                raw.execute(INSERT_DRIVER, {"n": i})

    def psycopg_autocommit(n: int) -> None:
        for i in range(n):
            auto.execute(INSERT_DRIVER, {"n": i})

    return {
        "orm_session_empty": orm_session_empty,
        "core_connection_empty": core_connection_empty,
        "session_execute_text": session_execute_text,
        "exec_driver_sql": exec_driver_sql,
        "psycopg_transaction": psycopg_transaction,
        "psycopg_autocommit": psycopg_autocommit,
    }


def drivers(args: argparse.Namespace, url: str | None) -> dict[str, Any]:
    assert url is not None
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as connection:
        connection.exec_driver_sql(f"DROP TABLE IF EXISTS {TABLE}")
        connection.exec_driver_sql(f"CREATE TABLE {TABLE} (n integer)")
    cases = driver_cases(engine, url)
    for case in cases.values():
        case(300)  # warm-up: pools, prepared statements, caches
    by_case: dict[str, list[float]] = {name: [] for name in cases}
    for round_index in range(args.rounds):
        for name in harness.rotated(list(cases), round_index):
            started = time.process_time()
            cases[name](args.calls)
            by_case[name].append(round((time.process_time() - started) / args.calls * 1e6, 1))
    with engine.begin() as connection:
        connection.exec_driver_sql(f"DROP TABLE {TABLE}")
    engine.dispose()
    medians = {name: statistics.median(values) for name, values in by_case.items()}
    for name, median in medians.items():
        print(f"  {name:24} {median:8.1f} µs  {by_case[name]}")
    return {
        "unit": "client CPU microseconds per transaction (per statement for the statement cases)",
        "cpu_us": {
            name: {"by_round": values, "median": medians[name]} for name, values in by_case.items()
        },
        "differences_us": {
            "orm_session_over_core_connection": round(
                medians["orm_session_empty"] - medians["core_connection_empty"], 1
            ),
            "session_execute_text_over_exec_driver_sql": round(
                medians["session_execute_text"] - medians["exec_driver_sql"], 1
            ),
            "begin_and_commit_round_trips_in_psycopg": round(
                medians["psycopg_transaction"] - medians["psycopg_autocommit"], 1
            ),
        },
    }


# -- backlog gate -------------------------------------------------------------------------


def gate_call_us(limit: int) -> float:
    """Microseconds of the gate's per-call work (``add_events``' check without SQL)."""
    gate = BacklogGate()
    settings = Settings(database_url=SecretStr("postgresql://unused/db"), backlog_limit=limit)
    gate.record(settings, 0)

    def call() -> None:
        if settings.backlog_limit and gate.due(settings):
            gate.record(settings, 0)  # a producer would count now (once a second): not timed here
        gate.check(settings)

    number = 200_000
    return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6


def gate_count_ms(url: str, schema: str, unsent: int, limits: Sequence[int]) -> dict[str, float]:
    store = OutboxStore(schema)
    outbox = f'"{schema}".outbox'
    result = {}
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {outbox}")
        conn.execute(
            f"INSERT INTO {outbox} (id, event_type, payload) "
            "SELECT gen_random_uuid(), 'bench.gate', '{}' FROM generate_series(1, %s)",
            (unsent,),
        )
        conn.execute(f"VACUUM ANALYZE {outbox}")
        for limit in limits:
            times = []
            for _ in range(9):
                started = time.perf_counter()
                store.count_backlog(conn, limit + 1)
                times.append(time.perf_counter() - started)
            result[str(limit)] = round(statistics.median(times) * 1000, 3)
        conn.execute(f"TRUNCATE {outbox}")
    return result


def migrated_schema(args: argparse.Namespace, url: str) -> str:
    """The pipeline schema the strategy works in (its own one on a given server), migrated."""
    schema = "pipeline_bench" if args.database_url else "pipeline"
    engine = create_engine("postgresql+psycopg://" + url.split("://", 1)[1])
    with engine.begin() as connection:
        upgrade(connection, schema)
    engine.dispose()
    return schema


def backlog_gate(args: argparse.Namespace, url: str | None) -> dict[str, Any]:
    assert url is not None
    schema = migrated_schema(args, url)
    limits = [int(v) for v in args.limits.split(",")]
    return {
        "per_call_us": {
            "limit_off": round(gate_call_us(0), 3),
            "limit_on": round(gate_call_us(1_000_000), 3),
        },
        "count_ms_by_unsent_and_limit": {
            unsent: gate_count_ms(url, schema, int(unsent), limits)
            for unsent in args.unsent.split(",")
        },
        "note": "the count runs at most once a second per producer process, only with a limit",
    }


# -- payload check ------------------------------------------------------------------------

PAYLOAD_LIMIT = 256 * 1024
# The candidates' conditions: rows whose payload they accept. ``exact`` measures compact JSON
# only when the jsonb text (a space after each ',' and ':') is over the limit.
PAYLOAD_CONDITIONS = {
    "none": None,
    "check_0005": "pg_column_size(payload) <= 262144 OR octet_length(payload::text) <= 1048576",
    "check_text_only": f"octet_length(payload::text) <= {PAYLOAD_LIMIT}",
    "check_exact": (
        f"octet_length(payload::text) <= {PAYLOAD_LIMIT} OR octet_length(json_strip_nulls("
        f"replace(payload::text, ': null', ': 1234')::json)::text) <= {PAYLOAD_LIMIT}"
    ),
}
PAYLOAD_TRIGGERS = ("trigger_exact", "trigger_when")  # plpgsql always, or past a WHEN


def bench_payload(n: int) -> dict[str, Any]:
    """An order-like event of about 1 KiB of compact JSON."""
    return {
        "order_id": str(uuid.UUID(int=n)),
        "customer": {"id": n, "name": f"Customer {n}", "email": f"c{n}@example.com"},
        "items": [
            {"sku": f"SKU-{n % 97}-{i}", "qty": i + 1, "price": 12.5 + i, "note": None}
            for i in range(9)
        ],
        "shipping": [
            {"line": f"{n} Example Street, building {i}", "city": "Springfield", "zip": 10_000 + i}
            for i in range(5)
        ],
        "currency": "EUR",
    }


def payload_tables(conn: psycopg.Connection[Any], schema: str) -> list[str]:
    """One table shaped like the outbox (its columns, defaults and indexes) per candidate."""
    names = []
    for name, condition in [*PAYLOAD_CONDITIONS.items(), *((t, None) for t in PAYLOAD_TRIGGERS)]:
        table = f"bench_payload_{name}"
        conn.execute(f"DROP TABLE IF EXISTS {table}")
        conn.execute(
            f'CREATE TABLE {table} (LIKE "{schema}".outbox '
            "INCLUDING DEFAULTS INCLUDING IDENTITY INCLUDING INDEXES)"
        )
        if condition:
            conn.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_check CHECK ({condition})")
        names.append(table)
    conn.execute(
        f"""
        CREATE OR REPLACE FUNCTION bench_payload_size() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF {PAYLOAD_CONDITIONS["check_exact"].replace("payload", "NEW.payload")} THEN
                RETURN NEW;
            END IF;
            RAISE check_violation USING CONSTRAINT = 'outbox_payload_size_check';
        END $$"""
    )
    trigger = (
        "CREATE TRIGGER bench_payload_size BEFORE INSERT OR UPDATE OF payload ON {} "
        "FOR EACH ROW {} EXECUTE FUNCTION bench_payload_size()"
    )
    text_over = f"WHEN (octet_length(NEW.payload::text) > {PAYLOAD_LIMIT})"
    conn.execute(trigger.format("bench_payload_trigger_exact", ""))
    conn.execute(trigger.format("bench_payload_trigger_when", text_over))
    return names


def payload_round(conn: psycopg.Connection[Any], table: str, rows: int) -> dict[str, float]:
    """Rows/s of single-row INSERTs in one transaction; server µs/row (the least of three
    runs: a neighbour's burst only adds) of INSERT…SELECT, UPDATE, and the condition alone."""
    params = [(uuid.uuid4(), Jsonb(bench_payload(n))) for n in range(rows)]
    conn.execute(f"TRUNCATE {table}")
    started = time.perf_counter()
    with conn.transaction(), conn.cursor() as cursor:
        cursor.executemany(
            f"INSERT INTO {table} (id, event_type, payload) VALUES (%s, 'bench', %s)", params
        )
    inserts = rows / (time.perf_counter() - started)

    def server_us(statement: str, before: str = "") -> float:
        times = []
        for _ in range(3):
            if before:
                conn.execute(before)
            with conn.transaction():
                conn.execute("SET LOCAL jit = off")
                plan = conn.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}").fetchone()
            assert plan is not None
            times.append(float(plan[0][0]["Execution Time"]) * 1000 / rows)
        return min(times)

    update_us = server_us(f"UPDATE {table} SET status = 'sent'")
    select_us = server_us(
        f"INSERT INTO {table} (id, event_type, payload) "
        "SELECT gen_random_uuid(), 'bench', payload FROM bench_payload_source",
        before=f"TRUNCATE {table}",
    )
    name = table.removeprefix("bench_payload_")
    condition = (
        PAYLOAD_CONDITIONS.get(name)
        or (PAYLOAD_CONDITIONS["check_exact" if name == "trigger_exact" else "check_text_only"])
    )
    condition_us = server_us(
        "SELECT count(*) FROM bench_payload_source WHERE "
        + (f"({condition}) IS NOT FALSE" if name != "none" else "payload IS NOT NULL")
    )
    return {
        "inserts_per_s": round(inserts),
        "insert_select_us_per_row": round(select_us, 2),
        "update_us_per_row": round(update_us, 2),
        "condition_us_per_row": round(condition_us, 2),
    }


def payload_check(args: argparse.Namespace, url: str | None) -> dict[str, Any]:
    assert url is not None
    schema = migrated_schema(args, url)
    runs: dict[str, list[dict[str, float]]] = {}
    with psycopg.connect(url, autocommit=True) as conn:
        tables = payload_tables(conn, schema)
        conn.execute("DROP TABLE IF EXISTS bench_payload_source")
        conn.execute("CREATE TABLE bench_payload_source (payload jsonb)")
        with conn.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO bench_payload_source VALUES (%s)",
                [(Jsonb(bench_payload(n)),) for n in range(args.rows)],
            )
        for table in tables:
            payload_round(conn, table, min(args.rows, 500))  # warm-up: caches, plans
        for round_index in range(args.rounds):
            for table in harness.rotated(tables, round_index):
                name = table.removeprefix("bench_payload_")
                runs.setdefault(name, []).append(payload_round(conn, table, args.rows))
        for table in [*tables, "bench_payload_source"]:
            conn.execute(f"DROP TABLE {table}")
        conn.execute("DROP FUNCTION bench_payload_size()")
    size = len(json.dumps(bench_payload(0), separators=(",", ":")))
    median = {
        name: {key: statistics.median(run[key] for run in results) for key in results[0]}
        for name, results in runs.items()
    }
    least = {
        name: {key: min(run[key] for run in results) for key in results[0] if "_us_" in key}
        for name, results in runs.items()
    }
    for name, values in median.items():
        print(f"  {name:16} {values}")
    return {
        "unit": "rows/s (one transaction of single-row INSERTs); server µs per row, least "
        "of 3 (EXPLAIN ANALYZE of INSERT … SELECT, of UPDATE status, and of a SELECT "
        "evaluating the condition alone: the trigger's row shows the exact condition)",
        "payload_bytes": size,
        "rows": args.rows,
        "conditions": {
            **PAYLOAD_CONDITIONS,
            "trigger_exact": "check_exact in a plpgsql trigger, on every insert",
            "trigger_when": "the trigger only WHEN the jsonb text is over the limit",
        },
        "median": median,
        "least": least,
        "runs": runs,
    }


# -- authenticity -------------------------------------------------------------------------

AUTH_CONSUMER = "billing"
AUTH_KEY = "bench-message-key-0123456789abcdef"
# The alternative to a signature: the event is in the outbox with the same payload.
AUTH_LOOKUPS = {
    "lookup_jsonb_equal": "SELECT 1 FROM {outbox} WHERE id = %(id)s AND payload = %(data)s::jsonb",
    "lookup_sha256": (
        "SELECT 1 FROM {outbox} WHERE id = %(id)s AND sha256(convert_to(payload::text, 'UTF8'))"
        " = sha256(convert_to(%(data)s::jsonb::text, 'UTF8'))"
    ),
}


def backend_cpu_ns(pid: int) -> int:
    """CPU nanoseconds a (local) server backend has run: the first field of its schedstat."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def auth_envelopes(signer: EnvelopeSigner, count: int) -> tuple[list[OutboxEvent], list[Any]]:
    """``count`` order events and their envelopes as a worker holds them: signed by the
    relay's code for one consumer, then parsed."""
    events = [
        OutboxEvent(
            uuid.uuid4(),
            n + 1,
            "order",
            f"order-{n}",
            f"order-{n}",
            "order.placed",
            1,
            json.dumps(bench_payload(n), separators=(",", ":")),
            '{"correlation_id": "c-1"}',
            0,
            datetime.now(UTC),
        )
        for n in range(count)
    ]
    texts = {event.id: encode_envelope(event, signer.deployment) for event in events}
    signed = signer.sign_texts(events, AUTH_CONSUMER, texts, {})
    return events, [json.loads(text) for text in signed]


def auth_outbox(url: str, schema: str, events: Sequence[OutboxEvent], rows: int) -> None:
    """The outbox with ``events`` sent, among filler rows up to ``rows`` in all."""
    outbox = f'"{schema}".outbox'
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {outbox}")
        with conn.cursor() as cursor:
            cursor.executemany(
                f"INSERT INTO {outbox} (id, aggregate_type, aggregate_id, ordering_key, "
                "event_type, payload, status, published_at) "
                "VALUES (%s, %s, %s, %s, %s, %s::jsonb, 'sent', now())",
                [
                    (
                        e.id,
                        e.aggregate_type,
                        e.aggregate_id,
                        e.ordering_key,
                        e.event_type,
                        e.payload_json,
                    )
                    for e in events
                ],
            )
        conn.execute(
            f"INSERT INTO {outbox} (id, event_type, payload, status, published_at) "
            "SELECT gen_random_uuid(), 'bench.filler', jsonb_build_object('n', g), 'sent', now() "
            "FROM generate_series(1, %s) g",
            (max(rows - len(events), 0),),
        )
        conn.execute(f"VACUUM ANALYZE {outbox}")


def authenticity(args: argparse.Namespace, url: str | None) -> dict[str, Any]:
    assert url is not None
    schema = migrated_schema(args, url)
    settings = Settings(message_key=SecretStr(AUTH_KEY), schema_name=schema)
    signer = EnvelopeSigner.from_settings(settings, event_source(settings))
    events, envelopes = auth_envelopes(signer, args.messages)
    auth_outbox(url, schema, events, args.outbox_rows)
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    connection = engine.connect()
    transaction = connection.begin()  # the inbox's transaction, open for every case
    backend = connection.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
    outbox = f'"{schema}".outbox'

    def verify(batch: Sequence[Any]) -> int:
        return sum(signer.verify(envelope, AUTH_CONSUMER) is None for envelope in batch)

    def lookup(statement: str) -> Callable[[Sequence[Any]], int]:
        def run(batch: Sequence[Any]) -> int:
            found = 0
            for envelope in batch:
                params = {"id": envelope["id"], "data": canonical_json(envelope["data"]).decode()}
                found += connection.exec_driver_sql(statement, params).first() is not None
            return found

        return run

    cases: dict[str, Callable[[Sequence[Any]], int]] = {"hmac_verify": verify}
    for name, statement in AUTH_LOOKUPS.items():
        cases[name] = lookup(statement.format(outbox=outbox))
    tampered = [
        {**envelope, "data": {**envelope["data"], "currency": "USD"}} for envelope in envelopes[:50]
    ]
    refused = {name: len(tampered) - case(tampered) for name, case in cases.items()}
    for case in cases.values():
        case(envelopes[:500])  # warm-up: prepared statements, caches
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    for round_index in range(args.rounds):
        for name in harness.rotated(list(cases), round_index):
            server, cpu, wall = backend_cpu_ns(backend), time.process_time(), time.perf_counter()
            found = cases[name](envelopes)
            wall = time.perf_counter() - wall
            cpu = time.process_time() - cpu
            server = backend_cpu_ns(backend) - server
            assert found == len(envelopes), f"{name}: {found} of {len(envelopes)} authentic"
            n = len(envelopes)
            runs[name].append(
                {
                    "wall_us": round(wall / n * 1e6, 2),
                    "client_cpu_us": round(cpu / n * 1e6, 2),
                    "server_cpu_us": round(server / n / 1e3, 2),
                }
            )
    transaction.rollback()
    connection.close()
    engine.dispose()
    median = {
        name: {key: statistics.median(run[key] for run in results) for key in results[0]}
        for name, results in runs.items()
    }
    for name, values in median.items():
        print(f"  {name:20} {values}")
    return {
        "unit": "microseconds per message: wall, client process CPU, server backend CPU "
        "(median of the interleaved rounds)",
        "messages_per_round": args.messages,
        "outbox_rows": args.outbox_rows,
        "payload_bytes": len(events[0].payload_json),
        "envelope_bytes": len(json.dumps(envelopes[0], separators=(",", ":"))),
        "index": "outbox primary key (id); the payload compared on the one row found",
        "statements": AUTH_LOOKUPS,
        "transaction": "one open transaction (SQLAlchemy Core connection, exec_driver_sql, "
        "psycopg 3 preparing repeated statements), as the inbox runs its queries; BEGIN and "
        "COMMIT are the inbox's anyway and not counted",
        "tampered_refused_of_50": refused,
        "retention": "the relay's janitor and `pipeline prune` delete sent outbox rows after "
        "PIPELINE_SENT_RETENTION_SECONDS (7 days by default): a retry or a replay of the "
        "message after that finds no row, so a lookup would refuse it; the HMAC needs no row",
        "median": median,
        "runs": runs,
    }


STRATEGIES = {
    "spans": spans,
    "drivers": drivers,
    "backlog_gate": backlog_gate,
    "payload_check": payload_check,
    "authenticity": authenticity,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--only", default=",".join(STRATEGIES), help="strategies")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (spans, drivers)")
    parser.add_argument("--spans", type=int, default=20_000, help="spans: spans of each kind")
    parser.add_argument("--calls", type=int, default=3000, help="drivers: calls per case")
    parser.add_argument("--unsent", default="10000,100000", help="backlog_gate: events waiting")
    parser.add_argument("--limits", default="10000,1000000", help="backlog_gate: limits")
    parser.add_argument("--rows", type=int, default=5000, help="payload_check: rows per run")
    parser.add_argument("--messages", type=int, default=5000, help="authenticity: per round")
    parser.add_argument("--outbox-rows", type=int, default=200_000, help="authenticity: rows")
    parser.add_argument("--database-url")
    parser.add_argument("--output", type=Path, default=harness.RESULTS / "micro.json")
    parser.add_argument("--span-child", choices=SPAN_MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.span_child:
        print(json.dumps(span_child(args.span_child, args.spans)))
        return 0
    strategies = [s for s in args.only.split(",") if s]
    if unknown := sorted(set(strategies) - set(STRATEGIES)):
        parser.error(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    report = harness.header("micro", argv)
    needs_database = strategies != ["spans"]
    with harness.servers(args.database_url if needs_database else "", with_redis=False) as servers:
        if needs_database:
            report["servers"] = servers.describe()
        for name in strategies:
            report[name] = STRATEGIES[name](args, servers.database_url or None)
            harness.write_report(args.output, report)
    print(json.dumps({name: report[name] for name in strategies}, indent=1)[:3000])
    return harness.done(report, args.output)


if __name__ == "__main__":
    sys.exit(main())
