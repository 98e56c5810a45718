"""The audit log: who did what to which scope, when, and how many rows it affected.

Every operator action that changes something (a replay, a purge, a sandbox replay)
records itself before it starts, and counts what it affects in the same transaction
as each change, so the record is exact even when the command is interrupted. Dry runs
change nothing and are not recorded.
"""

from __future__ import annotations

import getpass
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from pipeline.db.queries import queries_for

MAX_LISTED_IDS = 1000
"""Ids listed in one record (its count covers them all): the log stays small."""


def os_user() -> str:
    """Who runs this command: the OS login name, else the numeric user id."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid:{os.getuid()}"


@dataclass
class AuditRecord:
    id: int
    at: datetime
    actor: str
    action: str
    parameters: dict[str, Any]
    affected: int

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "at": self.at.isoformat(),
            "actor": self.actor,
            "action": self.action,
            "parameters": self.parameters,
            "affected": self.affected,
        }


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
        row = conn.execute(
            queries_for(schema)["audit_insert"],
            {
                "actor": actor or os_user(),
                "action": action,
                "parameters": json.dumps(recorded, sort_keys=True, default=str),
            },
        ).fetchone()
    assert row is not None  # INSERT ... RETURNING
    return int(row[0])


def count_affected(
    conn: psycopg.Connection[Any], schema: str, audit_id: int, dead_letter_ids: Sequence[int]
) -> None:
    """Add dead letters to an action's record; call inside the transaction that acts on them."""
    conn.execute(
        queries_for(schema)["audit_affected"],
        {"audit_id": audit_id, "ids": list(dead_letter_ids), "max_listed": MAX_LISTED_IDS},
    )


def list_actions(conn: psycopg.Connection[Any], schema: str, limit: int) -> list[AuditRecord]:
    """The latest records first."""
    rows = conn.execute(queries_for(schema)["audit_list"], {"limit": limit}).fetchall()
    return [AuditRecord(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5]) for r in rows]


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
