"""A replay from the operator's request to its audit record: select, plan, then run it
for real, in the sandbox, or not at all (a dry run).

:mod:`pipeline.tools.ops.dlq.replay` plans and replays single dead letters; this module
picks them (waiting dead letters in their events' order, and those named by id that were
replayed before), checks grants and routes, records the action in the audit log and
returns what happened. It prints nothing: ``pipeline dlq replay`` renders the result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import psycopg

from pipeline.config import Settings
from pipeline.tools.ops.dlq.access import open_connection, require_grants, require_known_ids
from pipeline.tools.ops.dlq.filters import DeadLetterFilter
from pipeline.tools.ops.dlq.records import DeadLetter, select_dead_letters
from pipeline.tools.ops.dlq.replay import ReplayStep, StepResult, plan_replay
from pipeline.tools.ops.dlq.sandbox import SandboxReport, run_sandbox, sandbox_plan

SANDBOX_NEEDS_CONSUME_STAGE = (
    "--to-sandbox runs consume-stage dead letters; --stage publish has none"
)


@dataclass(frozen=True)
class ReplayRequest:
    """What the operator asked for: which dead letters, how, how fast, and why."""

    scope: DeadLetterFilter
    reason: str = ""
    """Kept in the audit log; a dry run needs none."""
    limit: int | None = None
    rate: float | None = None
    """Events per second; None: as fast as it goes."""
    dry_run: bool = False
    sandbox: bool = False

    def __post_init__(self) -> None:
        if self.sandbox:
            if self.scope.stage == "publish":
                raise ValueError(SANDBOX_NEEDS_CONSUME_STAGE)
            object.__setattr__(self, "scope", replace(self.scope, stage="consume"))

    @property
    def command(self) -> str:
        return "pipeline dlq replay" + (" --to-sandbox" if self.sandbox else "")

    def audit_parameters(self) -> dict[str, Any]:
        return {"filter": self.scope.as_json(), "limit": self.limit, "rate": self.rate}


@dataclass
class ReplayPlan:
    """One step per selected dead letter: what a replay does to it, or why it does not."""

    steps: list[ReplayStep]
    rate: float | None
    sandbox: bool

    @property
    def acting(self) -> list[ReplayStep]:
        return [s for s in self.steps if s.kind in ("requeue", "deliver")]

    @property
    def events(self) -> int:
        """Events the acting steps carry (what the rate paces)."""
        return sum(max(1, len(s.letter.event_ids)) for s in self.acting)

    def as_json(self) -> dict[str, Any]:
        return {
            "dry_run": True,
            "sandbox": self.sandbox,
            "would_replay": len(self.acting),
            "events": self.events,
            "rate": self.rate,
            "steps": [s.as_json() for s in self.steps],
        }


@dataclass
class ReplayReport:
    """What a real replay did, step by step, under one audit record."""

    audit_id: int
    results: list[StepResult]

    def count(self, outcome: str) -> int:
        return sum(r.outcome == outcome for r in self.results)

    @property
    def failed(self) -> bool:
        return self.count("failed") > 0

    def as_json(self) -> dict[str, Any]:
        return {
            "dry_run": False,
            "audit_id": self.audit_id,
            "replayed": self.count("replayed"),
            "skipped": self.count("skipped"),
            "failed": self.count("failed"),
            "results": [r.as_json() for r in self.results],
        }


@dataclass
class ReplayOutcome:
    """The plan, and what running it did (a report, a sandbox report, or neither: dry run)."""

    plan: ReplayPlan
    report: ReplayReport | None = None
    sandbox: SandboxReport | None = None

    @property
    def failed(self) -> bool:
        """A dead letter could not be replayed, or a handler failed in the sandbox."""
        if self.sandbox is not None:
            return self.sandbox.failed
        return self.report is not None and self.report.failed


def replay_dead_letters(
    settings: Settings,
    request: ReplayRequest,
    progress: Callable[[StepResult], None] | None = None,
) -> ReplayOutcome:
    """Plan the request and, unless it is a dry run, carry it out and audit it.

    ``progress`` sees each step's result as it happens (a real replay only). Raises
    :class:`~pipeline.errors.PipelineError` subclasses: a missing grant or an unknown id
    before anything changes, a consumer without a route, a broker that went down.
    """
    from pipeline.tools.ops.consumers import load_registry

    registry = load_registry(settings)
    schema = settings.schema_name
    with open_connection(settings) as conn:
        if not request.dry_run:  # dry runs are read-only: an operator's role may run them
            require_grants(conn, settings, request.command, replay=not request.sandbox)
        require_known_ids(conn, schema, request.scope.ids)
        letters = select_dead_letters(
            conn,
            schema,
            replace(request.scope, waiting=True),
            limit=request.limit,
            in_event_order=True,
        )
        steps = plan_replay(letters, registry)
        if request.sandbox:
            steps = sandbox_plan(steps)
        steps += _already_replayed(conn, schema, request.scope, letters)
        plan = ReplayPlan(steps, request.rate, request.sandbox)
        if request.dry_run:
            return ReplayOutcome(plan)
        if request.sandbox:
            return ReplayOutcome(
                plan,
                sandbox=run_sandbox(
                    conn, settings, steps, request.reason, request.audit_parameters()
                ),
            )
        return ReplayOutcome(plan, report=_run_replay(conn, settings, plan, request, progress))


def _already_replayed(
    conn: psycopg.Connection[Any],
    schema: str,
    scope: DeadLetterFilter,
    selected: list[DeadLetter],
) -> list[ReplayStep]:
    """Dead letters named by id that were replayed before: said so, not replayed again."""
    missing = tuple(sorted(set(scope.ids) - {letter.id for letter in selected}))
    if not missing:
        return []
    earlier = select_dead_letters(conn, schema, replace(scope, ids=missing, waiting=False))
    return [
        ReplayStep(
            letter,
            "skip",
            f"already replayed at {letter.replayed_at.isoformat(timespec='seconds')}"
            " (a replay that failed again is a new dead letter)",
        )
        for letter in earlier
        if letter.replayed_at is not None
    ]


def _run_replay(
    conn: psycopg.Connection[Any],
    settings: Settings,
    plan: ReplayPlan,
    request: ReplayRequest,
    progress: Callable[[StepResult], None] | None,
) -> ReplayReport:
    from pipeline.runtime import build_runtime
    from pipeline.tools.ops.audit import begin_action
    from pipeline.tools.ops.dlq.rate import TokenBucket
    from pipeline.tools.ops.dlq.replay import Replayer, require_routes

    require_routes(plan.steps)
    runtime = None
    if any(step.kind == "deliver" for step in plan.steps):
        runtime = build_runtime(settings, set_global_broker=False)
    try:
        audit_id = begin_action(
            conn, settings.schema_name, "dlq.replay", request.reason, request.audit_parameters()
        )
        replayer = Replayer(
            conn,
            settings.schema_name,
            runtime.publisher if runtime is not None else None,
            audit_id,
            TokenBucket(request.rate),
        )
        results = replayer.run(plan.steps, progress or (lambda _: None))
    finally:
        if runtime is not None:
            runtime.close()
    return ReplayReport(audit_id, results)
