"""Dead letters: the dead-letter tools' reads, replays and purges.

A publish-stage dead letter is an event the relay gave up on (its outbox row is
``dead``); a consume-stage one is a (consumer, event) pair a handler gave up on, or an
unprocessable message, which may name no event or carry several. Writers of dead
letters are the relay's settlement (:mod:`.outbox`) and the inbox (:mod:`.inbox`).

Error texts are read with the secrets of any URL they quote masked
(:func:`~pipeline.redaction.redact_text`): writers mask them too, but a row may come from
an older writer or from anyone who can insert one, and every reader here prints them.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

import psycopg

from pipeline.db.queries import queries_for
from pipeline.envelope import OutboxEvent
from pipeline.redaction import redact_text


@dataclass
class DeadLetter:
    """One ``dead_letters`` row, with the current state of its event and inbox record."""

    id: int
    stage: str
    event_id: uuid.UUID | None
    consumer: str | None
    event_type: str | None
    queue: str | None
    reason: str
    error_class: str
    error: str
    attempts: int
    created_at: datetime
    replayed_at: datetime | None
    replay_count: int
    seq: int | None = None
    ordering_key: str | None = None
    outbox_status: str | None = None
    """The event's outbox status now (None: the row is gone)."""
    inbox_status: str | None = None
    """The consumer's inbox status for the event now (consume stage; None: no row)."""
    carried: list[uuid.UUID] = field(default_factory=list)
    """Events inside an unprocessable message that names no single event."""
    carried_processed: int = 0
    """How many of those the consumer has processed since."""
    has_envelope: bool = False

    @property
    def event_ids(self) -> list[uuid.UUID]:
        """The events this dead letter stands for (none when it names no readable event)."""
        return [self.event_id] if self.event_id is not None else list(self.carried)

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "stage": self.stage,
            "event_id": _text(self.event_id),
            "consumer": self.consumer,
            "event_type": self.event_type,
            "queue": self.queue,
            "reason": self.reason,
            "error_class": self.error_class,
            "error": self.error,
            "attempts": self.attempts,
            "created_at": self.created_at.isoformat(),
            "replayed_at": _text(self.replayed_at),
            "replay_count": self.replay_count,
            "seq": self.seq,
            "ordering_key": self.ordering_key,
            "outbox_status": self.outbox_status,
            "inbox_status": self.inbox_status,
            "carried_event_ids": [str(i) for i in self.carried],
        }


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.isoformat() if isinstance(value, datetime) else str(value)


def uuids(values: list[str] | None) -> list[uuid.UUID]:
    found = []
    for value in values or []:
        try:
            found.append(uuid.UUID(value))
        except ValueError:
            continue
    return found


def _letter(columns: Sequence[Any], **state: Any) -> DeadLetter:
    """A :class:`DeadLetter` from the ``dead_letters`` columns (in table order) and state."""
    names = (
        "id",
        "stage",
        "event_id",
        "consumer",
        "event_type",
        "queue",
        "reason",
        "error_class",
        "error",
        "attempts",
        "created_at",
        "replayed_at",
        "replay_count",
    )
    values = dict(zip(names, columns, strict=True))
    values["reason"] = redact_text(values["reason"])
    values["error"] = redact_text(values["error"])
    return DeadLetter(**values, **state)


@dataclass
class FailedAttempt:
    attempt: int
    error_class: str
    error: str
    at: datetime


@dataclass
class DeadLetterGroup:
    """Dead letters of one cause: one failure fingerprint (``dlq_groups`` in dlq.sql)."""

    fingerprint: str
    stage: str
    consumer: str | None
    event_type: str | None
    error_class: str
    message: str
    """The normalised message (numbers, UUIDs, hex ids and quoted values as placeholders)."""
    count: int
    waiting: int
    """How many are not replayed yet."""
    first_seen: datetime
    last_seen: datetime
    sample_id: int
    sample_error: str
    ids: list[int] | None = None
    """The group's dead letter ids, oldest first (only when asked for)."""

    def as_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "stage": self.stage,
            "consumer": self.consumer,
            "event_type": self.event_type,
            "error_class": self.error_class,
            "message": self.message,
            "count": self.count,
            "waiting": self.waiting,
            "first_seen": self.first_seen.isoformat(),
            "last_seen": self.last_seen.isoformat(),
            "sample_id": self.sample_id,
            "sample_error": self.sample_error,
        }


class StoredDeadLetter(NamedTuple):
    """One dead letter with what was kept of it (``envelope`` as JSON text)."""

    letter: DeadLetter
    envelope: str | None
    raw_message: str | None


class DeadLetterStore:
    """The dead letters' queries for one schema."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self._queries = queries_for(schema)

    # -- reads -----------------------------------------------------------------------------
    def select(self, conn: psycopg.Connection[Any], scope: Mapping[str, Any]) -> list[DeadLetter]:
        """The dead letters matching ``scope`` (``dlq_select``'s filter parameters; None is
        "not filtered"). Raises ``UndefinedTable`` when the schema is missing."""
        rows = conn.execute(self._queries["dlq_select"], scope).fetchall()
        return [
            _letter(
                row[:13],
                seq=row[13],
                ordering_key=row[14],
                outbox_status=row[15],
                inbox_status=row[16],
                carried=uuids(row[17]),
                carried_processed=int(row[18] or 0),
                has_envelope=bool(row[19]),
            )
            for row in rows
        ]

    def groups(
        self,
        conn: psycopg.Connection[Any],
        scope: Mapping[str, Any],
        *,
        fingerprint: str | None = None,
        with_ids: bool = False,
    ) -> list[DeadLetterGroup]:
        """The dead letters matching ``scope`` (``dlq_select``'s filter parameters) by
        failure fingerprint, largest group first; one group with ``fingerprint``."""
        params = {**scope, "fingerprint": fingerprint, "with_ids": with_ids}
        rows = conn.execute(self._queries["dlq_groups"], params).fetchall()
        return [
            DeadLetterGroup(
                fingerprint=row[0],
                stage=row[1],
                consumer=row[2],
                event_type=row[3],
                error_class=row[4],
                message=redact_text(row[5]),
                count=int(row[6]),
                waiting=int(row[7]),
                first_seen=row[8],
                last_seen=row[9],
                sample_id=int(row[10]),
                sample_error=redact_text(row[11]),
                ids=None if row[12] is None else [int(i) for i in row[12]],
            )
            for row in rows
        ]

    def get(self, conn: psycopg.Connection[Any], dead_letter_id: int) -> StoredDeadLetter | None:
        row = conn.execute(self._queries["dlq_get"], {"id": dead_letter_id}).fetchone()
        if row is None:
            return None
        letter = _letter(
            row[:13],
            outbox_status=row[15],
            seq=row[16],
            ordering_key=row[17],
            inbox_status=row[18],
        )
        return StoredDeadLetter(letter, row[13], row[14])

    def history(self, conn: psycopg.Connection[Any], letter: DeadLetter) -> list[FailedAttempt]:
        """The failed attempts behind a dead letter (its event's, at its stage and consumer)."""
        rows = conn.execute(
            self._queries["dlq_history"],
            {"event_id": letter.event_id, "stage": letter.stage, "consumer": letter.consumer},
        ).fetchall()
        return [FailedAttempt(row[0], row[1], redact_text(row[2]), row[3]) for row in rows]

    def events(
        self, conn: psycopg.Connection[Any], event_ids: Sequence[uuid.UUID]
    ) -> list[OutboxEvent]:
        """The outbox rows of these events that still exist, in sequence order."""
        rows = conn.execute(self._queries["dlq_events"], {"event_ids": list(event_ids)})
        return [OutboxEvent.from_row(row) for row in rows.fetchall()]

    def envelope(self, conn: psycopg.Connection[Any], dead_letter_id: int) -> str | None:
        """The envelope (or message) kept with a dead letter, as JSON text."""
        row = conn.execute(self._queries["dlq_envelope"], {"id": dead_letter_id}).fetchone()
        return row[0] if row else None

    def known_ids(self, conn: psycopg.Connection[Any], ids: Sequence[int]) -> set[int]:
        rows = conn.execute(self._queries["dlq_known_ids"], {"ids": list(ids)}).fetchall()
        return {int(row[0]) for row in rows}

    # -- replay ----------------------------------------------------------------------------
    def lock(self, conn: psycopg.Connection[Any], dead_letter_id: int) -> bool:
        """Lock a dead letter not yet replayed (inside a transaction); False if none."""
        return (
            conn.execute(self._queries["dlq_lock"], {"id": dead_letter_id}).fetchone() is not None
        )

    def requeue_outbox(
        self, conn: psycopg.Connection[Any], event_id: uuid.UUID
    ) -> uuid.UUID | None:
        """Put a dead event back to 'pending', due now; None when it is not dead."""
        row = conn.execute(self._queries["dlq_requeue_outbox"], {"event_id": event_id}).fetchone()
        return None if row is None else row[0]

    def wake_relay(self, conn: psycopg.Connection[Any], channel: str) -> None:
        conn.execute(self._queries["dlq_wake_relay"], {"channel": channel})

    def requeue_inbox(
        self, conn: psycopg.Connection[Any], consumer: str, events: Sequence[OutboxEvent]
    ) -> set[uuid.UUID]:
        """Set the consumer's inbox rows of these events back to 'pending'; returns the
        events now owed (those it has not processed)."""
        rows = conn.execute(
            self._queries["dlq_requeue_inbox"],
            {
                "consumer": consumer,
                "event_ids": [e.id for e in events],
                "event_types": [e.event_type for e in events],
                "ordering_keys": [e.ordering_key for e in events],
                "seqs": [e.seq for e in events],
            },
        ).fetchall()
        return {row[0] for row in rows}

    def mark_replayed(self, conn: psycopg.Connection[Any], dead_letter_id: int) -> None:
        conn.execute(self._queries["dlq_mark_replayed"], {"id": dead_letter_id})

    # -- purge -----------------------------------------------------------------------------
    def delete(self, conn: psycopg.Connection[Any], ids: Sequence[int]) -> list[int]:
        """Delete these dead letters; returns the ids deleted, in order."""
        rows = conn.execute(self._queries["dlq_delete"], {"ids": list(ids)}).fetchall()
        return sorted(int(row[0]) for row in rows)
