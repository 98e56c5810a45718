"""Retention: delete what the pipeline no longer needs, in short batches.

Shared by the relay's janitor (:mod:`pipeline.relay.janitor`) and ``pipeline prune``.
A pass goes through the tables in :data:`TABLES` order, each in batches of at most
``batch_size`` rows; every batch is its own short transaction with a ``lock_timeout``,
so producers and workers never wait on the janitor for long, and a batch lost in a
crash is simply done again. The rules of what may go are in ``retention.sql``; in short:

* **outbox**: sent events past ``PIPELINE_SENT_RETENTION_SECONDS`` whose every consumer
  has an outcome (processed or dead) and that no dead letter refers to; never pending,
  publishing or dead events, never an event still owed to a consumer;
* **inbox**: processed keys past ``PIPELINE_INBOX_RETENTION_SECONDS`` whose event has
  left the outbox (so effectively kept at least as long as sent events); never pending,
  failed or dead rows;
* **attempts** and **delivery_log** past ``PIPELINE_ATTEMPTS_RETENTION_SECONDS``, except
  the attempts of events with a dead letter;
* **audit_log** past ``PIPELINE_AUDIT_RETENTION_SECONDS``.

Dead letters are never pruned: purging them is an operator's decision (``pipeline dlq
purge``). One pass runs at a time per schema (a session advisory lock).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from pipeline.config import Settings
from pipeline.db.stores.retention import RetentionStore

log = logging.getLogger("pipeline.retention")

TABLES = ("outbox", "inbox", "attempts", "delivery_log", "audit_log")
"""Pruned in this order: an outbox row must go before its inbox rows may."""

LOCK_TIMEOUT = "2s"
"""A batch that would wait longer for a lock gives up its table for this pass."""

STATEMENT_TIMEOUT = "60s"

_BEGINNING = datetime(1, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class RetentionPolicy:
    """How long each table's rows are kept (seconds), and the batch size."""

    outbox: float
    inbox: float
    attempts: float
    audit_log: float
    batch_size: int = 5000

    @classmethod
    def from_settings(cls, settings: Settings) -> RetentionPolicy:
        """The configured ages. That the inbox's covers every consumer's retry horizon is
        checked before a pass is ever set up (:func:`pipeline.policy.require_retention`)."""
        return cls(
            outbox=settings.sent_retention_seconds,
            inbox=settings.inbox_retention_seconds,
            attempts=settings.attempts_retention_seconds,
            audit_log=settings.audit_retention_seconds,
            batch_size=settings.prune_batch_size,
        )

    def age(self, table: str) -> float:
        """Seconds a row of ``table`` is kept (delivery_log goes with the attempts)."""
        return {
            "outbox": self.outbox,
            "inbox": self.inbox,
            "attempts": self.attempts,
            "delivery_log": self.attempts,
            "audit_log": self.audit_log,
        }[table]


@dataclass
class TablePrune:
    """One table's part of a pass."""

    table: str
    cutoff: datetime
    eligible: int = 0  # rows past the cutoff that may go (deleted, or would be on a dry run)
    deleted: int = 0
    kept: int = 0  # rows past the cutoff kept by a rule (owed, dead-lettered, event present)
    batches: int = 0
    complete: bool = True  # False when a lock or statement timeout cut the table short

    def as_json(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "cutoff": self.cutoff.isoformat(),
            "eligible": self.eligible,
            "deleted": self.deleted,
            "kept": self.kept,
            "batches": self.batches,
            "complete": self.complete,
        }


@dataclass
class PruneResult:
    dry_run: bool
    skipped: bool = False  # another pass holds the lock
    tables: list[TablePrune] = field(default_factory=list)

    @property
    def deleted(self) -> int:
        return sum(table.deleted for table in self.tables)

    @property
    def eligible(self) -> int:
        return sum(table.eligible for table in self.tables)

    def as_json(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "skipped": self.skipped,
            "deleted": self.deleted,
            "eligible": self.eligible,
            "tables": [table.as_json() for table in self.tables],
        }


BatchHook = Callable[[str, int], None]
"""Called after each committed batch with (table, rows deleted): the janitor's metrics."""


class Pruner:
    """Runs prune passes on an autocommit connection; see the module docstring."""

    def __init__(
        self,
        schema: str,
        policy: RetentionPolicy,
        *,
        on_batch: BatchHook | None = None,
        pause: float = 0.0,
    ) -> None:
        self.schema = schema
        self.policy = policy
        self.on_batch = on_batch
        self.pause = pause  # seconds between batches: room for producers' I/O
        self.store = RetentionStore(schema)

    def lock(self, conn: psycopg.Connection[Any]) -> bool:
        return self.store.lock(conn)

    def unlock(self, conn: psycopg.Connection[Any]) -> None:
        self.store.unlock(conn)

    def run(
        self,
        conn: psycopg.Connection[Any],
        *,
        dry_run: bool = False,
        stop: threading.Event | None = None,
    ) -> PruneResult:
        """One pass over every table, under the lock (a dry run takes none).

        Returns with ``skipped`` set when another pass holds the lock. Lock and statement
        timeouts end a table's part early (``complete`` False); other errors propagate.
        """
        if not conn.autocommit:
            raise ValueError("prune needs an autocommit connection (each batch commits)")
        result = PruneResult(dry_run=dry_run)
        if not dry_run and not self.lock(conn):
            result.skipped = True
            return result
        try:
            row = conn.execute("SELECT clock_timestamp()").fetchone()
            assert row is not None
            now: datetime = row[0]
            for table in TABLES:
                if stop is not None and stop.is_set():
                    break
                cutoff = now - timedelta(seconds=self.policy.age(table))
                result.tables.append(self._prune_table(conn, table, cutoff, dry_run, stop))
        finally:
            if not dry_run:
                self.unlock(conn)
        return result

    def _prune_table(
        self,
        conn: psycopg.Connection[Any],
        table: str,
        cutoff: datetime,
        dry_run: bool,
        stop: threading.Event | None,
    ) -> TablePrune:
        part = TablePrune(table, cutoff)
        after = _BEGINNING
        limit = self.policy.batch_size
        while True:
            try:
                with conn.transaction():
                    conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                    conn.execute(f"SET LOCAL statement_timeout = '{STATEMENT_TIMEOUT}'")
                    # A batch lost in a crash is done again next pass: no need to wait
                    # for its WAL flush (and no flush competing with producers' commits).
                    conn.execute("SET LOCAL synchronous_commit = off")
                    batch = self.store.prune_batch(
                        conn, table, cutoff=cutoff, after=after, limit=limit, dry_run=dry_run
                    )
            except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled) as exc:
                part.complete = False
                log.warning(
                    "prune gave up a table for this pass",
                    extra={"table": table, "error_class": type(exc).__name__},
                )
                return part
            eligible, deleted, scanned, last = batch
            part.batches += 1
            part.eligible += eligible
            part.deleted += deleted
            part.kept += scanned - eligible
            if deleted and self.on_batch is not None:
                self.on_batch(table, deleted)
            if scanned < limit or last is None:
                return part
            after = last
            if stop is None:
                time.sleep(self.pause)
            elif stop.wait(self.pause):
                part.complete = False
                return part
