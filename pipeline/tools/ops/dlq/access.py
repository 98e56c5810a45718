"""Reading dead letters for an operator: the connection, the checks before any action,
and the read-only views (list, show, the audit log).

Every ``pipeline dlq`` command works on one autocommit connection: an action commits
one transaction per dead letter, so that what was done stays done if it stops halfway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from pipeline.config import Settings
from pipeline.db.connect import connect
from pipeline.db.privileges import dlq_grants, require_privileges
from pipeline.db.stores.audit import AuditRecord
from pipeline.db.stores.dead_letters import DeadLetterStore
from pipeline.errors import NotFoundError
from pipeline.tools.ops.audit import list_actions
from pipeline.tools.ops.dlq.filters import DeadLetterFilter
from pipeline.tools.ops.dlq.records import (
    DeadLetter,
    DeadLetterDetail,
    DeadLetterGroup,
    load_dead_letter,
    select_dead_letters,
    select_groups,
)


def open_connection(settings: Settings) -> psycopg.Connection[Any]:
    """An autocommit connection to the configured database."""
    return connect(settings, autocommit=True)


def require_known_ids(conn: psycopg.Connection[Any], schema: str, ids: Sequence[int]) -> None:
    """Unknown dead-letter ids are an error (a typo must not quietly match nothing)."""
    if not ids:
        return
    unknown = sorted(set(ids) - DeadLetterStore(schema).known_ids(conn, ids))
    if unknown:
        named = ", ".join(f"#{i}" for i in unknown)
        raise NotFoundError(f"no dead letter {named} in schema {schema!r}")


def require_grants(
    conn: psycopg.Connection[Any],
    settings: Settings,
    command: str,
    *,
    replay: bool = False,
    purge: bool = False,
    abandon: bool = False,
) -> None:
    """Refuse, naming every missing grant, before an action changes anything."""
    grants = dlq_grants(replay=replay, purge=purge, abandon=abandon)
    require_privileges(conn, settings.schema_name, grants, command)


def list_dead_letters(
    settings: Settings, scope: DeadLetterFilter, *, limit: int
) -> list[DeadLetter]:
    """``pipeline dlq list``: the dead letters in ``scope``, oldest first."""
    with open_connection(settings) as conn:
        require_known_ids(conn, settings.schema_name, scope.ids)
        return select_dead_letters(conn, settings.schema_name, scope, limit=limit)


def group_dead_letters(
    settings: Settings, scope: DeadLetterFilter, *, limit: int | None
) -> list[DeadLetterGroup]:
    """``pipeline dlq groups``: the dead letters in ``scope`` by cause, largest first."""
    with open_connection(settings) as conn:
        require_known_ids(conn, settings.schema_name, scope.ids)
        return select_groups(conn, settings.schema_name, scope, limit=limit)


def show_dead_letter(settings: Settings, dead_letter_id: int) -> DeadLetterDetail:
    """``pipeline dlq show``: one dead letter in full."""
    with open_connection(settings) as conn:
        return load_dead_letter(conn, settings.schema_name, dead_letter_id)


def audit_log(settings: Settings, *, limit: int) -> list[AuditRecord]:
    """``pipeline dlq audit``: the latest operator actions first."""
    with open_connection(settings) as conn:
        return list_actions(conn, settings.schema_name, limit)
