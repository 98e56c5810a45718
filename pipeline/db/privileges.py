"""The table privileges each pipeline process needs, checked once at start-up.

A role missing a grant that only a rare path uses (dead-lettering, retries) would
otherwise run for days and fail in the middle of an incident. ``pipeline relay`` and
``pipeline worker`` therefore compare their database role's privileges with what
their code can run before they serve, and refuse to start with one line naming each
missing grant. The grants are the ones docs/security.md lists per role; a test applies
that page's SQL and checks that each of its grants is required here and that the
processes work with exactly those.

The producer needs INSERT on the outbox only: the insert triggers run as the schema's
owner (SECURITY DEFINER in functions.sql). ``pipeline dlq replay`` and ``purge`` check
their grants the same way before they change anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg

from pipeline.db.stores.diagnostics import DiagnosticsStore
from pipeline.errors import PermissionDeniedError

Grants = Mapping[str, frozenset[str]]
"""Table name (in the pipeline schema) to the privileges needed on it."""

PUBLISHING: Grants = {
    # claim_outbox and the outcomes (sent with its consumers, released, retried, dead)
    "outbox": frozenset({"SELECT", "UPDATE"}),
    # deliveries to ordered consumers are recorded in the inbox (INSERT ... ON CONFLICT
    # reads the key)
    "inbox": frozenset({"SELECT", "INSERT", "UPDATE"}),
    "attempts": frozenset({"INSERT"}),  # the history of failed publish attempts
    "dead_letters": frozenset({"SELECT", "INSERT"}),  # INSERT ... RETURNING reads it back
}
RELAY: Grants = {
    # has_due_work; the ledger sweep and the state gauges read sent events
    "outbox": frozenset({"SELECT"}),
    # the ledger sweep records owed deliveries, locks them (FOR UPDATE) and dates each
    # re-delivery; the gauges count what is owed
    "inbox": frozenset({"SELECT", "INSERT", "UPDATE"}),
    # deliveries whose event is gone are dead-lettered; the gauges count dead letters
    "dead_letters": frozenset({"SELECT", "INSERT"}),
    # the sweep's window (an upsert that returns the row, then advanced)
    "delivery_sweep": frozenset({"SELECT", "INSERT", "UPDATE"}),
    # the relay's heartbeat (INSERT ... ON CONFLICT DO UPDATE) and its removal at exit
    "relay_state": frozenset({"SELECT", "INSERT", "UPDATE", "DELETE"}),
    # each delivery the sweep sends again is logged (for `pipeline status`)
    "delivery_log": frozenset({"INSERT"}),
}
JANITOR: Grants = {
    # retention (retention.sql): each table's expired rows are read, then deleted; sent
    # events are kept while a dead letter refers to them, attempts of dead-lettered events
    "outbox": frozenset({"SELECT", "DELETE"}),
    "inbox": frozenset({"SELECT", "DELETE"}),
    "attempts": frozenset({"SELECT", "DELETE"}),
    "delivery_log": frozenset({"SELECT", "DELETE"}),
    "audit_log": frozenset({"SELECT", "DELETE"}),
    "dead_letters": frozenset({"SELECT"}),
}
CANARY: Grants = {"outbox": frozenset({"INSERT"})}  # the relay commits heartbeat events
STARTUP: Grants = {
    # relays and workers wait at start-up until this version's migrations are applied
    "schema_migrations": frozenset({"SELECT"}),
}
CONSUMING: Grants = {
    "inbox": frozenset({"SELECT", "INSERT", "UPDATE"}),  # claims, failures, order checks
    "attempts": frozenset({"INSERT"}),  # failed handler attempts
    "dead_letters": frozenset({"INSERT"}),  # events that ran out of retries
    "outbox": frozenset({"INSERT"}),  # follow-up events published by handlers
    "delivery_log": frozenset({"INSERT"}),  # duplicate deliveries (for `pipeline status`)
    # each worker process's heartbeat (an upsert) and its removal at exit
    "worker_state": frozenset({"SELECT", "INSERT", "UPDATE", "DELETE"}),
}


DLQ_READ: Grants = {
    # `pipeline dlq list|show` and every replay's plan: the dead letters, and the state of
    # their events and inbox rows now (show adds the attempt history)
    "dead_letters": frozenset({"SELECT"}),
    "outbox": frozenset({"SELECT"}),
    "inbox": frozenset({"SELECT"}),
    "attempts": frozenset({"SELECT"}),
}
AUDIT: Grants = {
    # each action is recorded before it starts (INSERT ... RETURNING) and counts what it
    # affects in the transaction of each change; `pipeline dlq audit` lists the records
    "audit_log": frozenset({"SELECT", "INSERT", "UPDATE"}),
}
DLQ_REPLAY: Grants = {
    "outbox": frozenset({"UPDATE"}),  # a publish-stage event back to pending
    "inbox": frozenset({"INSERT", "UPDATE"}),  # a consume-stage delivery owed again (upsert)
    "dead_letters": frozenset({"UPDATE"}),  # locked for the replay (FOR UPDATE), then marked
}
DLQ_PURGE: Grants = {"dead_letters": frozenset({"DELETE"})}
DLQ_ABANDON: Grants = {
    # `pipeline dlq abandon`: the consumer's owed inbox rows finished as 'dead', and rows
    # written for sent events the ledger sweep has not recorded for it yet
    "inbox": frozenset({"SELECT", "INSERT", "UPDATE"}),
    "outbox": frozenset({"SELECT"}),
    "delivery_sweep": frozenset({"SELECT"}),
}


def combine(*parts: Grants) -> dict[str, frozenset[str]]:
    """The union of several needs, table by table."""
    merged: dict[str, frozenset[str]] = {}
    for part in parts:
        for table, privileges in part.items():
            merged[table] = merged.get(table, frozenset()) | privileges
    return merged


def relay_grants(
    *, publishing: bool, canary: bool, janitor: bool = True
) -> dict[str, frozenset[str]]:
    """What ``pipeline relay`` needs (``publishing`` is false in ``--mode workers``;
    ``janitor`` false with ``PIPELINE_PRUNE_INTERVAL_SECONDS=0``)."""
    return combine(
        STARTUP,
        RELAY,
        PUBLISHING if publishing else {},
        CANARY if canary else {},
        JANITOR if janitor else {},
    )


def worker_grants(*, publishing: bool) -> dict[str, frozenset[str]]:
    """What ``pipeline worker`` needs (``publishing``: it consumes the publishing queue)."""
    return combine(STARTUP, CONSUMING, PUBLISHING if publishing else {})


def missing_privileges(
    conn: psycopg.Connection[Any], schema: str, grants: Grants
) -> tuple[str, list[str]]:
    """The current role's name and each grant of ``grants`` it lacks, as readable text.

    Tables that are not installed are skipped: a missing schema is reported (or waited
    for) by the process itself.
    """
    pairs = sorted((table, privilege) for table, wanted in grants.items() for privilege in wanted)
    rows = DiagnosticsStore(schema).missing_grants(conn, pairs)
    role = rows[0].role if rows else ""
    missing = [
        f"USAGE on schema {schema}" if table is None else f"{privilege} on {schema}.{table}"
        for _, table, privilege in rows
    ]
    return role, sorted(missing)


def require_privileges(
    conn: psycopg.Connection[Any], schema: str, grants: Grants, command: str
) -> None:
    """Raise :class:`PermissionDeniedError` naming every missing grant, if any."""
    role, missing = missing_privileges(conn, schema, grants)
    if missing:
        raise PermissionDeniedError(
            f"permission denied: the database role {role!r} lacks {', '.join(missing)}, "
            f"which `{command}` needs (the grants are in docs/security.md)"
        )


def dlq_grants(
    *, replay: bool = False, purge: bool = False, abandon: bool = False
) -> dict[str, frozenset[str]]:
    """What an audited ``pipeline dlq`` action needs: a replay, a purge, abandoned
    deliveries, or (none) a sandbox replay, whose handlers need their own grants besides."""
    return combine(
        DLQ_READ,
        AUDIT,
        DLQ_REPLAY if replay else {},
        DLQ_PURGE if purge else {},
        DLQ_ABANDON if abandon else {},
    )
