"""Replay in the sandbox: consume-stage dead letters run through their handlers in a
transaction that is rolled back (:mod:`pipeline.inbox.sandbox`), and the report of what
each handler would do: its outcome, the events it would publish, the external calls it
would make (recorded, not made). Nothing is replayed; the run is audited.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import psycopg

from pipeline.config import Settings
from pipeline.tools.ops.dlq.replay import ReplayStep


@dataclass
class SandboxReport:
    """Per dead letter, its step and each event's sandboxed outcome (JSON-ready runs)."""

    audit_id: int
    runs: list[dict[str, Any]]

    @property
    def failed(self) -> bool:
        """Whether a handler failed on one of the events (the command exits 1)."""
        return any(run["outcome"] == "error" for run in self.runs)

    def as_json(self) -> dict[str, Any]:
        return {"sandbox": True, "dry_run": False, "audit_id": self.audit_id, "runs": self.runs}


def sandbox_plan(steps: list[ReplayStep]) -> list[ReplayStep]:
    """The replay plan restated for the sandbox: which handler runs, or why none can."""
    from pipeline.inbox.consumer import ConsumerDefinition

    restated = []
    for planned in steps:
        step, consumer = planned, planned.letter.consumer
        if step.kind == "deliver" and step.subscription is not None:
            if isinstance(step.subscription.handler, ConsumerDefinition):
                count = len(step.letter.event_ids) - step.letter.carried_processed
                events = "the event" if count == 1 else f"{count} events"
                step = replace(
                    step,
                    detail=f"the handler of {consumer} runs on {events} in a transaction that "
                    "is rolled back; its external calls are recorded, not made",
                )
            else:
                step = replace(
                    step,
                    kind="unroutable",
                    detail=f"consumer {consumer!r} has no handler in this process: name the "
                    "module that registers it in PIPELINE_APP_MODULES (or --app)",
                )
        restated.append(step)
    return restated


def run_sandbox(
    conn: psycopg.Connection[Any],
    settings: Settings,
    steps: list[ReplayStep],
    reason: str,
    parameters: dict[str, Any],
) -> SandboxReport:
    """Run each step's handler on its events, rolled back; refuses if any cannot run."""
    from pipeline.db.connect import make_engine
    from pipeline.errors import ConfigurationError
    from pipeline.inbox.sandbox import SandboxOutcome, run_in_sandbox
    from pipeline.signing import event_source
    from pipeline.tools.ops.audit import begin_action, count_affected
    from pipeline.tools.ops.dlq.events import load_events
    from pipeline.tools.ops.dlq.rate import TokenBucket

    blocked = [step for step in steps if step.kind == "unroutable"]
    if blocked:  # a clear error before anything runs
        raise ConfigurationError(
            f"cannot run {len(blocked)} dead letter(s) in the sandbox: {blocked[0].detail}"
        )
    schema = settings.schema_name
    audit_id = begin_action(conn, schema, "dlq.replay.sandbox", reason, parameters)
    bucket = TokenBucket(parameters.get("rate"))
    engine = make_engine(settings, pool_size=1)
    runs: list[dict[str, Any]] = []
    try:
        for step in steps:
            entry: dict[str, Any] = step.as_json()
            if step.kind != "deliver" or step.subscription is None:
                entry.update(outcome="skipped", results=[])
                runs.append(entry)
                continue
            events = load_events(conn, schema, step.letter)
            bucket.acquire(max(1, len(events)))
            outcomes: list[SandboxOutcome] = [
                run_in_sandbox(engine, step.subscription, event, event_source(settings))
                for event in events
            ]
            entry.update(
                outcome="ok" if all(o.ok for o in outcomes) else "error",
                results=[o.as_json() for o in outcomes],
            )
            runs.append(entry)
            with conn.transaction():
                count_affected(conn, schema, audit_id, [step.letter.id])
    finally:
        engine.dispose()
    return SandboxReport(audit_id, runs)
