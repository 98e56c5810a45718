"""The producer: add events to the caller's own transaction.

The whole outbox guarantee (DESIGN I1) rests on the event row joining the
business transaction, so these functions take the caller's SQLAlchemy
``Session``/``AsyncSession`` (or, for Core code, its ``Connection``/``AsyncConnection``)
and never commit. Everything that can be wrong with an event is checked *before* any
SQL runs, so a rejected event leaves the session and its transaction fully usable; so
does a refusal for a full backlog (:class:`BacklogGate`, ``PIPELINE_BACKLOG_LIMIT``),
raised before the insert.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from decimal import Decimal
from functools import lru_cache
from typing import Any

from opentelemetry import context as otel_context
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from pipeline.config import Settings, get_settings
from pipeline.db.connect import permission_denied
from pipeline.db.ordering import ordering_lock_bucket
from pipeline.db.stores.outbox import OutboxStore
from pipeline.errors import BacklogFull, EventValidationError
from pipeline.ids import uuid7
from pipeline.observability.tracing import span_headers, start_create_span
from pipeline.registry import EVENT_TYPE

_HEADER_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
RESERVED_HEADERS = frozenset({"traceparent", "tracestate", "correlation_id", "causation_id"})
# outbox_insert's array parameters, each the named column of every row
INSERT_PARAMETERS = {
    "ids": "id",
    "aggregate_types": "aggregate_type",
    "aggregate_ids": "aggregate_id",
    "ordering_keys": "ordering_key",
    "event_types": "event_type",
    "event_versions": "event_version",
    "payloads": "payload",
    "headers": "headers",
}


@dataclass(frozen=True)
class NewEvent:
    """An event to add; ``ordering_key`` defaults to ``aggregate_type:aggregate_id``.

    Set ``ordered=False`` (or list the type in ``PIPELINE_UNORDERED_EVENT_TYPES``)
    for events that may be published in any order and so never wait for others.
    """

    event_type: str
    payload: Any
    aggregate_type: str | None = None
    aggregate_id: str | None = None
    ordering_key: str | None = None
    ordered: bool | None = None
    event_version: int = 1
    headers: Mapping[str, str] = field(default_factory=dict)
    correlation_id: uuid.UUID | None = None
    causation_id: uuid.UUID | None = None
    event_id: uuid.UUID | None = None


def add_event(
    session: Session | Connection, event_type: str, payload: Any, **fields: Any
) -> uuid.UUID:
    """Add one event to the transaction of ``session`` (or Core ``Connection``); its id.

    Keyword arguments are the fields of :class:`NewEvent`. Raises
    :class:`EventValidationError` (before any SQL) for an invalid event.
    """
    return add_events(session, [NewEvent(event_type, payload, **fields)])[0]


def add_events(session: Session | Connection, events: Sequence[NewEvent]) -> list[uuid.UUID]:
    """Add many events in one round trip; all are validated before any is written.

    On a Core ``Connection`` the events join its transaction (``engine.begin()``, or the
    one SQLAlchemy begins on first use: commit it as you commit your own writes). A
    connection in ``AUTOCOMMIT`` is refused, as a session bound to one is: each statement
    would commit on its own, and the events would no longer share the business
    transaction's fate.
    """
    settings = get_settings()
    rows = prepare_rows(events, settings)
    if rows:
        connection = session if isinstance(session, Connection) else session.connection()
        _refuse_autocommit(connection)
        deferred = _deferred.get()
        with _permission_errors(settings):
            if settings.backlog_limit and _gate.due(settings):
                query, params = _gate.query(settings)
                _gate.record(settings, connection.exec_driver_sql(query, params).scalar_one())
            _gate.check(settings)
            if deferred is not None and deferred.holds(session, connection):
                deferred.rows.extend(rows)  # inserted just before the transaction commits
            else:
                connection.exec_driver_sql(*_insert(rows, settings))
    return [row["id"] for row in rows]


async def add_event_async(
    session: AsyncSession | AsyncConnection, event_type: str, payload: Any, **fields: Any
) -> uuid.UUID:
    """:func:`add_event` for an ``AsyncSession`` (or Core ``AsyncConnection``)."""
    return (await add_events_async(session, [NewEvent(event_type, payload, **fields)]))[0]


async def add_events_async(
    session: AsyncSession | AsyncConnection, events: Sequence[NewEvent]
) -> list[uuid.UUID]:
    """:func:`add_events` for an ``AsyncSession`` (or Core ``AsyncConnection``)."""
    settings = get_settings()
    rows = prepare_rows(events, settings)
    if rows:
        if isinstance(session, AsyncConnection):
            connection = session
        else:
            connection = await session.connection()
        _refuse_autocommit(connection.sync_connection)
        with _permission_errors(settings):
            if settings.backlog_limit and _gate.due(settings):
                query, params = _gate.query(settings)
                result = await connection.exec_driver_sql(query, params)
                _gate.record(settings, result.scalar_one())
            _gate.check(settings)
            await connection.exec_driver_sql(*_insert(rows, settings))
    return [row["id"] for row in rows]


class DeferredEvents:
    """Events added to one transaction, held back until just before it commits.

    The insert takes each ordered key's lock (:mod:`pipeline.db.ordering`) until COMMIT;
    a transaction that inserts early and then waits (a handler calling another service,
    a frozen worker) makes every producer of those keys wait with it. The inbox adds a
    handler's follow-up events here instead: each is validated (and the backlog limit
    checked) when it is added, as :func:`add_events` does, and all are inserted in one
    statement, in lock order, by :meth:`insert` right before COMMIT — so the locks are
    held for the time of that statement and the commit, whatever the handlers did.
    """

    def __init__(self, session: Session) -> None:
        self.session = session
        self.rows: list[dict[str, Any]] = []

    def holds(self, session: Session | Connection, connection: Connection) -> bool:
        """Whether events added on ``session`` (whose connection is ``connection``) belong
        to this transaction: the session itself, or the connection it is using now."""
        return session is self.session or connection is self.session.connection()

    def mark(self) -> int:
        """A point to go back to (:meth:`discard_after`) when work since is rolled back."""
        return len(self.rows)

    def discard_after(self, mark: int) -> None:
        del self.rows[mark:]

    def insert(self) -> int:
        """Insert the held events on the transaction's connection; how many there were."""
        count = len(self.rows)
        if count:
            settings = get_settings()
            rows, self.rows = self.rows, []
            with _permission_errors(settings):
                self.session.connection().exec_driver_sql(*_insert(rows, settings))
        return count


_deferred: ContextVar[DeferredEvents | None] = ContextVar("pipeline_deferred_events", default=None)


def held_events() -> DeferredEvents | None:
    """The events held back in this context (:func:`deferring_events`), if any."""
    return _deferred.get()


@contextmanager
def deferring_events(session: Session) -> Iterator[DeferredEvents]:
    """Hold back events added on ``session`` (or its connection) while the block runs.

    The caller inserts them with :meth:`DeferredEvents.insert` before it commits; events
    still held when the block ends are dropped (their transaction did not commit).
    """
    deferred = DeferredEvents(session)
    token = _deferred.set(deferred)
    try:
        yield deferred
    finally:
        _deferred.reset(token)


def _refuse_autocommit(connection: Connection | None) -> None:
    """Refuse a connection whose statements commit one by one (checked before any SQL).

    Reads the driver connection's ``autocommit`` flag, which SQLAlchemy sets for
    ``isolation_level="AUTOCOMMIT"``: an attribute read, no round trip (an async
    connection's sync side is already connected, so no await is needed either).
    """
    if connection is None:
        return
    if getattr(connection.connection.driver_connection, "autocommit", False):
        raise EventValidationError(
            "add_event needs a transaction, but the connection is in AUTOCOMMIT: each "
            "statement would commit on its own; use engine.begin() or a Session on a "
            "connection without isolation_level='AUTOCOMMIT' (nothing was written)"
        )


@contextmanager
def _permission_errors(settings: Settings) -> Iterator[None]:
    """A missing grant as one clear error (the transaction is aborted, as for any failed
    SQL); any other driver error passes through as it is. Shared by the sync and async
    producers, whose statements differ only in being awaited."""
    try:
        yield
    except DBAPIError as exc:
        schema = settings.schema_name
        needed = f"INSERT on {schema}.outbox"
        if settings.backlog_limit:
            needed = f"SELECT and INSERT on {schema}.outbox (PIPELINE_BACKLOG_LIMIT counts it)"
        denied = permission_denied(
            exc, f"adding events needs USAGE on schema {schema} and {needed}"
        )
        if denied is None:
            raise
        raise denied from exc


class BacklogGate:
    """``PIPELINE_BACKLOG_LIMIT`` on the producer's path, for at most one count a second.

    Each process keeps the last count of unsent events per schema; a producer counts
    again (no further than the limit + 1, on the unsent rows' index, in its own
    transaction) only when that figure is over a second old, so the limit costs one
    bounded query per second per process, not one per event. The limit is therefore
    approximate: up to a second of events may pass it before producers see it. With no
    limit set, nothing is counted.
    """

    REFRESH_SECONDS = 1.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, tuple[float, int]] = {}  # schema -> (monotonic time, count)

    def due(self, settings: Settings) -> bool:
        counted = self._counts.get(settings.schema_name)
        return counted is None or time.monotonic() - counted[0] >= self.REFRESH_SECONDS

    def query(self, settings: Settings) -> tuple[str, dict[str, Any]]:
        return _store(settings).backlog_count(settings.backlog_limit + 1)

    def record(self, settings: Settings, unsent: int) -> None:
        with self._lock:
            self._counts[settings.schema_name] = (time.monotonic(), int(unsent))

    def check(self, settings: Settings) -> None:
        """Raise :class:`BacklogFull` when the last count is over the limit (no SQL)."""
        if not settings.backlog_limit:
            return
        counted = self._counts.get(settings.schema_name)
        if counted is not None and counted[1] > settings.backlog_limit:
            raise BacklogFull(
                f"more than {settings.backlog_limit} events are waiting to be published "
                "(PIPELINE_BACKLOG_LIMIT); nothing was written: retry later"
            )

    def forget(self) -> None:
        """Drop the cached counts (tests, or after changing the limit)."""
        with self._lock:
            self._counts.clear()


_gate = BacklogGate()


def _insert(rows: list[dict[str, Any]], settings: Settings) -> tuple[str, dict[str, Any]]:
    """One INSERT for all rows (a precompiled statement: the hot path skips SQLAlchemy's
    compiler), with the rows in the order their ordering keys are locked."""
    ordered = rows if len(rows) == 1 else insertion_order(rows)
    return _store(settings).insert(ordered, INSERT_PARAMETERS)


@lru_cache(maxsize=8)
def _store_for(schema: str) -> OutboxStore:
    return OutboxStore(schema)


def _store(settings: Settings) -> OutboxStore:
    return _store_for(settings.schema_name)


def prepare_rows(events: Sequence[NewEvent], settings: Settings) -> list[dict[str, Any]]:
    """Validate events and turn them into outbox rows (no I/O).

    Once every event is valid, each gets its own ``create`` span (a child of the caller's
    current span), and that span's context is stored in the row's headers: the event's
    creation context, which the relay links to and the consumer continues. Without an
    OpenTelemetry provider the caller's context is stored as it is, and an event made
    outside any trace gets a new trace of its own, so its workflow is still one trace.
    """
    rows = [_row(event, index, settings) for index, event in enumerate(events)]
    parent = otel_context.get_current()
    for row in rows:
        headers = row["headers"]
        span = start_create_span(
            row["event_type"], row["id"], parent=parent, correlation_id=headers["correlation_id"]
        )
        headers.update(span_headers(span))
        span.end()
        row["headers"] = json.dumps(headers, separators=(",", ":"))
    return rows


def insertion_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows stably sorted by their key's lock, the order in which the insert takes the locks.

    The insert trigger locks each ordering key's bucket (:mod:`pipeline.db.ordering`);
    taking the locks in ascending order keeps two concurrent batches from deadlocking each
    other. Each key keeps its events' order.
    """

    def lock_order(row: dict[str, Any]) -> tuple[bool, int, str]:
        key = row["ordering_key"]
        return (key is not None, ordering_lock_bucket(key) if key is not None else 0, key or "")

    return sorted(rows, key=lock_order)


def _row(event: NewEvent, index: int, settings: Settings) -> dict[str, Any]:
    where = (
        f"event {index} ({event.event_type!r})"
        if isinstance(event.event_type, str)
        else (f"event {index}")
    )
    if not isinstance(event.event_type, str) or not EVENT_TYPE.fullmatch(event.event_type):
        raise EventValidationError(
            f"{where}: event_type must be 1-200 characters of letters, digits and _.:/-"
        )
    version = event.event_version
    if isinstance(version, bool) or not isinstance(version, int) or not 0 < version < 2**31:
        raise EventValidationError(
            f"{where}: event_version must be a positive integer below {2**31} (not a bool)"
        )
    event_id = _uuid(event.event_id, "event_id", where) or uuid7()
    payload = encode_payload(event.payload, settings.max_payload_bytes, where)
    headers = _headers(event, event_id, where)
    return {
        "id": event_id,
        "aggregate_type": _optional_text(event.aggregate_type, "aggregate_type", where),
        "aggregate_id": _optional_text(event.aggregate_id, "aggregate_id", where),
        "ordering_key": _ordering_key(event, settings, where),
        "event_type": event.event_type,
        "event_version": event.event_version,
        "payload": payload,
        "headers": headers,  # trace context added and serialised by prepare_rows
    }


def _uuid(value: object, name: str, where: str) -> uuid.UUID | None:
    """``value`` as a UUID (a ``uuid.UUID`` or its text form), ``None`` kept; else refused."""
    if value is None or isinstance(value, uuid.UUID):
        return value
    if isinstance(value, str):
        try:
            return uuid.UUID(value)
        except ValueError:
            pass
    raise EventValidationError(f"{where}: {name} must be a UUID")


MAX_PAYLOAD_DEPTH = 100


def check_depth(payload: Any, where: str = "event", limit: int = MAX_PAYLOAD_DEPTH) -> None:
    """Refuse a payload whose lists and objects nest deeper than ``limit`` levels.

    Walked level by level without recursion. Call it on a payload ``json.dumps`` took,
    which has no cycles (it refuses those), so the walk ends.
    """
    level = [payload] if isinstance(payload, dict | list | tuple) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            raise EventValidationError(
                f"{where}: payload nests lists and objects deeper than {limit} levels"
            )
        below: list[Any] = []
        for value in level:
            for child in value.values() if isinstance(value, dict) else value:
                if isinstance(child, dict | list | tuple):
                    below.append(child)
        level = below


# A float json.dumps writes otherwise than Postgres prints it back: in exponent form
# (1e-05, 1.5e+16) or as -0.0. Matches inside strings only cost the walk below.
_FLOAT_WRITTEN_OTHERWISE = re.compile(r"[0-9]e[-+]|-0\.0(?![0-9])")


def stored_size(payload: Any, encoded: str, encoded_bytes: int) -> int:
    """Bytes of ``payload``'s compact JSON as the database measures it (migration 0008).

    Postgres keeps a jsonb number as a decimal and prints it in full, so the outbox's
    ceiling counts ``1e+300`` as 301 bytes and ``-0.0`` as ``0.0``; counting the same
    here makes ``add_event`` refuse exactly what the table refuses.
    """
    if not _FLOAT_WRITTEN_OTHERWISE.search(encoded):
        return encoded_bytes
    size = encoded_bytes
    level = [payload]
    while level:
        below: list[Any] = []
        for value in level:
            if isinstance(value, float):
                written = float.__repr__(value)
                printed = format(Decimal(written), "f").removeprefix("-" if value == 0 else "")
                size += len(printed) - len(written)
            elif isinstance(value, dict):
                below.extend(value.values())
            elif isinstance(value, list | tuple):
                below.extend(value)
        level = below
    return size


def encode_payload(payload: Any, max_bytes: int, where: str = "event") -> str:
    """Serialise a payload to compact JSON, refusing what JSON, the size limit or the depth
    limit cannot hold."""
    try:
        encoded = json.dumps(payload, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    except RecursionError:  # nested past the interpreter's own limit (~1,000 levels)
        raise EventValidationError(
            f"{where}: payload nests lists and objects deeper than {MAX_PAYLOAD_DEPTH} levels"
        ) from None
    except (TypeError, ValueError) as exc:
        raise EventValidationError(f"{where}: payload is not JSON-serialisable: {exc}") from None
    try:
        size = stored_size(payload, encoded, len(encoded.encode("utf-8")))
    except UnicodeEncodeError:
        raise EventValidationError(
            f"{where}: payload contains a lone surrogate, which is not valid UTF-8"
        ) from None
    if size > max_bytes:
        raise EventValidationError(
            f"{where}: payload is {size} bytes, over the limit of {max_bytes} "
            "(PIPELINE_MAX_PAYLOAD_BYTES)"
        )
    # Fewer brackets in the text than the limit (brackets in strings count too): the
    # payload cannot nest that deep, and the walk is skipped.
    if encoded.count("[") + encoded.count("{") > MAX_PAYLOAD_DEPTH:
        check_depth(payload, where)
    if "\\u0000" in encoded:
        raise EventValidationError(
            f"{where}: payload contains a NUL character, which jsonb rejects"
        )
    return encoded


def _optional_text(value: object, name: str, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 500:
        raise EventValidationError(f"{where}: {name} must be a non-empty string of <= 500 chars")
    if not _storable(value):
        raise EventValidationError(f"{where}: {name} {_UNSTORABLE}")
    return value


_UNSTORABLE = "contains a NUL character or a lone surrogate, which Postgres text cannot hold"


def _storable(value: str) -> bool:
    """Whether Postgres can store ``value`` as text (values are data, stored verbatim)."""
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _ordering_key(event: NewEvent, settings: Settings, where: str) -> str | None:
    ordered = event.ordered
    if ordered is None:
        ordered = event.event_type not in settings.unordered_event_types
    if not ordered:
        return None
    if event.ordering_key is not None:
        return _optional_text(event.ordering_key, "ordering_key", where)
    if event.aggregate_id is None:
        return None
    return f"{event.aggregate_type or ''}:{event.aggregate_id}"


def _headers(event: NewEvent, event_id: uuid.UUID, where: str) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, value in event.headers.items():
        valid = isinstance(name, str) and _HEADER_NAME.fullmatch(name) is not None
        if not valid or name in RESERVED_HEADERS:
            raise EventValidationError(
                f"{where}: header name {name!r} is invalid or reserved "
                "(lower-case a-z, 0-9, _.-; not traceparent/tracestate/correlation_id/causation_id)"
            )
        if not isinstance(value, str) or len(value) > 1024:
            raise EventValidationError(
                f"{where}: header {name!r} must be a string of <= 1024 chars"
            )
        if not _storable(value):
            raise EventValidationError(f"{where}: header {name!r} {_UNSTORABLE}")
        headers[name] = value
    headers["correlation_id"] = str(
        _uuid(event.correlation_id, "correlation_id", where) or event_id
    )
    causation_id = _uuid(event.causation_id, "causation_id", where)
    if causation_id is not None:
        headers["causation_id"] = str(causation_id)
    return headers
