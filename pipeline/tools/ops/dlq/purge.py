"""Purge dead letters: delete the records an operator has dealt with.

Only ``dead_letters`` rows are deleted. The event's outbox row stays ``dead`` (a
publish-stage dead letter) and the consumer's inbox row stays ``dead`` (consume stage),
so nothing runs again and later events of the key do not wait for it. Deletes go in
bounded batches, each counted in the audit record in its own transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from pipeline.config import Settings
from pipeline.db.stores.dead_letters import DeadLetterStore
from pipeline.tools.ops.audit import begin_action, count_affected
from pipeline.tools.ops.dlq.access import open_connection, require_grants, require_known_ids
from pipeline.tools.ops.dlq.filters import DeadLetterFilter
from pipeline.tools.ops.dlq.records import DeadLetter, select_dead_letters

BATCH = 1000


@dataclass
class PurgeReport:
    """The dead letters in scope and, unless a dry run, which were deleted under which
    audit record."""

    letters: list[DeadLetter]
    dry_run: bool
    audit_id: int | None = None
    deleted: list[int] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        if self.dry_run:
            return {
                "dry_run": True,
                "would_delete": len(self.letters),
                "dead_letters": [letter.as_json() for letter in self.letters],
            }
        return {"dry_run": False, "audit_id": self.audit_id, "deleted": self.deleted}


def purge_dead_letters(
    settings: Settings,
    scope: DeadLetterFilter,
    *,
    purge_all: bool = False,
    dry_run: bool = False,
    reason: str = "",
) -> PurgeReport:
    """``pipeline dlq purge``: delete the dead letters in ``scope`` (every one with
    ``purge_all``), audited; a dry run only selects them."""
    schema = settings.schema_name
    with open_connection(settings) as conn:
        if not dry_run:
            require_grants(conn, settings, "pipeline dlq purge", purge=True)
        require_known_ids(conn, schema, scope.ids)
        letters = select_dead_letters(conn, schema, scope)
        if dry_run:
            return PurgeReport(letters, dry_run=True)
        parameters = {"filter": {"all": True} if purge_all else scope.as_json()}
        audit_id = begin_action(conn, schema, "dlq.purge", reason, parameters)
        deleted = purge(conn, schema, [letter.id for letter in letters], audit_id)
    return PurgeReport(letters, dry_run=False, audit_id=audit_id, deleted=deleted)


def purge(
    conn: psycopg.Connection[Any], schema: str, ids: Sequence[int], audit_id: int
) -> list[int]:
    """Delete these dead letters (autocommit connection); returns the ids actually deleted.

    An id deleted meanwhile by someone else is simply not counted.
    """
    store = DeadLetterStore(schema)
    deleted: list[int] = []
    for start in range(0, len(ids), BATCH):
        with conn.transaction():
            batch = store.delete(conn, ids[start : start + BATCH])
            if batch:
                count_affected(conn, schema, audit_id, batch)
        deleted += batch
    return deleted
