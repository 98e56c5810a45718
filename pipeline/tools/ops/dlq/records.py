"""Dead letters as the operator tools read them: listed by filter, or one in full.

A publish-stage dead letter is an event the relay gave up on (its outbox row is
``dead``). A consume-stage dead letter is a (consumer, event) pair a handler gave up
on (its inbox row is ``dead``), or an unprocessable message (an unreadable envelope, an
actor nobody registered), which may name no event or carry several.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import psycopg

from pipeline.db.stores.dead_letters import (
    DeadLetter,
    DeadLetterGroup,
    DeadLetterStore,
    FailedAttempt,
    uuids,
)
from pipeline.errors import MigrationError, NotFoundError
from pipeline.tools.ops.dlq.filters import DeadLetterFilter

__all__ = [
    "DeadLetter",  # a row of the dead-letter store, read here
    "DeadLetterDetail",
    "DeadLetterGroup",  # a row of the dead-letter store's groups, read here
    "FailedAttempt",
    "load_dead_letter",
    "select_dead_letters",
    "select_groups",
]

_NOT_INSTALLED = "the pipeline schema {!r} is not installed: run `pipeline db upgrade`"


def select_dead_letters(
    conn: psycopg.Connection[Any],
    schema: str,
    scope: DeadLetterFilter,
    *,
    limit: int | None = None,
    in_event_order: bool = False,
) -> list[DeadLetter]:
    """The dead letters in ``scope``; in event sequence order for a replay, else by id."""
    store = DeadLetterStore(schema)
    try:
        scope = _members(conn, store, scope)
        return store.select(conn, scope.params(limit=limit, in_event_order=in_event_order))
    except psycopg.errors.UndefinedTable:
        raise MigrationError(_NOT_INSTALLED.format(schema)) from None


def _members(
    conn: psycopg.Connection[Any], store: DeadLetterStore, scope: DeadLetterFilter
) -> DeadLetterFilter:
    """``scope`` with its group's dead letters looked up (replayed ones too: the selection
    applies ``--waiting`` itself); a fingerprint no dead letter in scope has is an error."""
    if scope.group is None or scope.group_ids is not None:
        return scope
    found = store.groups(
        conn, replace(scope, waiting=False).params(), fingerprint=scope.group, with_ids=True
    )
    if not found:
        raise NotFoundError(
            f"no dead letter in scope has the fingerprint {scope.group} "
            "(`pipeline dlq groups` lists them)"
        )
    return replace(scope, group_ids=tuple(found[0].ids or ()))


def select_groups(
    conn: psycopg.Connection[Any], schema: str, scope: DeadLetterFilter, *, limit: int | None
) -> list[DeadLetterGroup]:
    """The dead letters in ``scope`` by failure fingerprint, largest group first."""
    try:
        return DeadLetterStore(schema).groups(
            conn, scope.params(limit=limit), fingerprint=scope.group
        )
    except psycopg.errors.UndefinedTable:
        raise MigrationError(_NOT_INSTALLED.format(schema)) from None


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
    store = DeadLetterStore(schema)
    stored = store.get(conn, dead_letter_id)
    if stored is None:
        raise NotFoundError(f"no dead letter #{dead_letter_id} in schema {schema!r}")
    letter = stored.letter
    envelope = json.loads(stored.envelope) if stored.envelope is not None else None
    if isinstance(envelope, dict) and letter.event_id is None:
        letter.carried = uuids([str(e.get("id")) for e in _message_envelopes(envelope)])
    history = store.history(conn, letter) if letter.event_id is not None else []
    return DeadLetterDetail(
        letter=letter,
        envelope=envelope if isinstance(envelope, dict) else None,
        raw_message=stored.raw_message,
        history=history,
    )


def _message_envelopes(stored: dict[str, Any]) -> list[dict[str, Any]]:
    args = stored.get("args")
    if isinstance(args, list) and args and isinstance(args[0], list):
        return [e for e in args[0] if isinstance(e, dict)]
    return []
