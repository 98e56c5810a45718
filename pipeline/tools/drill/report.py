"""The drill's report: faults by kind, events, duplicates, re-deliveries, recovery, violations.

Losses are also grouped by their *probable cause*: the fault in progress when the event
was published, else the first fault after it (an event is normally processed within
milliseconds of its publication, so the next fault is what caught it). The grouping is a
reading aid, not a proof; a drill run with one ``--fault-kinds`` kind attributes exactly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.tools.drill.check import CheckResult, Undelivered
from pipeline.tools.drill.faults import Fault
from pipeline.tools.drill.members import Exit
from pipeline.tools.drill.workflow import CONSUMERS
from pipeline.tools.harness.outcomes import multiprocess_duplicates


@dataclass
class RunFacts:
    """What the runner knows that the database does not."""

    run: str
    seed: int
    options: dict[str, Any]
    setup: dict[str, str]
    started: float  # wall clock of the start of production
    faults: list[Fault]
    exits: list[Exit]
    recovery_from: float | None  # wall clock: the last fault's end (or the last order's)
    recovery_after: str  # "the last fault" or "the last order", whichever came later
    recovered_at: float | None  # wall clock at which the backlog was back to zero
    recovery_timeout: float
    clock_offset: float  # database clock minus this machine's clock, seconds
    duplicates_absorbed: dict[str, int] | None
    wall_seconds: float
    production_seconds: float | None = None  # first order to last commit; None: unfinished
    notes: list[str] = field(default_factory=list)


def duplicates_from_metrics(directories: list[Path]) -> dict[str, int] | None:
    """Duplicates absorbed per consumer, summed over every worker incarnation's metric files."""
    return multiprocess_duplicates(directories, CONSUMERS)


def probable_cause(lost: Undelivered, faults: list[Fault], clock_offset: float) -> str:
    """The fault in progress at the event's publication, else the next one (see module doc)."""
    if lost.published_at is None:
        return "not published"
    published = lost.published_at - clock_offset
    for fault in faults:
        if fault.started is None or fault.ended is None:
            continue
        if fault.started <= published <= fault.ended or fault.started > published:
            return fault.kind
    return "after the last fault"


def build_report(facts: RunFacts, check: CheckResult) -> dict[str, Any]:
    violations = [v.as_json() for v in check.violations]
    recovery: dict[str, Any] = {
        "timeout_seconds": facts.recovery_timeout,
        "seconds": None,
        "after": facts.recovery_after,
    }
    if facts.recovered_at is not None and facts.recovery_from is not None:
        recovery["seconds"] = round(max(0.0, facts.recovered_at - facts.recovery_from), 2)
    else:
        violations.append(
            {
                "kind": "recovery",
                "count": 1,
                "message": f"the backlog was not back to zero within {facts.recovery_timeout:g} s "
                f"of {facts.recovery_after}",
                "examples": [],
            }
        )
    faults = sorted(facts.faults, key=lambda f: f.started or 0.0)
    violations += [
        {"kind": f.kind, "count": 1, "message": f.violation, "examples": [f.target]}
        for f in faults
        if f.violation
    ]
    by_kind = Counter(f.kind for f in faults)
    causes: dict[str, Counter[str]] = {}
    stages: Counter[str] = Counter()
    held: Counter[str] = Counter()
    for lost in check.undelivered:
        stages[lost.stage] += 1
        if lost.held:
            held[lost.consumer] += 1
            continue
        cause = probable_cause(lost, faults, facts.clock_offset)
        causes.setdefault(cause, Counter())[lost.consumer] += 1
    return {
        "ok": not violations,
        "run": facts.run,
        "seed": facts.seed,
        "options": facts.options,
        "setup": facts.setup,
        "faults": {
            "total": len(faults),
            "by_kind": dict(sorted(by_kind.items())),
            "timeline": [
                {**f.as_json(), "at": round((f.started or facts.started) - facts.started, 2)}
                for f in faults
            ],
        },
        "events": {
            "orders": check.orders,
            "poison": check.poison,
            "outbox": check.outbox,
            "deliveries": check.deliveries,
            "ids_out_of_sequence_order": check.ids_out_of_order,
        },
        "duplicates_absorbed": facts.duplicates_absorbed,
        "redeliveries": check.redeliveries,
        "api": check.api,
        "dead_letters": check.dead_letters,
        "failed_attempts": check.failed_attempts,
        "recovery": recovery,
        "losses": {
            "total": len(check.undelivered),
            "by_stage": dict(sorted(stages.items())),
            "held_behind_earlier_of_their_key": dict(sorted(held.items())),
            "by_probable_cause": {k: dict(sorted(v.items())) for k, v in sorted(causes.items())},
        },
        "process_exits": [
            {
                "member": e.member,
                "code": e.code,
                "at": round(e.at - facts.started, 2),
                "log_tail": e.log_tail,
            }
            for e in facts.exits
        ],
        "notes": facts.notes,
        "wall_seconds": round(facts.wall_seconds, 1),
        "production_seconds": (
            round(facts.production_seconds, 1) if facts.production_seconds is not None else None
        ),
        "violations": violations,
    }


def exit_code(report: dict[str, Any]) -> int:
    """The drill's exit status: 0 when every guarantee held, 1 on any violation."""
    return 0 if report["ok"] and not report["violations"] else 1


def _n(value: int) -> str:
    return f"{value:,}"


def render_text(report: dict[str, Any]) -> str:
    """The report for a terminal: a verdict, then faults, events, recovery, losses, violations."""
    lines: list[str] = []
    for section in (_head, _faults, _events, _api, _recovery, _losses, _violations):
        lines += section(report)
    return "\n".join(lines)


def _head(report: dict[str, Any]) -> list[str]:
    violations = report["violations"]
    verdict = "PASSED" if report["ok"] else f"FAILED ({len(violations)} violations)"
    events = report["events"]
    produced = report.get("production_seconds")
    placed = events["orders"] + events["poison"]
    rate = f"{report['options']['rate']:g}/s asked"
    if produced:
        rate = f"{placed / produced:.0f}/s ({rate})"
    lines = [
        f"pipeline drill: {verdict}",
        f"run {report['run']}, seed {report['seed']}: {_n(events['orders'])} orders "
        f"(+{events['poison']} poison) at {rate}, "
        f"{report['faults']['total']} faults, {report['wall_seconds']:g} s",
    ]
    lines += [f"  {name}: {value}" for name, value in report["setup"].items()]
    return lines


def _faults(report: dict[str, Any]) -> list[str]:
    lines = ["", f"faults ({report['faults']['total']})"]
    lines += [f"  {kind:<28} {count:>3}" for kind, count in report["faults"]["by_kind"].items()]
    lines.append("  timeline:")
    for fault in report["faults"]["timeline"]:
        target = f" [{fault['target']}]" if fault["target"] else ""
        lines.append(f"    +{fault['at']:7.1f} s  {fault['kind']}{target}: {fault['detail']}")
    return lines


def _events(report: dict[str, Any]) -> list[str]:
    events = report["events"]
    lines = ["", "events"]
    for event_type, statuses in events["outbox"].items():
        counts = ", ".join(f"{_n(n)} {status}" for status, n in sorted(statuses.items()))
        lines.append(f"  {event_type:<16} {counts}")
    lines.append(f"  {'consumer':<22}{'expected':>10}{'processed':>11}{'dead':>6}")
    for consumer, counts in sorted(events["deliveries"].items()):
        lines.append(
            f"  {consumer:<22}{_n(counts['expected']):>10}{_n(counts['processed']):>11}"
            f"{counts['dead']:>6}"
        )
    skew = events["ids_out_of_sequence_order"]
    lines.append(
        f"  UUIDv7 ids out of sequence order: {skew.get('events', 0)} events in "
        f"{skew.get('keys', 0)} keys (skewed producer clocks)"
    )
    duplicates = report["duplicates_absorbed"]
    absorbed = "not measured"
    if duplicates is not None:
        per_consumer = ", ".join(f"{c} {n}" for c, n in duplicates.items())
        absorbed = f"{sum(duplicates.values())} ({per_consumer})"
    lines.append(f"  duplicates absorbed by the inbox: {absorbed}")
    redeliveries = report["redeliveries"]
    recorded = str(redeliveries) if redeliveries is not None else "not recorded by this schema"
    lines.append(f"  re-deliveries recorded in the inbox: {recorded}")
    failed = report["failed_attempts"]
    if failed:
        lines.append("  failed attempts recorded:")
        for attempt in failed:
            who = attempt["consumer"] or "-"
            lines.append(
                f"    {attempt['stage']:<8} {who:<22} {attempt['error_class']:<28} "
                f"{attempt['count']:>6}  e.g. {attempt['example']}"
            )
    dead = report["dead_letters"]
    lines.append(
        f"  dead letters: {dead.get('found', 0)} of {dead.get('expected', 0)} expected for "
        f"poison, {dead.get('unexpected', 0)} unexpected"
    )
    return lines


def _api(report: dict[str, Any]) -> list[str]:
    api = report["api"]
    lines = []
    for kind in ("charges", "emails"):
        if kind in api:
            a = api[kind]
            lines.append(
                f"  {kind}: {_n(a['total'])} for {_n(a['orders'])} payable orders "
                f"({a['twice']} orders twice, {a['missing']} missing, {a['unknown']} unknown)"
            )
    if api.get("charged_without_payment_row"):
        lines.append(
            f"  charged by the API but no payment recorded: {api['charged_without_payment_row']}"
        )
    if api.get("requests"):
        outcomes = ", ".join(f"{k} {_n(v)}" for k, v in api["requests"].items())
        lines.append(f"  API requests by outcome: {outcomes}")
    return lines


def _recovery(report: dict[str, Any]) -> list[str]:
    recovery = report["recovery"]
    if recovery["seconds"] is not None:
        return [
            "",
            f"recovery: backlog back to zero {recovery['seconds']:g} s after {recovery['after']} "
            f"(bound {recovery['timeout_seconds']:g} s)",
        ]
    return [
        "",
        f"recovery: backlog NOT back to zero within {recovery['timeout_seconds']:g} s "
        f"of {recovery['after']}",
    ]


def _losses(report: dict[str, Any]) -> list[str]:
    losses = report["losses"]
    lines: list[str] = []
    if losses["total"]:
        lines += ["", f"never processed: {_n(losses['total'])} (event, consumer) pairs"]
        lines += [f"  {stage:<28} {_n(n)}" for stage, n in losses["by_stage"].items()]
        held = losses["held_behind_earlier_of_their_key"]
        if held:
            detail = ", ".join(f"{c} {_n(n)}" for c, n in held.items())
            lines.append(
                f"  held behind an earlier undelivered event of their key: {_n(sum(held.values()))}"
                f" ({detail})"
            )
        lines.append(
            "  the others by probable cause (fault in progress at publication, else the next):"
        )
        for cause, per_consumer in losses["by_probable_cause"].items():
            detail = ", ".join(f"{c} {_n(n)}" for c, n in per_consumer.items())
            lines.append(f"    {cause:<28} {detail}")
    if report["process_exits"]:
        lines += ["", "processes that exited without the drill stopping them (restarted):"]
        for e in report["process_exits"]:
            lines.append(f"  +{e['at']:.1f} s {e['member']} exit {e['code']}: {e['log_tail']}")
    lines += [f"note: {note}" for note in report["notes"]]
    return lines


def _violations(report: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if report["violations"]:
        lines += ["", "violations"]
        for v in report["violations"]:
            lines.append(f"  {v['kind']}: {v['message']} ({_n(v['count'])})")
            lines += [f"      {example}" for example in v["examples"]]
    return lines
