"""The delivery ledger: which (event, consumer) deliveries are owed past the horizon.

Used by the relay's sweep (:mod:`pipeline.relay.ledger`), inside one transaction it
holds, and by ``pipeline dlq owed`` and ``abandon``; see ``ledger.sql`` for the statements.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any, NamedTuple

import psycopg

from pipeline.db.queries import queries_for
from pipeline.envelope import OutboxEvent

ACCOUNT_LOCK_WAIT_MS = 100
"""How long the sweep's accounting waits on an inbox row that a transaction still open
has inserted (a worker's claim) before it stops there; see :meth:`LedgerStore.account`."""


class OwedDelivery(NamedTuple):
    """A delivery owed to ``consumer``; ``event`` is None when its outbox row is gone.

    ``reason`` says why it is owed (``metrics.REDELIVERY_REASONS``): ``no_outcome``,
    ``retry_overdue`` (a failed attempt's retry) or ``resend_unanswered``.
    """

    consumer: str
    event_id: uuid.UUID
    event: OutboxEvent | None
    reason: str = "no_outcome"


def _reason(status: str, redeliveries: int) -> str:
    if redeliveries > 0:
        return "resend_unanswered"
    return "retry_overdue" if status == "failed" else "no_outcome"


class OwedRow(NamedTuple):
    """One delivery owed, as ``pipeline dlq owed`` lists it."""

    consumer: str
    event_id: uuid.UUID
    event_type: str
    status: str
    recorded: bool
    """False: a sent event the sweep has not recorded for the consumer yet (no inbox row)."""
    since: datetime
    """When it was last delivered (or published, when not recorded)."""
    age: float
    attempts: int
    redeliveries: int
    consumer_total: int
    """How many deliveries its consumer is owed in all."""
    listed: bool
    """Within the requested limit (else only there as its consumer's oldest)."""


class LedgerStore:
    """The ledger's queries for one schema."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self._queries = queries_for(schema)

    def lock(self, conn: psycopg.Connection[Any]) -> bool:
        """Take the sweep's transaction-scoped lock; False when another relay holds it."""
        row = conn.execute(self._queries["ledger_lock"], {"schema_name": self.schema}).fetchone()
        return bool(row and row[0])

    def clock(self, conn: psycopg.Connection[Any]) -> datetime:
        """The database's time now: the clock publication times are written on."""
        row = conn.execute(self._queries["ledger_clock"]).fetchone()
        assert row is not None
        moment: datetime = row[0]
        return moment

    def window(self, conn: psycopg.Connection[Any], horizon: float) -> tuple[datetime, datetime]:
        """Where the last sweep's accounting ended, and where this one's ends (now - horizon)."""
        row = conn.execute(self._queries["ledger_window"], {"horizon": horizon}).fetchone()
        assert row is not None  # an upsert returns its row
        return row[0], row[1]

    def account(
        self, conn: psycopg.Connection[Any], since: datetime, until: datetime
    ) -> tuple[int, datetime | None]:
        """Record as owed the deliveries of events sent in (since, until] with no inbox row.

        Returns how many, and ``None`` when the whole window is accounted for, else the
        publication time of the first delivery a worker's claim holds up: an inbox row of
        it inserted by a transaction still open (a worker processing it, or stopped with
        its transaction open), whose fate the insert would wait for. The sweep never waits
        on a worker (more than :data:`ACCOUNT_LOCK_WAIT_MS`): what is accounted for stops
        there, and the next sweep starts again from that delivery.
        """
        params = {"since": since, "until": until}
        with self._brief_lock_waits(conn):
            try:
                with conn.transaction():  # a savepoint: a timed-out statement undoes only it
                    return conn.execute(self._queries["ledger_account"], params).rowcount, None
            except psycopg.errors.LockNotAvailable:
                pass
            recorded = 0
            for consumer, event_id, published_at in conn.execute(
                self._queries["ledger_unaccounted"], params
            ).fetchall():
                try:
                    with conn.transaction():
                        recorded += conn.execute(
                            self._queries["ledger_account_one"],
                            {"consumer": consumer, "event_id": event_id},
                        ).rowcount
                except psycopg.errors.LockNotAvailable:
                    return recorded, published_at
            return recorded, None

    @contextmanager
    def _brief_lock_waits(self, conn: psycopg.Connection[Any]) -> Iterator[None]:
        """The transaction's lock waits at most ``ACCOUNT_LOCK_WAIT_MS`` inside."""
        row = conn.execute(
            self._queries["ledger_lock_wait"], {"wait": f"{ACCOUNT_LOCK_WAIT_MS}ms"}
        ).fetchone()
        assert row is not None
        yield
        conn.execute(self._queries["ledger_lock_wait"], {"wait": row[0]})

    def advance(self, conn: psycopg.Connection[Any], until: datetime) -> None:
        conn.execute(self._queries["ledger_advance"], {"until": until})

    def owed(
        self,
        conn: psycopg.Connection[Any],
        consumers: Sequence[str],
        cutoffs: Sequence[datetime],
        ordered: Sequence[bool],
        limit: int,
    ) -> list[OwedDelivery]:
        """Unfinished deliveries older than each consumer's cutoff, oldest first, locked
        (rows a worker holds are skipped)."""
        rows = conn.execute(
            self._queries["ledger_owed"],
            {
                "consumers": list(consumers),
                "cutoffs": list(cutoffs),
                "ordered": list(ordered),
                "limit": limit,
            },
        ).fetchall()
        return [
            OwedDelivery(
                row[0],
                row[1],
                None if row[4] is None else OutboxEvent.from_row((row[1], *row[4:])),
                _reason(row[2], row[3]),
            )
            for row in rows
        ]

    def redelivered(
        self, conn: psycopg.Connection[Any], deliveries: Sequence[tuple[str, uuid.UUID]]
    ) -> None:
        """Date these (consumer, event id) deliveries now and count them as redeliveries."""
        conn.execute(
            self._queries["ledger_redelivered"],
            {
                "consumers": [consumer for consumer, _ in deliveries],
                "event_ids": [event_id for _, event_id in deliveries],
            },
        )

    def vanished(
        self, conn: psycopg.Connection[Any], deliveries: Sequence[tuple[str, uuid.UUID]]
    ) -> None:
        """Dead-letter owed deliveries whose events are no longer in the outbox."""
        conn.execute(
            self._queries["ledger_vanished"],
            {
                "consumers": [consumer for consumer, _ in deliveries],
                "event_ids": [event_id for _, event_id in deliveries],
            },
        )

    # -- the operator's view (``pipeline dlq owed`` and ``abandon``) ----------------------
    def owed_list(
        self,
        conn: psycopg.Connection[Any],
        *,
        min_age: float,
        overlap: float,
        consumer: str | None,
        limit: int,
    ) -> list[OwedRow]:
        """Deliveries owed at least ``min_age`` seconds, oldest first: the first ``limit``
        (``listed``) and each consumer's oldest, with per-consumer totals."""
        rows = conn.execute(
            self._queries["ledger_owed_list"],
            {"min_age": min_age, "overlap": overlap, "consumer": consumer, "limit": limit},
        ).fetchall()
        return [OwedRow(*row) for row in rows]

    def abandon(
        self, conn: psycopg.Connection[Any], consumer: str, error: str, overlap: float, batch: int
    ) -> tuple[int, int]:
        """Finish up to ``batch`` recorded and ``batch`` unrecorded deliveries owed to
        ``consumer`` as 'dead'; returns how many of each."""
        row = conn.execute(
            self._queries["ledger_abandon"],
            {"consumer": consumer, "error": error, "overlap": overlap, "batch": batch},
        ).fetchone()
        assert row is not None  # one row of counts
        return int(row[0]), int(row[1])
