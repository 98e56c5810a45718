"""The demo's summary: what happened, whether the guarantees held, and one order's trace.

Everything is read back from where it really landed — the outbox, inbox, attempts and
dead-letter tables, the business tables, the payment API's ledger, the workers'
Prometheus counters — never from the demo's own bookkeeping of what it hoped for.
"""

from __future__ import annotations

import math
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Engine

from pipeline.inbox.idempotency import idempotency_key
from pipeline.tools.demo.app import CONFIRMATION_STEP
from pipeline.tools.demo.sql import DemoQueries
from pipeline.tools.demo.workload import poison_order_id
from pipeline.tools.harness.payment_api import CHARGES_PATH, EMAILS_PATH
from pipeline.tools.ops.lineage import trace_url

CONSUMERS = ("payments", "inventory", "notifications")
EVENT_TYPES = ("order.placed", "payment.charged", "stock.reserved")


@dataclass
class RunFacts:
    """What the runner knows that the database does not."""

    run: str
    orders: int
    poison: bool
    placed: int
    duplicates_injected: dict[str, int]
    duplicates_absorbed: dict[str, int] | None  # None: not measured
    ledger: dict[str, Any]
    wall_seconds: float
    setup: dict[str, Any] = field(default_factory=dict)
    trace_ui_url: str | None = None  # PIPELINE_TRACE_UI_URL: "{trace_id}" is filled in
    endpoints: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    duplicates_wanted: bool = True  # False with --duplicates 0: nothing to absorb


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..1): a value that was really observed."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def build_summary(engine: Engine, queries: DemoQueries, facts: RunFacts) -> dict[str, Any]:
    run = {"run": facts.run}
    with engine.connect() as conn:

        def rows(name: str, params: dict[str, Any] = run) -> list[Any]:
            return list(conn.exec_driver_sql(queries.text(name), params).all())

        outbox = rows("outbox_counts")
        progress = {r[0]: (int(r[1]), int(r[2])) for r in rows("consumer_progress")}
        unfinished = int(rows("unfinished_inbox")[0][0])
        effects = {r[0]: {"rows": int(r[1]), "orders": int(r[2])} for r in rows("effects")}
        orders_by_status = {r[0]: int(r[1]) for r in rows("orders_by_status")}
        failures: dict[str, dict[str, int]] = {}
        for consumer, error_class, count in rows("failed_attempts"):
            failures.setdefault(consumer, {})[error_class] = int(count)
        dead = [
            {
                "stage": r[0],
                "consumer": r[1],
                "event_type": r[2],
                "event_id": r[3],
                "order_id": r[4],
                "reason": r[5],
                "error_class": r[6],
                "error": r[7],
                "attempts": int(r[8]),
            }
            for r in rows("dead_letters")
        ]
        latencies = rows("order_latencies")
        trace = _trace(conn, queries, latencies, facts)

    produced: Counter[str] = Counter()
    by_status: Counter[str] = Counter()
    for event_type, status, count in outbox:
        produced[event_type] += int(count)
        by_status[status] += int(count)
    seconds = [float(r[2]) for r in latencies]
    charges = [c for c in facts.ledger.get("charges", []) if c.get("path") == CHARGES_PATH]
    emails = [c for c in facts.ledger.get("charges", []) if c.get("path") == EMAILS_PATH]
    charged_orders = Counter(str(c["request"].get("order_id")) for c in charges)
    by_path = facts.ledger.get("by_path", {})
    processed = {c: progress.get(c, (0, 0))[0] for c in CONSUMERS}
    injected = facts.duplicates_injected
    absorbed = facts.duplicates_absorbed
    summary: dict[str, Any] = {
        "run": facts.run,
        "wall_seconds": round(facts.wall_seconds, 2),
        "setup": facts.setup,
        "orders": {
            "requested": facts.orders,
            "placed": facts.placed,
            "poison": 1 if facts.poison else 0,
            "confirmed": orders_by_status.get("confirmed", 0),
        },
        "events": {
            "produced": {t: produced.get(t, 0) for t in EVENT_TYPES},
            "produced_total": sum(produced.values()),
            "published": by_status.get("sent", 0),
            "unsent": sum(n for s, n in by_status.items() if s != "sent"),
        },
        "processed": processed,
        "effects": effects,
        "retries": failures,
        "duplicates": {
            "injected": dict(injected),
            "injected_total": sum(injected.values()),
            "absorbed": absorbed,
            "absorbed_total": sum(absorbed.values()) if absorbed is not None else None,
        },
        "charges": {
            "made": len(charges),
            "orders_charged": len(charged_orders),
            "orders": facts.orders,
            **_api_counts(by_path.get(CHARGES_PATH, {})),
        },
        "confirmations": {
            "sent": len(emails),
            "orders": len({str(c["request"].get("order_id")) for c in emails}),
            **_api_counts(by_path.get(EMAILS_PATH, {})),
        },
        "dead_letters": dead,
        "latency_seconds": {
            "p50": percentile(seconds, 0.50),
            "p99": percentile(seconds, 0.99),
            "max": max(seconds) if seconds else None,
            "orders": len(seconds),
            "measured": "order.placed written -> notifications handler claimed the order",
        },
        "trace": trace,
        "endpoints": facts.endpoints,
        "notes": facts.notes,
    }
    invariants = _invariants(summary, facts, charged_orders, unfinished)
    summary["invariants"] = invariants
    summary["failed_invariants"] = [name for name, ok in invariants.items() if ok is False]
    summary["ok"] = not summary["failed_invariants"]
    return summary


def _api_counts(counts: dict[str, int]) -> dict[str, int]:
    return {
        "api_requests": counts.get("requests", 0),
        "replayed": counts.get("replayed", 0),
        "conflicts": counts.get("conflict", 0),
        "mismatches": counts.get("mismatch", 0),
    }


def _invariants(
    summary: dict[str, Any], facts: RunFacts, charged: Counter[str], unfinished: int
) -> dict[str, bool | None]:
    n = facts.orders
    poison_id = poison_order_id(facts.run)
    charges = summary["charges"]
    dead = summary["dead_letters"]
    once = all(summary["processed"][c] == n for c in CONSUMERS) and all(
        summary["effects"].get(c, {}) == {"rows": n, "orders": n} for c in CONSUMERS
    )
    once = once and summary["confirmations"]["sent"] == summary["confirmations"]["orders"] == n
    once = once and summary["orders"]["confirmed"] == n
    poison: bool | None = None
    if facts.poison:
        poison = (
            len(dead) == 1
            and dead[0]["order_id"] == poison_id
            and dead[0]["consumer"] == "payments"
            and dead[0]["error_class"] == "InvalidOrder"
            and bool(dead[0]["reason"])
            and poison_id not in charged
        )
    injected = summary["duplicates"]["injected"]
    absorbed = summary["duplicates"]["absorbed"]
    duplicates: bool | None = None
    if absorbed is not None and facts.duplicates_wanted:
        duplicates = sum(injected.values()) > 0 and all(
            absorbed.get(c, 0) >= injected.get(c, 0) for c in CONSUMERS
        )
    return {
        "charges_equal_orders": charges["made"] == charges["orders_charged"] == n
        and all(count == 1 for count in charged.values()),
        "every_order_processed_once_per_stage": once,
        "poison_dead_lettered_with_reason": poison,
        "no_other_dead_letters": len(dead) == (1 if facts.poison else 0),
        "duplicates_absorbed": duplicates,
        "nothing_lost_or_pending": summary["events"]["unsent"] == 0
        and unfinished == 0
        and summary["events"]["produced_total"] == facts.placed + 2 * n,
    }


# -- the trace tree of one order -------------------------------------------------------------


def _pick_order(latencies: list[Any]) -> str | None:
    """The median-latency order among those that needed a retry (else among all)."""
    if not latencies:
        return None
    retried = [r for r in latencies if int(r[3]) > 0]
    pool = sorted(retried or latencies, key=lambda r: float(r[2]))
    return str(pool[len(pool) // 2][0])


def _trace(conn: Any, queries: DemoQueries, latencies: list[Any], facts: RunFacts) -> Any:
    root_id = _pick_order(latencies)
    if root_id is None:
        return None
    events = conn.exec_driver_sql(queries.text("lineage"), {"root": uuid.UUID(root_id)}).all()
    ids = [uuid.UUID(str(r[0])) for r in events]
    inbox = conn.exec_driver_sql(queries.text("lineage_inbox"), {"ids": ids}).all()
    attempts = conn.exec_driver_sql(queries.text("lineage_attempts"), {"ids": ids}).all()
    start: datetime = events[0][4]

    def ms(at: datetime | None) -> float | None:
        return None if at is None else round((at - start).total_seconds() * 1000, 1)

    trace_ids = {str(r[3]).split("-")[1] for r in events if r[3] and str(r[3]).count("-") == 3}
    outcomes = facts.ledger.get("outcomes_by_key", {})
    nodes: dict[str, dict[str, Any]] = {}
    for event_id, event_type, cause, _tp, created, published, status, _n in events:
        nodes[str(event_id)] = {
            "event_id": str(event_id),
            "event_type": event_type,
            "caused_by": cause,
            "created_ms": ms(created),
            "published_ms": ms(published),
            "status": status,
            "consumers": [],
        }
    for event_id, consumer, status, count, _received, processed in inbox:
        failures = [
            {"attempt": int(a[2]), "error_class": a[3], "at_ms": ms(a[4])}
            for a in attempts
            if str(a[0]) == str(event_id) and a[1] == consumer
        ]
        keys = [
            idempotency_key(consumer, uuid.UUID(str(event_id)), step)
            for step in (None, CONFIRMATION_STEP)
        ]
        nodes[str(event_id)]["consumers"].append(
            {
                "consumer": consumer,
                "status": status,
                "attempts": int(count),
                "failures": failures,
                "api_calls": [outcome for key in keys for outcome in outcomes.get(key, [])],
                "processed_ms": ms(processed) if status == "processed" else None,
                "follow_ups": [],
            }
        )
    for node in nodes.values():
        parent = nodes.get(str(node["caused_by"]))
        if parent is None or not parent["consumers"]:
            continue
        # The follow-up came from the consumer whose handler ran last before it was written.
        runs = [c for c in parent["consumers"] if c["processed_ms"] is not None]
        before = [c for c in runs if c["processed_ms"] <= node["created_ms"]] or runs
        owner = max(before, key=lambda c: c["processed_ms"]) if before else parent["consumers"][0]
        owner["follow_ups"].append(node)
    root = nodes[root_id]
    order = next((r[1] for r in latencies if str(r[0]) == root_id), None)
    trace_id = next(iter(trace_ids)) if len(trace_ids) == 1 else None
    return {
        "order_id": order,
        "trace_id": trace_id,
        "url": trace_url(facts.trace_ui_url, trace_id),
        "trace_ids": sorted(trace_ids),
        "single_trace": len(trace_ids) == 1,
        "root": root,
    }


# -- text ------------------------------------------------------------------------------------


def _ok(value: bool | None) -> str:
    return {True: "ok", False: "FAILED", None: "not checked"}[value]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def render_text(summary: dict[str, Any]) -> str:
    inv = summary["invariants"]
    orders = summary["orders"]
    events = summary["events"]
    lines = [
        f"pipeline demo: run {summary['run']}, {orders['requested']} orders"
        + (" + 1 poison order" if orders["poison"] else "")
        + f", {summary['wall_seconds']:.1f} s",
        "",
    ]
    for name, value in summary["setup"].items():
        lines.append(f"  {name:<15}{value}")
    produced = ", ".join(f"{t} {n}" for t, n in events["produced"].items())
    processed = ", ".join(f"{c} {n}" for c, n in summary["processed"].items())
    lines += [
        "",
        f"  {'events':<15}produced {events['produced_total']} ({produced})",
        f"  {'':<15}published {events['published']}, unsent {events['unsent']}",
        f"  {'processed':<15}{processed}",
        f"  {'effects':<15}"
        + ", ".join(
            f"{stage} {e['rows']} rows/{e['orders']} orders"
            for stage, e in summary["effects"].items()
        )
        + f"  [{_ok(inv['every_order_processed_once_per_stage'])}]",
    ]
    retries = summary["retries"]
    if retries:
        lines.append(
            f"  {'retries':<15}"
            + "; ".join(
                f"{c}: " + ", ".join(f"{n} {cls}" for cls, n in classes.items())
                for c, classes in retries.items()
            )
        )
    dup = summary["duplicates"]
    absorbed = "not measured" if dup["absorbed_total"] is None else str(dup["absorbed_total"])
    lines.append(
        f"  {'duplicates':<15}injected {dup['injected_total']} redeliveries, "
        f"absorbed by the inbox {absorbed}  [{_ok(inv['duplicates_absorbed'])}]"
    )
    charges = summary["charges"]
    lines.append(
        f"  {'charges':<15}{charges['made']} charges for {charges['orders']} orders "
        f"({charges['api_requests']} API requests, {charges['replayed']} answered with the "
        f"stored response)  [{_ok(inv['charges_equal_orders'])}]"
    )
    mails = summary["confirmations"]
    lines.append(
        f"  {'confirmations':<15}{mails['sent']} e-mails for {orders['confirmed']} confirmed "
        f"orders ({mails['api_requests']} API requests, {mails['replayed']} replayed)"
    )
    dead = summary["dead_letters"]
    lines.append(
        f"  {'dead letters':<15}{len(dead)}  [{_ok(inv['poison_dead_lettered_with_reason'])}]"
    )
    for letter in dead:
        lines.append(
            f"  {'':<15}{letter['consumer']} / {letter['event_type']} / order "
            f"{letter['order_id']}: {letter['reason']} after {letter['attempts']} attempt(s): "
            f"{letter['error']}"
        )
    lat = summary["latency_seconds"]
    lines.append(
        f"  {'latency':<15}p50 {_ms(lat['p50'])}, p99 {_ms(lat['p99'])}, max {_ms(lat['max'])}"
        f" over {lat['orders']} orders (order.placed written -> confirmation handler)"
    )
    lines.append(
        f"  {'nothing lost':<15}every event published and processed or dead-lettered"
        f"  [{_ok(inv['nothing_lost_or_pending'])}]"
    )
    if summary["trace"] is not None:
        lines += ["", *render_trace(summary["trace"])]
    if summary["endpoints"]:
        lines.append("")
        lines += [f"  {name:<15}{url}" for name, url in summary["endpoints"].items()]
    for note in summary["notes"]:
        lines.append(f"  note: {note}")
    lines.append("")
    if summary["ok"]:
        lines.append(
            "All invariants hold: charges equal orders, every order processed once, nothing lost."
        )
    else:
        lines.append("INVARIANTS FAILED: " + ", ".join(summary["failed_invariants"]))
    return "\n".join(lines)


def render_trace(trace: dict[str, Any]) -> list[str]:
    trace_id = trace["trace_id"] or ", ".join(trace["trace_ids"]) or "none"
    where = "one trace for the whole workflow" if trace["single_trace"] else "several traces"
    lines = [f"Trace of order {trace['order_id']} (trace id {trace_id}; {where}):"]
    if trace.get("url"):
        lines.append(f"  open it in the trace UI: {trace['url']}")
    rows: list[tuple[float | None, str]] = []
    _trace_rows(trace["root"], "", rows)
    for at, text in rows:
        stamp = "" if at is None else f"+{at:.1f} ms"
        lines.append(f"  {stamp:>11}  {text}")
    return lines


def _trace_rows(node: dict[str, Any], indent: str, rows: list[tuple[float | None, str]]) -> None:
    rows.append((node["created_ms"], f"{indent}{node['event_type']} {node['event_id']} written"))
    rows.append((node["published_ms"], f"{indent}|  published by the relay"))
    for consumer in node["consumers"]:
        for failure in consumer["failures"]:
            rows.append(
                (
                    failure["at_ms"],
                    f"{indent}+- {consumer['consumer']}: attempt {failure['attempt']} failed "
                    f"({failure['error_class']}), retried",
                )
            )
        calls = consumer["api_calls"]
        api = ""
        if calls:
            counts = Counter(calls)
            api = "; API calls with one Idempotency-Key: " + ", ".join(
                f"{n} {outcome}" for outcome, n in sorted(counts.items())
            )
        if consumer["status"] == "processed":
            rows.append(
                (
                    consumer["processed_ms"],
                    f"{indent}+- {consumer['consumer']}: handled (attempt "
                    f"{consumer['attempts']}){api}",
                )
            )
        else:
            rows.append((None, f"{indent}+- {consumer['consumer']}: {consumer['status']}"))
        for child in consumer["follow_ups"]:
            _trace_rows(child, indent + "   ", rows)
