"""Human-readable output of ``pipeline dlq`` (``--json`` prints the records instead)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pipeline.tools.ops.dlq.records import (
    DeadLetter,
    DeadLetterDetail,
    DeadLetterGroup,
    FailedAttempt,
)
from pipeline.tools.ops.dlq.replay import ReplayStep, StepResult

if TYPE_CHECKING:
    from pipeline.tools.ops.dlq.owed import OwedReport


def _when(value: datetime | None) -> str:
    return value.isoformat(timespec="seconds") if value is not None else "-"


def _subject(letter: DeadLetter) -> str:
    """Stage, consumer, event type and event id(s) of a dead letter, in one phrase."""
    parts = [letter.stage]
    if letter.consumer:
        parts.append(letter.consumer)
    parts.append(letter.event_type or "-")
    if letter.event_id is not None:
        parts.append(str(letter.event_id))
    elif letter.carried:
        parts.append(f"{len(letter.carried)} events in one message")
    else:
        parts.append("no event id")
    return "  ".join(parts)


def render_list(letters: Sequence[DeadLetter], limit: int | None) -> list[str]:
    if not letters:
        return ["no dead letters match"]
    lines = []
    for letter in letters:
        replayed = (
            f"  replayed {letter.replay_count}x, last {_when(letter.replayed_at)}"
            if letter.replayed_at
            else ""
        )
        lines.append(
            f"#{letter.id}  {_when(letter.created_at)}  {_subject(letter)}  "
            f"{letter.error_class}  attempts={letter.attempts}{replayed}"
        )
        lines.append(f"    {letter.reason}")
    waiting = sum(1 for letter in letters if letter.replayed_at is None)
    summary = f"{len(letters)} dead letter(s): {waiting} waiting, {len(letters) - waiting} replayed"
    if limit is not None and len(letters) >= limit:
        summary += f" (the first {limit}; --limit shows more)"
    return [*lines, summary]


def render_groups(groups: Sequence[DeadLetterGroup], limit: int | None) -> list[str]:
    """A table of groups, the largest first; under each, its normalised message and a sample."""
    if not groups:
        return ["no dead letters match"]
    header = ("FINGERPRINT", "COUNT", "WAITING", "FIRST SEEN", "LAST SEEN", "STAGE", "CONSUMER")
    rows = [
        (
            g.fingerprint,
            str(g.count),
            str(g.waiting),
            _when(g.first_seen),
            _when(g.last_seen),
            g.stage,
            g.consumer or "-",
        )
        for g in groups
    ]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    numeric = {1, 2}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    lines = [line(header)]
    for group, row in zip(groups, rows, strict=True):
        lines.append(line(row))
        lines.append(f"    {group.event_type or '-'}  {group.error_class}: {group.message}")
        lines.append(f"    sample #{group.sample_id}: {_error_line(group.sample_error)}")
    total = sum(g.count for g in groups)
    summary = f"{len(groups)} group(s), {total} dead letter(s)"
    if limit is not None and len(groups) >= limit:
        summary += f" (the largest {limit}; --limit shows more)"
    return [*lines, summary, "act on one: pipeline dlq replay --group FINGERPRINT (dry run first)"]


def _error_line(error: str) -> str:
    first = error.splitlines()[0] if error else ""
    return first if len(first) <= 200 else first[:199] + "…"


def attempt_error(attempt: FailedAttempt) -> str:
    """An attempt's error as ``Class: message``, the class written once (the stored text
    usually starts with it already)."""
    if attempt.error.startswith(f"{attempt.error_class}:"):
        return attempt.error
    return f"{attempt.error_class}: {attempt.error}"


def render_detail(detail: DeadLetterDetail, with_payload: bool) -> list[str]:
    letter = detail.letter
    lines = [
        f"dead letter #{letter.id}  [{letter.stage}]",
        f"  event        {letter.event_id or '-'}  {letter.event_type or '-'}"
        + (f"  seq {letter.seq}" if letter.seq is not None else "")
        + (f"  key {letter.ordering_key}" if letter.ordering_key else ""),
    ]
    if letter.carried:
        lines.append(f"  carried      {', '.join(str(i) for i in letter.carried)}")
    if letter.consumer or letter.queue:
        lines.append(f"  consumer     {letter.consumer or '-'}  queue {letter.queue or '-'}")
    lines += [
        f"  reason       {letter.reason}",
        f"  error        {letter.error}",
        f"  attempts     {letter.attempts}",
        f"  created      {_when(letter.created_at)}",
        f"  replayed     {letter.replay_count}x"
        + (f", last {_when(letter.replayed_at)}" if letter.replayed_at else ""),
        f"  outbox row   {letter.outbox_status or 'gone'}",
    ]
    if letter.stage == "consume" and letter.event_id is not None:
        lines.append(f"  inbox row    {letter.inbox_status or 'none'}")
    for attempt in detail.history:
        lines.append(
            f"  attempt {attempt.attempt:<4} {_when(attempt.at)}  {attempt_error(attempt)}"
        )
    envelope = detail.envelope_shown(with_payload)
    if envelope is not None:
        lines.append(f"  envelope     {json.dumps(envelope, sort_keys=True)}")
    if detail.raw_message is not None:
        shown = detail.raw_message if with_payload else "<hidden: --payload shows it>"
        lines.append(f"  raw message  {len(detail.raw_message)} characters: {shown}")
    if letter.event_id is not None:
        lines.append(f"  lineage      pipeline trace {letter.event_id}")
    return lines


def render_plan(steps: Sequence[ReplayStep], sandbox: bool = False) -> list[str]:
    if not steps:
        return ["dry run: no dead letters match; nothing would be replayed"]
    lines = []
    for step in steps:
        verb = {
            "requeue": "would requeue",
            "deliver": "would run in the sandbox" if sandbox else "would deliver",
            "skip": "would skip",
            "unroutable": "cannot replay",
        }[step.kind]
        lines.append(f"#{step.letter.id}  {_subject(step.letter)}")
        lines.append(f"    {verb}: {step.detail}")
    acting = sum(1 for s in steps if s.kind in ("requeue", "deliver"))
    lines.append(
        f"dry run: {acting} of {len(steps)} dead letter(s) would be replayed; nothing changed"
    )
    return lines


def render_results(results: Sequence[StepResult], audit_id: int) -> list[str]:
    lines = [] if results else ["no dead letters match"]
    for result in results:
        lines.append(f"#{result.step.letter.id}  {_subject(result.step.letter)}")
        lines.append(f"    {result.outcome}: {result.detail}")
    counts = {
        o: sum(1 for r in results if r.outcome == o) for o in ("replayed", "skipped", "failed")
    }
    lines.append(
        f"replayed {counts['replayed']}, skipped {counts['skipped']}, failed {counts['failed']} "
        f"(audit record #{audit_id})"
    )
    return lines


def render_sandbox(runs: list[dict[str, Any]], audit_id: int) -> list[str]:
    """Per dead letter, each event's outcome, the events it would publish, the calls it
    would make (from the JSON-ready runs of ``pipeline dlq replay --to-sandbox``)."""
    lines: list[str] = []
    for run in runs:
        lines.append(
            f"#{run['id']}  {run['stage']}  {run['consumer'] or '-'}  {run['event_type'] or '-'}"
        )
        if run["outcome"] == "skipped":
            lines.append(f"    skipped: {run['detail']}")
            continue
        for result in run["results"]:
            if result["outcome"] == "ok":
                head = "ok"
            else:
                then = (
                    "the inbox would retry it" if result["retryable"] else "dead-lettered at once"
                )
                head = f"error: {result['error']} ({then})"
            lines.append(f"    {result['event_id']}: {head}")
            for published in result["published"]:
                lines.append(f"      would publish {published['type']} {published['id']}")
            for call in result["external_calls"]:
                lines.append(
                    f"      would call {call['method']} {call['url']} "
                    f"(Idempotency-Key {call['idempotency_key']}; not sent)"
                )
    ran = [r for r in runs if r["outcome"] != "skipped"]
    failing = sum(1 for r in ran if r["outcome"] == "error")
    lines.append(
        f"sandbox: {len(ran)} dead letter(s) run, {len(ran) - failing} ok, {failing} with an "
        f"error; everything rolled back, nothing replayed (audit record #{audit_id})"
    )
    return lines


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def render_owed(report: OwedReport, limit: int) -> list[str]:
    """Owed deliveries, oldest first, then one line per consumer."""
    if not report.consumers:
        return [f"no deliveries owed for {report.min_age:g}s or longer"]
    lines = []
    for row in report.deliveries:
        state = row.status if row.recorded else "not recorded yet"
        lines.append(
            f"{row.event_id}  {row.consumer}  {row.event_type}  age {_age(row.age)}  {state}"
            f"  attempts={row.attempts} redeliveries={row.redeliveries}"
        )
    listed = len(report.deliveries)
    total = sum(c.total for c in report.consumers)
    if listed < total:
        lines.append(f"(the oldest {listed} of {total}; --limit shows more)")
    for owed in report.consumers:
        if owed.registered is False:
            note = (
                "  NOT registered by the app modules: if it was removed, "
                f"pipeline dlq abandon --consumer {owed.consumer}"
            )
        elif owed.registered is None:
            note = "  (name the app modules, PIPELINE_APP_MODULES or --app, to check it exists)"
        else:
            note = ""
        lines.append(
            f"consumer {owed.consumer}: {owed.total} owed, oldest {_age(owed.oldest_age)}{note}"
        )
    return lines
