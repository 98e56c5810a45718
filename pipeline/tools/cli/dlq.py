"""The ``pipeline dlq`` commands: list, show, replay (real or sandboxed), purge, audit.

Importing this module is cheap (click only): ``pipeline --help`` stays fast. The work is
done by ``pipeline.tools.ops`` (selection, replay, purge, audit) and, for the sandbox, by
``pipeline.inbox.sandbox``; this module composes them with the runtime (the registry of
consumers and the transport's publisher), which the admin layer may not import.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from pipeline.config import Settings, load_settings

if TYPE_CHECKING:
    import psycopg

    from pipeline.registry import Registry
    from pipeline.tools.ops.dlq.filters import DeadLetterFilter
    from pipeline.tools.ops.dlq.records import DeadLetter
    from pipeline.tools.ops.dlq.replay import ReplayStep

F = TypeVar("F", bound=Callable[..., Any])
LIST_LIMIT = 100
AUDIT_LIMIT = 50


def _settings(ctx: click.Context, apps: tuple[str, ...] = ()) -> Settings:
    settings: Settings = ctx.ensure_object(dict).setdefault("settings", load_settings())
    if apps:
        settings = settings.replace(app_modules=",".join([*settings.app_module_names(), *apps]))
    return settings


def filter_options(function: F) -> F:
    """The FILTERS shared by list, replay and purge."""
    options = [
        click.option("--stage", type=click.Choice(["publish", "consume"]), help="Only this stage."),
        click.option("--consumer", metavar="NAME", help="Only this consumer's dead letters."),
        click.option("--event-type", metavar="TYPE", help="Only events of this type."),
        click.option(
            "--error-class", metavar="CLASS", help="Only this error class (e.g. CardDeclined)."
        ),
        click.option(
            "--since",
            metavar="T",
            help="Dead-lettered at or after T: ISO-8601 (no offset: UTC) or a duration back "
            "from now such as 30m, 2h, 7d.",
        ),
        click.option("--until", metavar="T", help="Dead-lettered before T (as --since)."),
        click.option(
            "--id",
            "ids",
            type=int,
            multiple=True,
            metavar="DEAD_LETTER_ID",
            help="This dead letter (repeatable).",
        ),
        click.option(
            "--event-id",
            "event_ids",
            multiple=True,
            metavar="UUID",
            help="This event (repeatable).",
        ),
        click.option(
            "--caused-by",
            metavar="EVENT_ID",
            help="The dead letters of every event in the causation chain under EVENT_ID "
            "(the event and its follow-up events, at any depth).",
        ),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _scope(options: dict[str, Any], waiting: bool = False) -> DeadLetterFilter:
    from pipeline.tools.ops.dlq.filters import FilterError, build_filter

    try:
        return build_filter(
            stage=options["stage"],
            consumer=options["consumer"],
            event_type=options["event_type"],
            error_class=options["error_class"],
            since=options["since"],
            until=options["until"],
            ids=options["ids"],
            event_ids=options["event_ids"],
            caused_by=options["caused_by"],
            waiting=waiting,
        )
    except FilterError as exc:
        raise click.UsageError(str(exc)) from None


def _connect(settings: Settings) -> psycopg.Connection[Any]:
    from pipeline.db.connect import connect

    return connect(settings, autocommit=True)


def _require_known_ids(conn: psycopg.Connection[Any], schema: str, ids: tuple[int, ...]) -> None:
    """Unknown ``--id`` values are an error (a typo must not quietly match nothing)."""
    from pipeline.db.queries import queries_for
    from pipeline.errors import NotFoundError

    if not ids:
        return
    rows = conn.execute(queries_for(schema)["dlq_known_ids"], {"ids": list(ids)}).fetchall()
    unknown = sorted(set(ids) - {int(row[0]) for row in rows})
    if unknown:
        named = ", ".join(f"#{i}" for i in unknown)
        raise NotFoundError(f"no dead letter {named} in schema {schema!r}")


def _require_grants(
    conn: psycopg.Connection[Any],
    settings: Settings,
    command: str,
    *,
    replay: bool = False,
    purge: bool = False,
) -> None:
    """Refuse, naming every missing grant, before an action changes anything."""
    from pipeline.db.privileges import dlq_grants, require_privileges

    grants = dlq_grants(replay=replay, purge=purge)
    require_privileges(conn, settings.schema_name, grants, command)


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


def _reason(reason: str | None, dry_run: bool) -> str:
    """The operator's reason: required for anything that changes something (it is audited)."""
    if reason is None:
        if dry_run:
            return ""
        raise click.UsageError(
            "Missing option '--reason' (kept in the audit log; dry runs need none)"
        )
    if not reason.strip():
        raise click.UsageError("--reason must say why (it is kept in the audit log)")
    return reason.strip()


@click.group()
def dlq() -> None:
    """Inspect, replay and purge dead letters.

    Publish stage: events the relay gave up on. Consume stage: (consumer, event) pairs a
    handler gave up on, and messages no consumer could process. Replays and purges are
    recorded in the audit log (`pipeline dlq audit`); dry runs change nothing and are not.
    """


@dlq.command("list")
@filter_options
@click.option("--waiting", is_flag=True, help="Only dead letters not replayed yet.")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=LIST_LIMIT,
    show_default=True,
    help="List at most this many (oldest first).",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.pass_context
def list_command(
    ctx: click.Context, /, waiting: bool, limit: int, as_json: bool, **filters: Any
) -> None:
    """List dead letters, oldest first, with their stage, consumer, event and error."""
    from pipeline.tools.ops.dlq.records import select_dead_letters
    from pipeline.tools.ops.dlq.render import render_list

    settings = _settings(ctx)
    scope = _scope(filters, waiting)
    with _connect(settings) as conn:
        _require_known_ids(conn, settings.schema_name, scope.ids)
        letters = select_dead_letters(conn, settings.schema_name, scope, limit=limit)
    if as_json:
        _echo_json([letter.as_json() for letter in letters])
    else:
        click.echo("\n".join(render_list(letters, limit)))


@dlq.command("show")
@click.argument("dead_letter_id", type=click.IntRange(min=1))
@click.option(
    "--payload",
    is_flag=True,
    help="Include the event's data and the raw message (hidden by default).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def show_command(ctx: click.Context, dead_letter_id: int, payload: bool, as_json: bool) -> None:
    """Show one dead letter: its error, failed attempts, event and inbox state, envelope."""
    from pipeline.tools.ops.dlq.records import load_dead_letter
    from pipeline.tools.ops.dlq.render import render_detail

    settings = _settings(ctx)
    with _connect(settings) as conn:
        detail = load_dead_letter(conn, settings.schema_name, dead_letter_id)
    if as_json:
        _echo_json(detail.as_json(payload))
    else:
        click.echo("\n".join(render_detail(detail, payload)))


@dlq.command("replay")
@filter_options
@click.option("--dry-run", is_flag=True, help="Print what would happen; change nothing.")
@click.option(
    "--to-sandbox",
    is_flag=True,
    help="Run the consume-stage dead letters through their handlers in a transaction that "
    "is rolled back, and report what each handler would do (outcome, follow-up events, "
    "external calls, which are recorded and not made). Nothing is replayed.",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Replay at most this many.")
@click.option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="EVENTS_PER_SECOND",
    help="Pace the replay (default: as fast as it goes).",
)
@click.option("--reason", help="Why (kept in the audit log); required unless --dry-run.")
@click.option("--app", "apps", multiple=True, help="Module that registers consumers (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def replay_command(
    ctx: click.Context,
    /,
    dry_run: bool,
    to_sandbox: bool,
    limit: int | None,
    rate: float | None,
    reason: str | None,
    apps: tuple[str, ...],
    as_json: bool,
    **filters: Any,
) -> None:
    """Replay dead letters in their events' original order (per ordering key).

    A publish-stage dead letter's event goes back to pending and the relay publishes it.
    A consume-stage dead letter is delivered once more to its consumer alone (the events
    keep their ids: inboxes that processed them drop the copies). Dead letters already
    replayed are not replayed again; a replay that fails again is a new dead letter.
    Exits 1 when a dead letter could not be replayed. Dry runs are not audited.
    """
    from dataclasses import replace

    from pipeline.tools.ops.dlq.records import select_dead_letters
    from pipeline.tools.ops.dlq.replay import plan_replay

    why = _reason(reason, dry_run)
    settings = _settings(ctx, apps)
    scope = _scope(filters)
    if to_sandbox:
        if scope.stage == "publish":
            raise click.UsageError(
                "--to-sandbox runs consume-stage dead letters; --stage publish has none"
            )
        scope = replace(scope, stage="consume")
    registry = _registry(settings)
    with _connect(settings) as conn:
        schema = settings.schema_name
        if not dry_run:  # dry runs are read-only: an operator's role may run them
            command = "pipeline dlq replay" + (" --to-sandbox" if to_sandbox else "")
            _require_grants(conn, settings, command, replay=not to_sandbox)
        _require_known_ids(conn, schema, scope.ids)
        letters = select_dead_letters(
            conn, schema, replace(scope, waiting=True), limit=limit, in_event_order=True
        )
        steps = plan_replay(letters, registry)
        if to_sandbox:
            steps = _sandbox_plan(steps)
        steps += _already_replayed(conn, schema, scope, letters)
        if dry_run:
            _print_plan(steps, rate, to_sandbox, as_json)
            return
        parameters = {
            "filter": scope.as_json(),
            "limit": limit,
            "rate": rate,
        }
        if to_sandbox:
            ctx.exit(_run_sandbox(conn, settings, steps, why, parameters, as_json))
        ctx.exit(_run_replay(conn, settings, steps, why, parameters, rate, as_json))


def _sandbox_plan(steps: list[ReplayStep]) -> list[ReplayStep]:
    """The replay plan restated for the sandbox: which handler runs, or why none can."""
    from dataclasses import replace

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


def _registry(settings: Settings) -> Registry:
    """The consumers of PIPELINE_APP_MODULES (and --app): their queues and handlers."""
    from pipeline.registry import registry
    from pipeline.runtime import import_app_modules

    import_app_modules(settings.app_module_names())
    return registry


def _already_replayed(
    conn: psycopg.Connection[Any],
    schema: str,
    scope: DeadLetterFilter,
    selected: list[DeadLetter],
) -> list[ReplayStep]:
    """Dead letters named by --id that were replayed before: said so, not replayed again."""
    from dataclasses import replace

    from pipeline.tools.ops.dlq.records import select_dead_letters
    from pipeline.tools.ops.dlq.replay import ReplayStep

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


def _print_plan(steps: list[ReplayStep], rate: float | None, sandbox: bool, as_json: bool) -> None:
    from pipeline.tools.ops.dlq.render import render_plan

    acting = [s for s in steps if s.kind in ("requeue", "deliver")]
    events = sum(max(1, len(s.letter.event_ids)) for s in acting)
    if as_json:
        _echo_json(
            {
                "dry_run": True,
                "sandbox": sandbox,
                "would_replay": len(acting),
                "events": events,
                "rate": rate,
                "steps": [s.as_json() for s in steps],
            }
        )
        return
    lines = render_plan(steps, sandbox)
    if rate is not None and events:
        lines.append(f"paced at {rate:g} events/s: about {events / rate:.1f} s")
    click.echo("\n".join(lines))


def _run_replay(
    conn: psycopg.Connection[Any],
    settings: Settings,
    steps: list[ReplayStep],
    reason: str,
    parameters: dict[str, Any],
    rate: float | None,
    as_json: bool,
) -> int:
    from pipeline.runtime import build_runtime
    from pipeline.tools.ops.audit import begin_action
    from pipeline.tools.ops.dlq.rate import TokenBucket
    from pipeline.tools.ops.dlq.render import render_results
    from pipeline.tools.ops.dlq.replay import Replayer, StepResult, require_routes

    require_routes(steps)
    runtime = None
    if any(step.kind == "deliver" for step in steps):
        runtime = build_runtime(settings, set_global_broker=False)
    try:
        audit_id = begin_action(conn, settings.schema_name, "dlq.replay", reason, parameters)
        replayer = Replayer(
            conn,
            settings.schema_name,
            runtime.publisher if runtime is not None else None,
            audit_id,
            TokenBucket(rate),
        )

        def progress(result: StepResult) -> None:
            if not as_json:
                click.echo("\n".join(render_results([result], audit_id)[:-1]))

        results = replayer.run(steps, progress)
    finally:
        if runtime is not None:
            runtime.close()
    if as_json:
        _echo_json(
            {
                "dry_run": False,
                "audit_id": audit_id,
                "replayed": sum(r.outcome == "replayed" for r in results),
                "skipped": sum(r.outcome == "skipped" for r in results),
                "failed": sum(r.outcome == "failed" for r in results),
                "results": [r.as_json() for r in results],
            }
        )
    else:
        click.echo(render_results(results, audit_id)[-1])
    return 1 if any(r.outcome == "failed" for r in results) else 0


def _run_sandbox(
    conn: psycopg.Connection[Any],
    settings: Settings,
    steps: list[ReplayStep],
    reason: str,
    parameters: dict[str, Any],
    as_json: bool,
) -> int:
    from pipeline.db.connect import make_engine
    from pipeline.errors import ConfigurationError
    from pipeline.inbox.sandbox import SandboxOutcome, run_in_sandbox
    from pipeline.runtime import event_source
    from pipeline.tools.ops.audit import begin_action, count_affected
    from pipeline.tools.ops.dlq.events import load_events
    from pipeline.tools.ops.dlq.rate import TokenBucket
    from pipeline.tools.ops.dlq.render import render_sandbox

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
    if as_json:
        _echo_json({"sandbox": True, "dry_run": False, "audit_id": audit_id, "runs": runs})
    else:
        click.echo("\n".join(render_sandbox(runs, audit_id)))
    return 0


@dlq.command("purge")
@filter_options
@click.option("--all", "purge_all", is_flag=True, help="Every dead letter (instead of filters).")
@click.option("--waiting", is_flag=True, help="Only dead letters not replayed yet.")
@click.option("--dry-run", is_flag=True, help="Print what would be deleted; delete nothing.")
@click.option("--reason", help="Why (kept in the audit log); required unless --dry-run.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def purge_command(
    ctx: click.Context,
    /,
    purge_all: bool,
    waiting: bool,
    dry_run: bool,
    reason: str | None,
    as_json: bool,
    **filters: Any,
) -> None:
    """Delete dead letters in an explicit scope (filters, or --all).

    Only the dead-letter records go: the event's outbox row and the consumer's inbox
    row stay dead, so nothing runs again. Dry runs are not audited.
    """
    from pipeline.tools.ops.audit import begin_action
    from pipeline.tools.ops.dlq.purge import purge
    from pipeline.tools.ops.dlq.records import select_dead_letters
    from pipeline.tools.ops.dlq.render import render_list

    why = _reason(reason, dry_run)
    settings = _settings(ctx)
    scope = _scope(filters, waiting)
    if purge_all and scope.scoped:
        raise click.UsageError("--all purges every dead letter: give filters or --all, not both")
    if not purge_all and not scope.scoped:
        raise click.UsageError(
            "refusing to purge without a scope: give a filter (--stage, --consumer, "
            "--event-type, --error-class, --since, --until, --id, --event-id, --caused-by, "
            "--waiting) or --all"
        )
    schema = settings.schema_name
    with _connect(settings) as conn:
        if not dry_run:
            _require_grants(conn, settings, "pipeline dlq purge", purge=True)
        _require_known_ids(conn, schema, scope.ids)
        letters = select_dead_letters(conn, schema, scope)
        ids = [letter.id for letter in letters]
        if dry_run:
            if as_json:
                _echo_json(
                    {
                        "dry_run": True,
                        "would_delete": len(ids),
                        "dead_letters": [letter.as_json() for letter in letters],
                    }
                )
            else:
                lines = render_list(letters, None)[:-1] if letters else []
                lines.append(
                    f"dry run: {len(ids)} dead letter(s) would be deleted (their outbox and "
                    "inbox rows stay dead); nothing changed"
                )
                click.echo("\n".join(lines))
            return
        parameters = {"filter": {"all": True} if purge_all else scope.as_json()}
        audit_id = begin_action(conn, schema, "dlq.purge", why, parameters)
        deleted = purge(conn, schema, ids, audit_id)
    if as_json:
        _echo_json({"dry_run": False, "audit_id": audit_id, "deleted": deleted})
    else:
        click.echo(f"purged {len(deleted)} dead letter(s) (audit record #{audit_id})")


@dlq.command("audit")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=AUDIT_LIMIT,
    show_default=True,
    help="Show the latest this many actions.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.pass_context
def audit_command(ctx: click.Context, limit: int, as_json: bool) -> None:
    """List operator actions, latest first: when, who, what, why, which scope, how many."""
    from pipeline.tools.ops.audit import list_actions, render_actions

    settings = _settings(ctx)
    with _connect(settings) as conn:
        records = list_actions(conn, settings.schema_name, limit)
    if as_json:
        _echo_json([record.as_json() for record in records])
    else:
        click.echo("\n".join(render_actions(records)))
