"""The drill's checker: what the database and the payment API's ledger say happened.

Every count comes from where the work really landed — the outbox, inbox and dead-letter
tables, the workflow's own rows, the API's ledger — never from what the drill hoped for.
The checks are exact; the only clock involved is the recovery bound, checked by the runner.

* **lost**: an (event, subscribed consumer) pair with no processed inbox row and no effect;
* **duplicate-effect**: a consumer's effect committed twice for one event (or two follow-up
  events for one order);
* **inconsistent**: an effect without its inbox record, or a processed record without its
  effect (the two commit in one transaction);
* **atomicity**: an order without its event, or an event without its order;
* **charges** / **emails**: the API did not do exactly one charge (e-mail) per payable order;
* **order**: an ordered consumer handled a key's events out of sequence order;
* **dead-letter**: a dead letter other than a poison order's, or a poison order that was
  not dead-lettered by every consumer of ``order.placed``;
* **backlog**: events of the workflow still unsent.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg

from pipeline.tools.drill.sql import DrillQueries
from pipeline.tools.drill.workflow import (
    CONSUMERS,
    EVENT_TYPES,
    LEDGER,
    ORDER_PLACED,
    ORDERED_CONSUMERS,
    PAYMENTS,
    POISON_CONSUMERS,
    ROUTES,
)
from pipeline.tools.harness.payment_api import CHARGES_PATH, EMAILS_PATH

EXAMPLES = 5


@dataclass
class Violation:
    """One broken guarantee: what kind, how many times, and a few examples."""

    kind: str
    count: int
    message: str
    examples: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "count": self.count,
            "message": self.message,
            "examples": self.examples,
        }


@dataclass(frozen=True)
class Undelivered:
    """An (event, consumer) pair that was never processed: where the event got to."""

    consumer: str
    event_id: str
    event_type: str
    order_id: str | None
    outbox_status: str
    published_at: float | None  # database clock, seconds since the epoch
    inbox_status: str | None
    ordering_key: str | None = None
    seq: int = 0
    held: bool = False  # an ordered consumer's event behind an earlier undelivered one of its key

    @property
    def stage(self) -> str:
        """Where it stopped: never published, published but never processed, or failing."""
        if self.outbox_status in ("pending", "publishing"):
            return "never published"
        if self.outbox_status == "dead":
            return "dead-lettered at publish"
        if self.inbox_status is None:
            return "sent, no inbox row"
        return f"sent, inbox {self.inbox_status}"


@dataclass
class CheckResult:
    orders: int = 0  # payable orders placed (committed)
    poison: int = 0  # poison orders placed
    deliveries: dict[str, dict[str, int]] = field(default_factory=dict)
    outbox: dict[str, dict[str, int]] = field(default_factory=dict)
    undelivered: list[Undelivered] = field(default_factory=list)
    api: dict[str, Any] = field(default_factory=dict)
    dead_letters: dict[str, int] = field(default_factory=dict)
    ids_out_of_order: dict[str, int] = field(default_factory=dict)
    failed_attempts: list[dict[str, Any]] = field(default_factory=list)
    redeliveries: int | None = None  # None: this schema does not record re-deliveries
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def add(self, kind: str, items: list[str], message: str) -> None:
        """Record a violation when ``items`` (one per occurrence) is not empty."""
        if items:
            self.violations.append(Violation(kind, len(items), message, items[:EXAMPLES]))


def _route_params() -> dict[str, list[str]]:
    return {
        "consumers": [route.consumer for route in ROUTES],
        "event_types": [route.event_type for route in ROUTES],
    }


def check_run(
    conn: psycopg.Connection[Any], queries: DrillQueries, ledger: dict[str, Any]
) -> CheckResult:
    """Check the run whose pipeline schema and tables ``queries`` names; ``ledger`` is the
    payment API's ``GET /ledger?run=RUN`` answer."""
    result = CheckResult()

    def rows(name: str, params: dict[str, Any] | None = None) -> list[Any]:
        return conn.execute(queries.text(name), params or {}).fetchall()

    orders_total, poison = rows("orders_placed")[0]
    result.orders, result.poison = int(orders_total) - int(poison), int(poison)
    result.deliveries = {
        consumer: {"expected": int(expected), "processed": int(processed), "dead": int(dead)}
        for consumer, expected, processed, dead in rows("delivery_counts", _route_params())
    }
    for event_type, status, count in rows("outbox_counts", {"event_types": list(EVENT_TYPES)}):
        result.outbox.setdefault(event_type, {})[status] = int(count)

    _check_atomicity(result, rows)
    _check_deliveries(result, rows)
    _check_order(result, rows)
    placed = rows("order_ids")
    order_ids = {order_id: bool(flag) for order_id, flag, _ in placed}
    poison_events = [event_id for _, flag, event_id in placed if flag]
    _check_dead_letters(result, rows, poison_events)
    _check_ledger(result, ledger, order_ids)

    unsent = int(rows("unsent_events", {"event_types": list(EVENT_TYPES)})[0][0])
    result.add(
        "backlog",
        [f"{unsent} events of the workflow still unsent"] if unsent else [],
        "the outbox still holds unsent events of the workflow",
    )
    keys, events = rows("ids_out_of_order", {"root_type": ORDER_PLACED})[0]
    result.ids_out_of_order = {"keys": int(keys), "events": int(events)}
    result.failed_attempts = [
        {
            "stage": stage,
            "consumer": consumer or None,
            "error_class": error_class,
            "count": int(n),
            "example": example,
        }
        for stage, consumer, error_class, n, example in rows("failed_attempts")
    ]
    has = rows(
        "has_column", {"schema_name": queries.schema, "table": "inbox", "column": "redeliveries"}
    )[0][0]
    if has:
        result.redeliveries = int(rows("redeliveries", {"consumers": list(CONSUMERS)})[0][0])
    return result


def _check_atomicity(result: CheckResult, rows: Any) -> None:
    without_event, without_order = rows("atomicity", {"root_type": ORDER_PLACED})[0]
    result.add(
        "atomicity",
        [f"{without_event} orders committed without their event"] * bool(without_event)
        + [f"{without_order} events committed without their order"] * bool(without_order),
        "an order and its event did not commit together",
    )
    duplicated = [
        f"{event_type}: {int(extra)} extra events"
        for event_type, extra in rows("follow_up_counts", {"event_types": list(EVENT_TYPES)})
        if int(extra) > 0
    ]
    result.add(
        "duplicate-effect",
        duplicated,
        "an order has more than one event of a type (a follow-up published twice)",
    )


def _check_deliveries(result: CheckResult, rows: Any) -> None:
    duplicates: list[str] = []
    inconsistent: list[str] = []
    undelivered: list[Undelivered] = []
    for row in rows("delivery_anomalies", _route_params()):
        consumer, event_id, event_type, order_id, poison, outbox_status, published, inbox, n = row[
            :9
        ]
        where = f"{consumer} {event_type} {event_id} (order {order_id})"
        if n > 1:
            duplicates.append(f"{where}: effect committed {n} times")
        elif poison and inbox == "processed":
            inconsistent.append(f"{where}: poison order processed")
        elif n == 1 and inbox != "processed":
            inconsistent.append(f"{where}: effect committed, inbox {inbox}")
        elif n == 0 and inbox == "processed":
            inconsistent.append(f"{where}: inbox processed, no effect")
        elif inbox != "dead":  # dead: judged with the dead letters
            undelivered.append(
                Undelivered(
                    consumer, event_id, event_type, order_id, outbox_status, published, inbox,
                    ordering_key=row[9], seq=int(row[10]),
                )
            )  # fmt: skip
    result.undelivered = mark_held(undelivered)
    result.add("duplicate-effect", duplicates, "a consumer's work committed more than once")
    result.add("inconsistent", inconsistent, "an effect and its inbox record disagree")
    result.add(
        "lost",
        [
            f"{u.consumer} {u.event_type} {u.event_id} (order {u.order_id}): {u.stage}"
            for u in result.undelivered
        ],
        "(event, consumer) pairs never processed",
    )
    unknown = int(rows("unknown_effects", _route_params())[0][0])
    result.add(
        "inconsistent",
        [f"{unknown} effect rows of events not routed to their consumer"] * bool(unknown),
        "effects of unknown events",
    )


def mark_held(undelivered: list[Undelivered]) -> list[Undelivered]:
    """Ordered consumers wait for a key's earlier events: after the first undelivered event
    of a key, the key's later ones are held behind it (they may be lost as well)."""
    ordered = set(ORDERED_CONSUMERS)
    first: set[tuple[str, str]] = set()
    marked = []
    for item in sorted(undelivered, key=lambda u: u.seq):
        key = (item.consumer, item.ordering_key or "")
        held = item.consumer in ordered and item.ordering_key is not None and key in first
        if item.consumer in ordered and item.ordering_key is not None:
            first.add(key)
        marked.append(replace(item, held=True) if held else item)
    return marked


def _check_order(result: CheckResult, rows: Any) -> None:
    """Per ordered consumer and key: sequence order (and, for orders, the producer's order)."""
    broken: list[str] = []
    last: dict[tuple[str, str], tuple[int, int]] = {}
    for consumer, key, position, seq, n, event_id in rows(
        "key_positions", {"consumers": list(ORDERED_CONSUMERS)}
    ):
        previous = last.get((consumer, key))
        last[(consumer, key)] = (seq, n)
        if previous is None:
            continue
        if seq <= previous[0]:
            broken.append(
                f"{consumer} key {key}: seq {seq} (event {event_id}) handled at position "
                f"{position}, after seq {previous[0]}"
            )
        elif consumer == LEDGER and n <= previous[1]:
            broken.append(
                f"{consumer} key {key}: order #{n} handled at position {position}, "
                f"after order #{previous[1]}"
            )
    result.add("order", broken, "an ordered consumer handled a key out of order")


def _check_dead_letters(result: CheckResult, rows: Any, poison_events: list[str]) -> None:
    expected = {(consumer, event) for event in poison_events for consumer in POISON_CONSUMERS}
    found: set[tuple[str, str]] = set()
    unexpected: list[str] = []
    for stage, consumer, event_id, event_type, reason, error_class, poison in rows("dead_letters"):
        pair = (consumer, event_id)
        if stage == "consume" and poison and pair in expected and pair not in found:
            found.add(pair)
            continue
        unexpected.append(
            f"{stage} {consumer or '-'} {event_type or '-'} {event_id or '-'}: "
            f"{error_class}: {reason}"
        )
    missing = sorted(expected - found)
    result.dead_letters = {
        "expected": len(expected),
        "found": len(found),
        "unexpected": len(unexpected),
    }
    result.add("dead-letter", unexpected, "dead letters that are not an injected poison order's")
    result.add(
        "dead-letter",
        [
            f"{consumer} {event_id}: poison order not dead-lettered"
            for consumer, event_id in missing
        ],
        "a poison order was not dead-lettered",
    )


def _check_ledger(result: CheckResult, ledger: dict[str, Any], orders: dict[str, bool]) -> None:
    """Exactly one charge and one e-mail per payable order, and none for anything else."""
    payable = {order_id for order_id, poison in orders.items() if not poison}
    for path, kind, what in (
        (CHARGES_PATH, "charges", "charge"),
        (EMAILS_PATH, "emails", "e-mail"),
    ):
        done: Counter[str] = Counter(
            str((record.get("request") or {}).get("order_id"))
            for record in ledger.get("charges", [])
            if record.get("path") == path
        )
        twice = [
            f"order {o}: {n} {kind}" for o, n in sorted(done.items()) if n > 1 and o in payable
        ]
        missing = sorted(payable - set(done))
        unknown = sorted(set(done) - payable)
        result.api[kind] = {
            "total": sum(done.values()),
            "orders": len(payable),
            "twice": len(twice),
            "missing": len(missing),
            "unknown": len(unknown),
        }
        result.add(kind, twice, f"an order got more than one {what}")
        result.add(
            kind, [f"order {o}: no {what}" for o in missing], f"a payable order got no {what}"
        )
        result.add(
            kind, [f"{what} for order {o}" for o in unknown], f"a {what} for no payable order"
        )
        if path == CHARGES_PATH:
            unpaid = {u.order_id for u in result.undelivered if u.consumer == PAYMENTS}
            result.api["charged_without_payment_row"] = len(unpaid & set(done))
    outcomes: Counter[str] = Counter()
    for path_counts in (ledger.get("by_path") or {}).values():
        for outcome, count in path_counts.items():
            if outcome != "requests":
                outcomes[outcome] += int(count)
    result.api["requests"] = dict(sorted(outcomes.items()))
