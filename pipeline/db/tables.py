"""The declared schema, as SQLAlchemy Core tables.

These tables are the reference the migrations are tested against
(``tests/integration/test_migrations.py``) and what the producer inserts through,
so an application's own ``Session`` and engine are all the producer needs. They
are declared in the placeholder schema :data:`SCHEMA`; the configured schema name
is substituted at execution time with ``schema_translate_map``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Double,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    cast,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlalchemy.types import UserDefinedType

SCHEMA = "pipeline"
metadata = MetaData(schema=SCHEMA)
_now = text("clock_timestamp()")


class EncodedJSONB(UserDefinedType[str]):
    """``jsonb`` bound from text the producer already serialised (and size-checked).

    Plain ``JSONB`` would serialise a second time; this casts the text in SQL instead.
    """

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "jsonb"

    def bind_expression(self, bindvalue: Any) -> Any:
        return cast(bindvalue, JSONB)


class XID8(UserDefinedType[int]):
    """Postgres ``xid8``: the 64-bit transaction id used for commit-order safety."""

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "xid8"


def _status_check(name: str, values: tuple[str, ...]) -> CheckConstraint:
    quoted = ", ".join(f"'{v}'" for v in values)
    return CheckConstraint(f"status IN ({quoted})", name=name)


OUTBOX_STATUSES = ("pending", "publishing", "sent", "dead")
UNSENT = text("status IN ('pending', 'publishing')")

outbox = Table(
    "outbox",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("seq", BigInteger, Identity(always=True), nullable=False),
    Column("txid", XID8, nullable=False, server_default=text("pg_current_xact_id()")),
    Column("aggregate_type", Text),
    Column("aggregate_id", Text),
    Column("ordering_key", Text),
    Column("event_type", Text, nullable=False),
    Column("event_version", Integer, nullable=False, server_default=text("1")),
    Column("payload", EncodedJSONB, nullable=False),
    Column("headers", EncodedJSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("status", Text, nullable=False, server_default=text("'pending'::text")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("next_attempt_at", DateTime(timezone=True), nullable=False, server_default=_now),
    Column("lease_token", BigInteger),
    Column("lease_owner", Text),
    Column("lease_expires_at", DateTime(timezone=True)),
    Column("last_error", Text),
    Column("last_error_class", Text),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=_now),
    Column("published_at", DateTime(timezone=True)),
    # The consumers the event was delivered to, set when it is marked sent: the ledger of
    # what each of them is owed (their inbox rows hold the outcomes).
    Column("consumers", ARRAY(Text)),
    _status_check("outbox_status_check", OUTBOX_STATUSES),
    Index("outbox_unsent_idx", "seq", postgresql_where=UNSENT),
    Index(
        "outbox_key_idx",
        "ordering_key",
        "seq",
        postgresql_where=text("status IN ('pending', 'publishing') AND ordering_key IS NOT NULL"),
    ),
    Index("outbox_published_idx", "published_at", postgresql_where=text("status = 'sent'")),
    Index(
        "outbox_unrouted_idx",
        "seq",
        postgresql_where=text("status = 'sent' AND consumers = '{}'::text[]"),
    ),
    Index(
        "outbox_causation_idx",
        text("(headers ->> 'causation_id')"),
        postgresql_where=text("(headers ->> 'causation_id') IS NOT NULL"),
    ),
)

inbox = Table(
    "inbox",
    metadata,
    Column("consumer", Text, nullable=False),
    Column("event_id", UUID(as_uuid=True), nullable=False),
    Column("event_type", Text, nullable=False),
    Column("ordering_key", Text),
    Column("seq", BigInteger),
    Column("status", Text, nullable=False),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("received_at", DateTime(timezone=True), nullable=False, server_default=_now),
    Column("processed_at", DateTime(timezone=True)),
    Column("last_error", Text),
    Column("last_error_class", Text),
    # When a copy was last handed to the broker for this consumer (or its retry is due).
    Column("delivered_at", DateTime(timezone=True), nullable=False, server_default=_now),
    Column("redeliveries", Integer, nullable=False, server_default=text("0")),
    PrimaryKeyConstraint("consumer", "event_id", name="inbox_pkey"),
    _status_check("inbox_status_check", ("pending", "processed", "failed", "dead")),
    Index("inbox_processed_idx", "processed_at"),
    Index(
        "inbox_unfinished_idx",
        "consumer",
        "ordering_key",
        "seq",
        postgresql_where=text("status IN ('pending', 'failed')"),
    ),
    Index("inbox_event_idx", "event_id"),
    Index(
        "inbox_owed_idx", "delivered_at", postgresql_where=text("status IN ('pending', 'failed')")
    ),
)

attempts = Table(
    "attempts",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("event_id", UUID(as_uuid=True), nullable=False),
    Column("stage", Text, nullable=False),
    Column("consumer", Text),
    Column("attempt", Integer, nullable=False),
    Column("error_class", Text, nullable=False),
    Column("error", Text, nullable=False),
    Column("occurred_at", DateTime(timezone=True), nullable=False, server_default=_now),
    CheckConstraint("stage IN ('publish', 'consume')", name="attempts_stage_check"),
    Index("attempts_event_idx", "event_id"),
    Index("attempts_occurred_idx", "occurred_at"),
)

dead_letters = Table(
    "dead_letters",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("stage", Text, nullable=False),
    Column("event_id", UUID(as_uuid=True)),
    Column("consumer", Text),
    Column("event_type", Text),
    Column("queue", Text),
    Column("reason", Text, nullable=False),
    Column("error_class", Text, nullable=False),
    Column("error", Text, nullable=False),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("envelope", JSONB),
    Column("raw_message", Text),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=_now),
    Column("replayed_at", DateTime(timezone=True)),
    Column("replay_count", Integer, nullable=False, server_default=text("0")),
    # SHA-256 of the queue and the raw bytes of a raw message: one row per such message.
    Column("raw_digest", LargeBinary),
    # SHA-256 of the queue, id, content and part of a delivered message a dead letter was
    # recorded for: one row per such dead letter however often the message is delivered.
    Column("message_digest", LargeBinary),
    CheckConstraint("stage IN ('publish', 'consume')", name="dead_letters_stage_check"),
    Index("dead_letters_created_idx", "stage", "created_at"),
    Index("dead_letters_event_idx", "event_id"),
    Index(
        "dead_letters_raw_digest_idx",
        "raw_digest",
        unique=True,
        postgresql_where=text("raw_digest IS NOT NULL"),
    ),
    Index(
        "dead_letters_message_digest_idx",
        "message_digest",
        unique=True,
        postgresql_where=text("message_digest IS NOT NULL"),
    ),
)

audit_log = Table(
    "audit_log",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("at", DateTime(timezone=True), nullable=False, server_default=_now),
    Column("actor", Text, nullable=False),
    Column("action", Text, nullable=False),
    Column("parameters", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("affected", Integer, nullable=False, server_default=text("0")),
    Index("audit_log_at_idx", "at"),
)

# Duplicate deliveries and ledger re-deliveries, one row each, for per-consumer figures.
delivery_log = Table(
    "delivery_log",
    metadata,
    Column("consumer", Text, nullable=False),
    Column("event_id", UUID(as_uuid=True), nullable=False),
    Column("kind", Text, nullable=False),
    Column("at", DateTime(timezone=True), nullable=False, server_default=_now),
    CheckConstraint("kind IN ('duplicate', 'redelivery')", name="delivery_log_kind_check"),
    Index("delivery_log_at_idx", "at"),
)


def _heartbeat_table(name: str, id_column: str) -> Table:
    """A heartbeat table: the relays' and the worker processes' rows have one shape."""
    return Table(
        name,
        metadata,
        Column(id_column, Text, primary_key=True),
        Column("busy", Boolean, nullable=False, server_default=text("false")),
        Column("heartbeat_at", DateTime(timezone=True), nullable=False, server_default=_now),
        Column("host", Text, nullable=False),
        Column("pid", Integer, nullable=False),
        # The process's clock minus the database's, in seconds, as its last heartbeat
        # measured it (NULL: not measured yet).
        Column("clock_offset", Double),
    )


relay_state = _heartbeat_table("relay_state", "relay_id")
worker_state = _heartbeat_table("worker_state", "worker_id")

delivery_sweep = Table(
    "delivery_sweep",
    metadata,
    Column("id", Boolean, primary_key=True, server_default=text("true")),
    Column("swept_to", DateTime(timezone=True), nullable=False, server_default=_now),
    Column("sweeps", BigInteger, nullable=False, server_default=text("0")),
    CheckConstraint("id", name="delivery_sweep_one_row"),
)
