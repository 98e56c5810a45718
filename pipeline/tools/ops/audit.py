"""The audit log: who did what to which scope, when, and how many rows it affected.

Every operator action that changes something (a replay, a purge, a sandbox replay,
abandoned deliveries)
records itself before it starts, and counts what it affects in the same transaction
as each change, so the record is exact even when the command is interrupted. Dry runs
change nothing and are not recorded.
"""

from __future__ import annotations

import getpass
import json
import os
from collections.abc import Sequence
from typing import Any

import psycopg

from pipeline.db.stores.audit import AuditRecord, AuditStore

MAX_LISTED_IDS = 1000
"""Ids listed in one record (its count covers them all): the log stays small."""


def os_user() -> str:
    """Who runs this command: the OS login name, else the numeric user id."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid:{os.getuid()}"


def begin_action(
    conn: psycopg.Connection[Any],
    schema: str,
    action: str,
    reason: str,
    parameters: dict[str, Any],
    actor: str | None = None,
) -> int:
    """Record an action before it changes anything (committed at once); returns its id."""
    recorded = {**parameters, "reason": reason}
    with conn.transaction():
        return AuditStore(schema).insert(
            conn,
            actor or os_user(),
            action,
            json.dumps(recorded, sort_keys=True, default=str),
        )


def count_affected(
    conn: psycopg.Connection[Any], schema: str, audit_id: int, dead_letter_ids: Sequence[int]
) -> None:
    """Add dead letters to an action's record; call inside the transaction that acts on them."""
    AuditStore(schema).count_affected(conn, audit_id, dead_letter_ids, MAX_LISTED_IDS)


def add_affected(conn: psycopg.Connection[Any], schema: str, audit_id: int, count: int) -> None:
    """Add rows other than dead letters to an action's record (inside the transaction that
    changes them)."""
    AuditStore(schema).add_affected(conn, audit_id, count)


def list_actions(conn: psycopg.Connection[Any], schema: str, limit: int) -> list[AuditRecord]:
    """The latest records first."""
    return AuditStore(schema).latest(conn, limit)


def render_actions(records: Sequence[AuditRecord]) -> list[str]:
    """One line per action: when, who, what, how many, why, and the scope."""
    if not records:
        return ["no operator actions recorded"]
    lines = []
    for record in records:
        parameters = dict(record.parameters)
        reason = parameters.pop("reason", "")
        parameters.pop("dead_letters", None)
        given = parameters.pop("filter", None)
        scope = json.dumps(given, sort_keys=True) if given else "all"
        extra = " ".join(f"{k}={v}" for k, v in sorted(parameters.items()) if v is not None)
        lines.append(
            f"#{record.id}  {record.at.isoformat(timespec='seconds')}  {record.actor}  "
            f"{record.action}  affected={record.affected}  reason={reason!r}  filter={scope}"
            + (f"  {extra}" if extra else "")
        )
    return lines
