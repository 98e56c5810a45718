"""Dead letters as the operator tools read them: listed by filter, or one in full.

A publish-stage dead letter is an event the relay gave up on (its outbox row is
``dead``). A consume-stage dead letter is a (consumer, event) pair a handler gave up
on (its inbox row is ``dead``), or an unprocessable message (an unreadable envelope, an
actor nobody registered), which may name no event or carry several.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from pipeline.db.queries import queries_for
from pipeline.errors import MigrationError, NotFoundError
from pipeline.tools.ops.dlq.filters import DeadLetterFilter


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


def _uuids(values: list[str] | None) -> list[uuid.UUID]:
    found = []
    for value in values or []:
        try:
            found.append(uuid.UUID(value))
        except ValueError:
            continue
    return found


def select_dead_letters(
    conn: psycopg.Connection[Any],
    schema: str,
    scope: DeadLetterFilter,
    *,
    limit: int | None = None,
    in_event_order: bool = False,
) -> list[DeadLetter]:
    """The dead letters in ``scope``; in event sequence order for a replay, else by id."""
    try:
        rows = conn.execute(
            queries_for(schema)["dlq_select"],
            scope.params(limit=limit, in_event_order=in_event_order),
        ).fetchall()
    except psycopg.errors.UndefinedTable:
        raise MigrationError(
            f"the pipeline schema {schema!r} is not installed: run `pipeline db upgrade`"
        ) from None
    return [
        _letter(
            row[:13],
            seq=row[13],
            ordering_key=row[14],
            outbox_status=row[15],
            inbox_status=row[16],
            carried=_uuids(row[17]),
            carried_processed=int(row[18] or 0),
            has_envelope=bool(row[19]),
        )
        for row in rows
    ]


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
    return DeadLetter(**dict(zip(names, columns, strict=True)), **state)


@dataclass
class FailedAttempt:
    attempt: int
    error_class: str
    error: str
    at: datetime


@dataclass
class DeadLetterDetail:
    """Everything kept about one dead letter, for ``pipeline dlq show``."""

    letter: DeadLetter
    envelope: dict[str, Any] | None
    raw_message: str | None
    history: list[FailedAttempt]

    def as_json(self, with_payload: bool) -> dict[str, Any]:
        data = self.letter.as_json()
        data["envelope"] = self.envelope_shown(with_payload)
        data["raw_message"] = self.raw_message if with_payload else None
        data["raw_message_bytes"] = len(self.raw_message) if self.raw_message is not None else None
        data["history"] = [
            {
                "attempt": a.attempt,
                "error_class": a.error_class,
                "error": a.error,
                "at": a.at.isoformat(),
            }
            for a in self.history
        ]
        return data

    def envelope_shown(self, with_payload: bool) -> dict[str, Any] | None:
        """The stored envelope; its ``data`` (the payload) only when asked for."""
        if self.envelope is None or with_payload:
            return self.envelope
        shown = dict(self.envelope)
        if "data" in shown:
            shown["data"] = f"<hidden: {len(json.dumps(shown['data']))} bytes; --payload shows it>"
        if "args" in shown:
            shown["args"] = "<hidden: --payload shows the message's arguments>"
        return shown


def load_dead_letter(
    conn: psycopg.Connection[Any], schema: str, dead_letter_id: int
) -> DeadLetterDetail:
    """One dead letter; :class:`NotFoundError` when no such id."""
    queries = queries_for(schema)
    row = conn.execute(queries["dlq_get"], {"id": dead_letter_id}).fetchone()
    if row is None:
        raise NotFoundError(f"no dead letter #{dead_letter_id} in schema {schema!r}")
    letter = _letter(
        row[:13],
        outbox_status=row[15],
        seq=row[16],
        ordering_key=row[17],
        inbox_status=row[18],
    )
    envelope = json.loads(row[13]) if row[13] is not None else None
    if isinstance(envelope, dict) and letter.event_id is None:
        letter.carried = _uuids([str(e.get("id")) for e in _message_envelopes(envelope)])
    history: list[FailedAttempt] = []
    if letter.event_id is not None:
        history = [
            FailedAttempt(*r)
            for r in conn.execute(
                queries["dlq_history"],
                {"event_id": letter.event_id, "stage": letter.stage, "consumer": letter.consumer},
            ).fetchall()
        ]
    return DeadLetterDetail(
        letter=letter,
        envelope=envelope if isinstance(envelope, dict) else None,
        raw_message=row[14],
        history=history,
    )


def _message_envelopes(stored: dict[str, Any]) -> list[dict[str, Any]]:
    args = stored.get("args")
    if isinstance(args, list) and args and isinstance(args[0], list):
        return [e for e in args[0] if isinstance(e, dict)]
    return []
