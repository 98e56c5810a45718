"""Purge dead letters: delete the records an operator has dealt with.

Only ``dead_letters`` rows are deleted. The event's outbox row stays ``dead`` (a
publish-stage dead letter) and the consumer's inbox row stays ``dead`` (consume stage),
so nothing runs again and later events of the key do not wait for it. Deletes go in
bounded batches, in the events' sequence order (as a replay goes), each counted in the
audit record in its own transaction; with a rate, the batches are paced to that many dead
letters per second, so a large purge spreads its writes (and WAL) instead of a burst.
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
from pipeline.tools.ops.dlq.rate import TokenBucket
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
    rate: float | None = None

    def as_json(self) -> dict[str, Any]:
        if self.dry_run:
            return {
                "dry_run": True,
                "would_delete": len(self.letters),
                "rate": self.rate,
                "dead_letters": [letter.as_json() for letter in self.letters],
            }
        return {
            "dry_run": False,
            "audit_id": self.audit_id,
            "rate": self.rate,
            "deleted": self.deleted,
        }


def purge_dead_letters(
    settings: Settings,
    scope: DeadLetterFilter,
    *,
    purge_all: bool = False,
    dry_run: bool = False,
    reason: str = "",
    rate: float | None = None,
) -> PurgeReport:
    """``pipeline dlq purge``: delete the dead letters in ``scope`` (every one with
    ``purge_all``), audited, at most ``rate`` per second; a dry run only selects them."""
    schema = settings.schema_name
    with open_connection(settings) as conn:
        if not dry_run:
            require_grants(conn, settings, "pipeline dlq purge", purge=True)
        require_known_ids(conn, schema, scope.ids)
        letters = select_dead_letters(conn, schema, scope, in_event_order=True)
        if dry_run:
            return PurgeReport(letters, dry_run=True, rate=rate)
        parameters = {"filter": {"all": True} if purge_all else scope.as_json(), "rate": rate}
        audit_id = begin_action(conn, schema, "dlq.purge", reason, parameters)
        ids = [letter.id for letter in letters]
        deleted = purge(conn, schema, ids, audit_id, TokenBucket(rate))
    return PurgeReport(letters, dry_run=False, audit_id=audit_id, deleted=deleted, rate=rate)


def purge(
    conn: psycopg.Connection[Any],
    schema: str,
    ids: Sequence[int],
    audit_id: int,
    bucket: TokenBucket | None = None,
) -> list[int]:
    """Delete these dead letters in this order (autocommit connection), paced by
    ``bucket``; returns the ids actually deleted, in that order.

    An id deleted meanwhile by someone else is simply not counted. A paced purge deletes
    batches of about a second's worth, so the pace holds without a transaction per row.
    """
    store = DeadLetterStore(schema)
    bucket = bucket or TokenBucket(None)
    size = BATCH if bucket.rate is None else max(1, min(BATCH, int(bucket.rate)))
    deleted: list[int] = []
    for start in range(0, len(ids), size):
        chunk = ids[start : start + size]
        bucket.acquire(len(chunk))
        with conn.transaction():
            batch = store.delete(conn, chunk)
            if batch:
                count_affected(conn, schema, audit_id, batch)
        gone = set(batch)
        deleted += [i for i in chunk if i in gone]  # the purge's order, not the server's
    return deleted
