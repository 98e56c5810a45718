"""A consumer's inbox: claims, failed attempts, and dead letters at consume.

Runs on the SQLAlchemy connection of the session the handler writes through, so the
inbox record, the handler's writes and its follow-up events commit together (DESIGN
I3). The queries are pre-rendered strings for ``exec_driver_sql``: the hot path skips
SQLAlchemy's compiler.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from sqlalchemy.exc import OperationalError

from pipeline.db.queries import queries_for
from pipeline.envelope import ReceivedEvent

if TYPE_CHECKING:
    from sqlalchemy import Connection

CLAIM_LOCK_WAIT_MS = 100
"""How long a claim waits on a copy of its event that another transaction has claimed and
not yet committed (a duplicate delivery being handled, or a stuck worker's open claim)
before it fails with ``lock_not_available``: the message is then given back and tried
again later, so a worker that stopped with claims open ties up no other worker's threads
for the whole ``PIPELINE_LOCK_TIMEOUT_MS``. The ledger sweep waits as briefly
(:data:`pipeline.db.stores.ledger.ACCOUNT_LOCK_WAIT_MS`)."""


class ClaimHeld(Exception):
    """A claim waited :data:`CLAIM_LOCK_WAIT_MS` on a copy of its event that another open
    transaction has claimed: a duplicate delivery still being handled (or a stuck worker's
    claim), not a server out of reach. The message is given back and tried again later,
    when the other copy's outcome is known; it is not counted as an infrastructure retry."""

    def __init__(self, consumer: str) -> None:
        super().__init__(
            f"another transaction of consumer {consumer!r} holds a claim of the same event"
        )
        self.consumer = consumer


def _claim_row(
    connection: Connection, statement: str, parameters: dict[str, Any], consumer: str
) -> Any:
    """The one row of a claim statement; :class:`ClaimHeld` when its wait ran out."""
    try:
        return connection.exec_driver_sql(statement, parameters).one()
    except OperationalError as exc:
        if _wait_ran_out(exc):
            raise ClaimHeld(consumer) from exc
        raise


def _wait_ran_out(exc: OperationalError) -> bool:
    """Whether a claim failed because its wait on a row (a copy's claim) ran out. A wait on
    the table's lock (a migration, ``LOCK TABLE``) ends the same way, with the usual
    ``lock_timeout`` and no tuple named in the error's context: that one stays an outage."""
    orig = exc.orig
    if not isinstance(orig, psycopg.errors.LockNotAvailable):
        return False
    return "tuple" in (orig.diag.context or "")


@dataclass(frozen=True)
class ConsumeDeadLetter:
    """A ``dead_letters`` row of the consume stage (``envelope`` as JSON text)."""

    event_id: uuid.UUID | None
    consumer: str | None
    event_type: str | None
    queue: str
    reason: str
    error_class: str
    error: str
    attempts: int
    envelope: str | None = None
    raw_message: str | None = None
    raw_digest: bytes | None = None  # of a raw message: see :func:`raw_digest`
    message_digest: bytes | None = None  # of a delivered message: see :func:`message_digest`


def raw_digest(queue: str, raw: bytes) -> bytes:
    """The SHA-256 digest a raw message's dead letter is recorded once by: of its queue
    (with its length, so no queue and body pair reads as another) and its bytes."""
    name = queue.encode()
    return hashlib.sha256(len(name).to_bytes(8, "big") + name + raw).digest()


def message_digest(queue: str, message_id: str, content: bytes, part: str) -> bytes:
    """The SHA-256 digest a dead letter recorded for a delivered Dramatiq message is
    recorded once by: of its queue, its message id, its content (``content``: actor name,
    arguments and keywords, encoded deterministically, never its options, which Dramatiq
    rewrites when it retries a message) and ``part``, which of its dead letters this is (the
    message as a whole, or one envelope of it). A redelivery of the message reproduces it."""
    digest = hashlib.sha256(b"message")
    for field in (queue.encode(), message_id.encode(), content, part.encode()):
        digest.update(len(field).to_bytes(8, "big") + field)
    return digest.digest()


class InboxStore:
    """The inbox's queries for one schema."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self._queries = queries_for(schema)
        self._claim = self._queries.text("inbox_claim")
        self._claim_many = self._queries.text("inbox_claim_many")

    @staticmethod
    def _key(consumer: str, event: ReceivedEvent) -> dict[str, Any]:
        return {
            "consumer": consumer,
            "event_id": event.id,
            "event_type": event.type,
            "ordering_key": event.ordering_key,
            "seq": event.seq,
            "claim_wait_ms": CLAIM_LOCK_WAIT_MS,
        }

    def claim(self, connection: Connection, consumer: str, event: ReceivedEvent) -> int | None:
        """Claim (consumer, event): the attempt number, or None when already done.

        Raises :class:`ClaimHeld` when another transaction has held the claim for
        :data:`CLAIM_LOCK_WAIT_MS`: the caller gives the message back."""
        row = _claim_row(connection, self._claim, self._key(consumer, event), consumer)
        return None if row[0] is None else int(row[0])

    def claim_many(
        self, connection: Connection, consumer: str, events: Sequence[ReceivedEvent]
    ) -> dict[uuid.UUID, int]:
        """Claim every event in one statement: attempt numbers of those not yet done
        (:class:`ClaimHeld` as :meth:`claim`)."""
        if len(events) == 1:  # scalar parameters: binding one-element arrays costs more
            (event,) = events
            attempt = self.claim(connection, consumer, event)
            return {} if attempt is None else {event.id: attempt}
        parameters = {
            "consumer": consumer,
            "event_ids": [event.id for event in events],
            "event_types": [event.type for event in events],
            "ordering_keys": [event.ordering_key for event in events],
            "seqs": [event.seq for event in events],
            "claim_wait_ms": CLAIM_LOCK_WAIT_MS,
        }
        event_ids, attempts, _ = _claim_row(connection, self._claim_many, parameters, consumer)
        return {
            event_id: int(attempt)
            for event_id, attempt in zip(event_ids, attempts, strict=True)
            if event_id is not None
        }

    def log_duplicates(
        self, connection: Connection, consumer: str, event_ids: Sequence[uuid.UUID]
    ) -> None:
        """Record deliveries acknowledged without running the handler (``delivery_log``)."""
        connection.exec_driver_sql(
            self._queries.text("inbox_log_duplicates"),
            {"consumer": consumer, "event_ids": list(event_ids)},
        )

    def predecessor_unfinished(
        self, connection: Connection, consumer: str, event: ReceivedEvent
    ) -> bool:
        """Whether an earlier event of the key reached this consumer and is not yet done."""
        row = connection.exec_driver_sql(
            self._queries.text("inbox_predecessor_unfinished"),
            {"consumer": consumer, "ordering_key": event.ordering_key, "seq": event.seq},
        ).first()
        return bool(row and row[0])

    def fail(
        self,
        connection: Connection,
        consumer: str,
        event: ReceivedEvent,
        *,
        error: str,
        error_class: str,
        dead: bool,
        retry_in: float,
    ) -> bool:
        """Record a failed attempt (the claim's number); False when a concurrent copy has
        finished the event meanwhile (this delivery is then a duplicate)."""
        params = {
            **self._key(consumer, event),
            "error": error,
            "error_class": error_class,
            "status": "dead" if dead else "failed",
            "retry_in": retry_in,
        }
        return (
            connection.exec_driver_sql(self._queries.text("inbox_fail"), params).first() is not None
        )

    def dead_letter(self, connection: Connection, letter: ConsumeDeadLetter) -> bool:
        """Record the dead letter; False when one with its digest is recorded already."""
        result = connection.exec_driver_sql(
            self._queries.text("inbox_dead_letter"),
            {
                "event_id": letter.event_id,
                "consumer": letter.consumer,
                "event_type": letter.event_type,
                "queue": letter.queue,
                "reason": letter.reason,
                "error_class": letter.error_class,
                "error": letter.error,
                "attempts": letter.attempts,
                "envelope": letter.envelope,
                "raw_message": letter.raw_message,
                "raw_digest": letter.raw_digest,
                "message_digest": letter.message_digest,
            },
        )
        return bool(result.rowcount)

    def give_up(
        self, connection: Connection, consumer: str, event_ids: Sequence[uuid.UUID], error: str
    ) -> None:
        """Mark these events dead for ``consumer`` (later events of their keys stop waiting)."""
        connection.exec_driver_sql(
            self._queries.text("inbox_give_up"),
            {"consumer": consumer, "event_ids": list(event_ids), "error": error},
        )
