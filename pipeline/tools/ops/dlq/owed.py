"""Deliveries owed to consumers, for an operator: which (event, consumer) deliveries have
no outcome yet, and abandoning those owed to a consumer that no longer exists.

The delivery ledger (:mod:`pipeline.relay.ledger`) sends an owed delivery again until its
consumer records an outcome. A consumer that was removed or renamed never will: its
deliveries stay owed and ``PipelineDeliveriesOwed`` fires for good. ``abandon`` finishes
them as 'dead' for that consumer (no dead letter: the audit log records who decided and
why). A consumer the configured app modules still register is refused unless forced:
its deliveries are owed for a reason (its workers are down, or behind).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.config import Settings
from pipeline.db.stores.ledger import LedgerStore, OwedRow
from pipeline.errors import ConfigurationError
from pipeline.relay.ledger import SWEEP_OVERLAP
from pipeline.tools.ops.dlq.access import open_connection, require_grants

ABANDON_BATCH = 1000
"""Deliveries finished per transaction (each batch is counted in the audit record)."""

ABANDONED_ERROR = "abandoned by an operator: the consumer no longer exists"


@dataclass
class ConsumerOwed:
    """How much one consumer is owed, and whether the app modules still register it."""

    consumer: str
    total: int
    oldest_age: float
    registered: bool | None
    """None: unknown (no app modules configured)."""

    def as_json(self) -> dict[str, Any]:
        return {
            "consumer": self.consumer,
            "owed": self.total,
            "oldest_age_seconds": round(self.oldest_age, 3),
            "registered": self.registered,
        }


@dataclass
class OwedReport:
    """The owed deliveries listed (oldest first) and every consumer's total."""

    min_age: float
    deliveries: list[OwedRow]
    consumers: list[ConsumerOwed]

    def as_json(self) -> dict[str, Any]:
        return {
            "min_age_seconds": self.min_age,
            "consumers": [c.as_json() for c in self.consumers],
            "deliveries": [
                {
                    "event_id": str(row.event_id),
                    "consumer": row.consumer,
                    "event_type": row.event_type,
                    "status": row.status,
                    "recorded": row.recorded,
                    "since": row.since.isoformat(),
                    "age_seconds": round(row.age, 3),
                    "attempts": row.attempts,
                    "redeliveries": row.redeliveries,
                }
                for row in self.deliveries
            ],
        }


def registered_consumers(settings: Settings) -> set[str] | None:
    """The consumers the configured app modules register; None when none are configured
    (then nobody can tell a removed consumer from one whose module was not named)."""
    if not settings.app_module_names():
        return None
    from pipeline.tools.ops.consumers import load_registry

    return {subscription.consumer for subscription in load_registry(settings).all()}


def list_owed(
    settings: Settings, *, consumer: str | None, min_age: float, limit: int
) -> OwedReport:
    """``pipeline dlq owed``: deliveries owed at least ``min_age`` seconds, oldest first."""
    registered = registered_consumers(settings)
    with open_connection(settings) as conn:
        rows = LedgerStore(settings.schema_name).owed_list(
            conn,
            min_age=min_age,
            overlap=SWEEP_OVERLAP.total_seconds(),
            consumer=consumer,
            limit=limit,
        )
    totals: dict[str, ConsumerOwed] = {}
    for row in rows:  # oldest first: a consumer's first row is its oldest
        totals.setdefault(
            row.consumer,
            ConsumerOwed(
                row.consumer,
                row.consumer_total,
                row.age,
                None if registered is None else row.consumer in registered,
            ),
        )
    return OwedReport(
        min_age,
        [row for row in rows if row.listed],
        sorted(totals.values(), key=lambda c: c.consumer),
    )


@dataclass
class AbandonReport:
    """What abandoning a consumer's deliveries would do (dry run) or did."""

    consumer: str
    dry_run: bool
    owed: int
    """Deliveries owed to the consumer when the command started (any age)."""
    registered: bool | None
    audit_id: int | None = None
    abandoned: int = 0
    batches: list[tuple[int, int]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "consumer": self.consumer,
            "owed": self.owed,
            "registered": self.registered,
            "audit_id": self.audit_id,
            "abandoned": self.abandoned,
        }


def abandon_deliveries(
    settings: Settings,
    consumer: str,
    *,
    dry_run: bool,
    force: bool = False,
    reason: str = "",
) -> AbandonReport:
    """``pipeline dlq abandon``: finish every delivery owed to ``consumer`` as dead,
    audited; a dry run counts them. Refuses a consumer the app modules register, or when
    no app modules are configured, unless ``force``."""
    registered = registered_consumers(settings)
    if not force:
        if registered is None:
            raise ConfigurationError(
                f"cannot tell whether consumer {consumer!r} still exists: name the modules that "
                "register your consumers in PIPELINE_APP_MODULES (or --app), or give --force"
            )
        if consumer in registered:
            raise ConfigurationError(
                f"consumer {consumer!r} is registered by the app modules: its deliveries are "
                "owed until its workers process them (start them); --force abandons them anyway"
            )
    known = None if registered is None else consumer in registered
    schema = settings.schema_name
    store = LedgerStore(schema)
    overlap = SWEEP_OVERLAP.total_seconds()
    with open_connection(settings) as conn:
        if not dry_run:
            require_grants(conn, settings, "pipeline dlq abandon", abandon=True)
        rows = store.owed_list(conn, min_age=0, overlap=overlap, consumer=consumer, limit=1)
        owed = rows[0].consumer_total if rows else 0
        report = AbandonReport(consumer, dry_run, owed, known)
        if dry_run:
            return report
        from pipeline.tools.ops.audit import add_affected, begin_action

        report.audit_id = begin_action(
            conn, schema, "dlq.abandon", reason, {"consumer": consumer, "force": force}
        )
        while True:
            with conn.transaction():
                recorded, unrecorded = store.abandon(
                    conn, consumer, ABANDONED_ERROR, overlap, ABANDON_BATCH
                )
                if recorded or unrecorded:
                    add_affected(conn, schema, report.audit_id, recorded + unrecorded)
            if not (recorded or unrecorded):
                break
            report.batches.append((recorded, unrecorded))
            report.abandoned += recorded + unrecorded
    return report
