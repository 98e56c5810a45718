"""Purge dead letters: delete the records an operator has dealt with.

Only ``dead_letters`` rows are deleted. The event's outbox row stays ``dead`` (a
publish-stage dead letter) and the consumer's inbox row stays ``dead`` (consume stage),
so nothing runs again and later events of the key do not wait for it. Deletes go in
bounded batches, each counted in the audit record in its own transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from pipeline.db.queries import queries_for
from pipeline.tools.ops.audit import count_affected

BATCH = 1000


def purge(
    conn: psycopg.Connection[Any], schema: str, ids: Sequence[int], audit_id: int
) -> list[int]:
    """Delete these dead letters (autocommit connection); returns the ids actually deleted.

    An id deleted meanwhile by someone else is simply not counted.
    """
    queries = queries_for(schema)
    deleted: list[int] = []
    for start in range(0, len(ids), BATCH):
        with conn.transaction():
            rows = conn.execute(
                queries["dlq_delete"], {"ids": list(ids[start : start + BATCH])}
            ).fetchall()
            batch = sorted(int(row[0]) for row in rows)
            if batch:
                count_affected(conn, schema, audit_id, batch)
        deleted += batch
    return deleted
