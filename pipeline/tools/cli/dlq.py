"""``pipeline dlq``: list, groups, show, replay (real or sandboxed), purge, audit, and the
deliveries owed to consumers (owed, abandon).

The work is done by :mod:`pipeline.tools.ops.dlq`, which returns what it did; these
commands parse the options, call it, render the result and set the exit code.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from pipeline.tools.cli.options import (
    MAX_ID,
    apps_option,
    dead_letter_filters,
    dry_run_option,
    json_option,
    limit_option,
    rate_option,
    reason_option,
    settings_of,
    waiting_option,
    yes_option,
)
from pipeline.tools.ops.text import printable, printable_lines

if TYPE_CHECKING:
    from pipeline.tools.ops.dlq.filters import DeadLetterFilter
    from pipeline.tools.ops.dlq.replay import StepResult
    from pipeline.tools.ops.dlq.replay_run import ReplayPlan

LIST_LIMIT = 100
GROUPS_LIMIT = 50
AUDIT_LIMIT = 50
GROUP_RATE = 50.0
"""Events per second a ``--group`` replay goes at unless ``--rate`` says otherwise: a
group is a backlog of one cause, sent to a consumer that has only just been fixed."""
GROUP_PURGE_RATE = 1000.0
"""Dead letters per second a ``--group`` purge deletes unless ``--rate`` says otherwise:
nothing is sent to a consumer, so the pace only spreads the deletes' writes."""


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
            group=options["group"],
        )
    except FilterError as exc:
        raise click.UsageError(str(exc)) from None


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
    handler gave up on, and messages no consumer could process. `groups` sorts them by
    cause; `--group FINGERPRINT` replays or purges one cause (a dry run unless --yes).
    Replays, purges and abandoned deliveries are recorded in the audit log (`pipeline dlq
    audit`); dry runs change nothing and are not.
    """


@dlq.command("list")
@dead_letter_filters()
@waiting_option()
@limit_option(LIST_LIMIT, "List at most this many (oldest first).")
@json_option("Print a JSON array.")
@click.pass_context
def list_command(
    ctx: click.Context, /, waiting: bool, limit: int, as_json: bool, **filters: Any
) -> None:
    """List dead letters, oldest first, with their stage, consumer, event and error."""
    from pipeline.tools.ops.dlq.access import list_dead_letters
    from pipeline.tools.ops.dlq.render import render_list

    settings = settings_of(ctx)
    letters = list_dead_letters(settings, _scope(filters, waiting), limit=limit)
    if as_json:
        _echo_json([letter.as_json() for letter in letters])
    else:
        click.echo(printable_lines(render_list(letters, limit)))


@dlq.command("groups")
@dead_letter_filters()
@waiting_option()
@limit_option(GROUPS_LIMIT, "Show at most this many groups (the largest first).")
@json_option("Print a JSON array.")
@click.pass_context
def groups_command(
    ctx: click.Context, /, waiting: bool, limit: int, as_json: bool, **filters: Any
) -> None:
    """Group dead letters by cause, the largest group first.

    A cause is a failure fingerprint: stage, consumer, event type, error class and the
    error message with numbers, UUIDs, hex ids and quoted values normalised away. Each
    group shows its count (and how many wait for a replay), when it was first and last
    seen, and a sample. Act on one with `replay --group` or `purge --group`.
    """
    from pipeline.tools.ops.dlq.access import group_dead_letters
    from pipeline.tools.ops.dlq.render import render_groups

    groups = group_dead_letters(settings_of(ctx), _scope(filters, waiting), limit=limit)
    if as_json:
        _echo_json([group.as_json() for group in groups])
    else:
        click.echo(printable_lines(render_groups(groups, limit)))


@dlq.command("show")
@click.argument("dead_letter_id", type=click.IntRange(min=1, max=MAX_ID))
@click.option(
    "--payload",
    is_flag=True,
    help="Include the event's data and the raw message (hidden by default).",
)
@json_option()
@click.pass_context
def show_command(ctx: click.Context, dead_letter_id: int, payload: bool, as_json: bool) -> None:
    """Show one dead letter: its error, failed attempts, event and inbox state, envelope."""
    from pipeline.tools.ops.dlq.access import show_dead_letter
    from pipeline.tools.ops.dlq.render import render_detail

    detail = show_dead_letter(settings_of(ctx), dead_letter_id)
    if as_json:
        _echo_json(detail.as_json(payload))
    else:
        click.echo(printable_lines(render_detail(detail, payload)))


@dlq.command("replay")
@dead_letter_filters()
@dry_run_option("Print what would happen; change nothing.")
@click.option(
    "--to-sandbox",
    is_flag=True,
    help="Run the consume-stage dead letters through their handlers in a transaction that "
    "is rolled back, and report what each handler would do (outcome, follow-up events, "
    "external calls, which are recorded and not made). Nothing is replayed.",
)
@limit_option(None, "Replay at most this many.")
@rate_option(
    None,
    f"Pace the replay (default: as fast as it goes; {GROUP_RATE:g} with --group).",
    metavar="EVENTS_PER_SECOND",
)
@yes_option("Replay the --group (without --yes, a --group replay is a dry run).")
@reason_option("Why (kept in the audit log); required unless it is a dry run.")
@apps_option()
@json_option()
@click.pass_context
def replay_command(
    ctx: click.Context,
    /,
    dry_run: bool,
    to_sandbox: bool,
    limit: int | None,
    rate: float | None,
    yes: bool,
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
    With --group, the replay is a dry run unless --yes (--to-sandbox needs none), paced at
    50 events/s unless --rate.
    Exits 1 when a dead letter could not be replayed, or (--to-sandbox) when a handler
    failed. Dry runs are not audited.
    """
    from pipeline.tools.ops.dlq.render import render_results, render_sandbox
    from pipeline.tools.ops.dlq.replay_run import ReplayRequest, replay_dead_letters

    grouped = filters["group"] is not None
    # a sandbox run is rolled back: trying a fix on a group needs no --yes
    dry_run = dry_run or (grouped and not yes and not to_sandbox)
    if grouped and rate is None:
        rate = GROUP_RATE
    why = _reason(reason, dry_run)
    settings = settings_of(ctx, apps)
    try:
        request = ReplayRequest(
            _scope(filters), why, limit=limit, rate=rate, dry_run=dry_run, sandbox=to_sandbox
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None

    def progress(result: StepResult) -> None:
        if not as_json:
            click.echo(printable_lines(render_results([result], 0)[:-1]))

    outcome = replay_dead_letters(settings, request, progress)
    if outcome.sandbox is not None:
        if as_json:
            _echo_json(outcome.sandbox.as_json())
        else:
            click.echo(
                printable_lines(render_sandbox(outcome.sandbox.runs, outcome.sandbox.audit_id))
            )
    elif outcome.report is not None:
        if as_json:
            _echo_json(outcome.report.as_json())
        else:
            click.echo(
                printable(render_results(outcome.report.results, outcome.report.audit_id)[-1])
            )
    else:
        _echo_plan(outcome.plan, as_json, grouped and not yes)
    ctx.exit(1 if outcome.failed else 0)


def _echo_plan(plan: ReplayPlan, as_json: bool, needs_yes: bool = False) -> None:
    from pipeline.tools.ops.dlq.render import render_plan

    if as_json:
        _echo_json(plan.as_json())
        return
    lines = render_plan(plan.steps, plan.sandbox)
    if plan.rate is not None and plan.events:
        lines.append(f"paced at {plan.rate:g} events/s: about {plan.events / plan.rate:.1f} s")
    if needs_yes and plan.acting:
        lines.append("to replay this group: the same command with --yes --reason WHY")
    click.echo(printable_lines(lines))


@dlq.command("purge")
@dead_letter_filters()
@click.option("--all", "purge_all", is_flag=True, help="Every dead letter (instead of filters).")
@waiting_option()
@dry_run_option("Print what would be deleted; delete nothing.")
@rate_option(
    None,
    "Pace the purge in dead letters per second (default: as fast as it goes; "
    f"{GROUP_PURGE_RATE:g} with --group).",
)
@yes_option("Purge the --group (without --yes, a --group purge is a dry run).")
@reason_option("Why (kept in the audit log); required unless it is a dry run.")
@json_option()
@click.pass_context
def purge_command(
    ctx: click.Context,
    /,
    purge_all: bool,
    waiting: bool,
    dry_run: bool,
    rate: float | None,
    yes: bool,
    reason: str | None,
    as_json: bool,
    **filters: Any,
) -> None:
    """Delete dead letters in an explicit scope (filters, or --all).

    Only the dead-letter records go: the event's outbox row and the consumer's inbox
    row stay dead, so nothing runs again. Letters go in event order, in batches, each
    counted in the audit record. With --group, the purge is a dry run unless --yes and
    paced at 1000 dead letters/s unless --rate. Dry runs are not audited.
    """
    from pipeline.tools.ops.dlq.purge import purge_dead_letters
    from pipeline.tools.ops.dlq.render import render_list

    grouped = filters["group"] is not None
    dry_run = dry_run or (grouped and not yes)
    if grouped and rate is None:
        rate = GROUP_PURGE_RATE
    why = _reason(reason, dry_run)
    settings = settings_of(ctx)
    scope = _scope(filters, waiting)
    if purge_all and scope.scoped:
        raise click.UsageError("--all purges every dead letter: give filters or --all, not both")
    if not purge_all and not scope.scoped:
        raise click.UsageError(
            "refusing to purge without a scope: give a filter (--stage, --consumer, "
            "--event-type, --error-class, --since, --until, --id, --event-id, --caused-by, "
            "--waiting, --group) or --all"
        )
    report = purge_dead_letters(
        settings, scope, purge_all=purge_all, dry_run=dry_run, reason=why, rate=rate
    )
    if as_json:
        _echo_json(report.as_json())
    elif dry_run:
        lines = render_list(report.letters, None)[:-1] if report.letters else []
        lines.append(
            f"dry run: {len(report.letters)} dead letter(s) would be deleted (their outbox and "
            "inbox rows stay dead); nothing changed"
        )
        if rate is not None and report.letters:
            lines.append(f"paced at {rate:g}/s: about {len(report.letters) / rate:.1f} s")
        click.echo(printable_lines(lines))
    else:
        click.echo(f"purged {len(report.deleted)} dead letter(s) (audit record #{report.audit_id})")


@dlq.command("owed")
@click.option("--consumer", metavar="NAME", help="Only this consumer's deliveries.")
@click.option(
    "--min-age",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="Owed at least this long (default: the redelivery horizon, "
    "PIPELINE_REDELIVERY_HORIZON_SECONDS, as the owed gauge counts them; 0: all in flight).",
)
@limit_option(LIST_LIMIT, "List at most this many (oldest first).")
@apps_option()
@json_option()
@click.pass_context
def owed_command(
    ctx: click.Context,
    consumer: str | None,
    min_age: float | None,
    limit: int,
    apps: tuple[str, ...],
    as_json: bool,
) -> None:
    """List deliveries owed to consumers, oldest first: event id, consumer, age.

    A delivery is owed while its consumer has recorded no outcome for the event; the
    relay's ledger sends it again. Per consumer: how many, the oldest, and whether the
    app modules (PIPELINE_APP_MODULES or --app) still register it; deliveries owed to a
    consumer that no longer exists can be abandoned (`pipeline dlq abandon`).
    """
    from pipeline.policy import redelivery_horizon
    from pipeline.tools.ops.dlq.owed import list_owed
    from pipeline.tools.ops.dlq.render import render_owed

    settings = settings_of(ctx, apps)
    age = redelivery_horizon(settings) if min_age is None else min_age
    report = list_owed(settings, consumer=consumer, min_age=age, limit=limit)
    if as_json:
        _echo_json(report.as_json())
    else:
        click.echo(printable_lines(render_owed(report, limit)))


@dlq.command("abandon")
@click.option("--consumer", metavar="NAME", required=True, help="The consumer that is gone.")
@yes_option("Abandon the deliveries (without --yes: a dry run that counts them).")
@click.option(
    "--force",
    is_flag=True,
    help="Even for a consumer the app modules register, or when no app modules are named.",
)
@reason_option("Why (kept in the audit log); required with --yes.")
@apps_option()
@json_option()
@click.pass_context
def abandon_command(
    ctx: click.Context,
    consumer: str,
    yes: bool,
    force: bool,
    reason: str | None,
    apps: tuple[str, ...],
    as_json: bool,
) -> None:
    """Abandon the deliveries owed to a consumer that no longer exists (removed or renamed).

    Its unfinished deliveries, and sent events the ledger has not recorded for it yet,
    are finished as dead for that consumer: nothing sends them again and the owed gauge
    drops. Other consumers are untouched; no dead letter is written. A dry run unless
    --yes; refused for a consumer the app modules (PIPELINE_APP_MODULES or --app) still
    register unless --force. Audited.
    """
    from pipeline.tools.ops.dlq.owed import abandon_deliveries

    why = _reason(reason, not yes)
    report = abandon_deliveries(
        settings_of(ctx, apps), consumer, dry_run=not yes, force=force, reason=why
    )
    if as_json:
        _echo_json(report.as_json())
    elif not yes:
        click.echo(
            f"dry run: {report.owed} deliveries owed to {consumer} would be abandoned; nothing "
            "changed\nto abandon them: the same command with --yes --reason WHY"
        )
    else:
        click.echo(
            f"abandoned {report.abandoned} deliveries owed to {consumer} "
            f"(audit record #{report.audit_id})"
        )


@dlq.command("audit")
@limit_option(AUDIT_LIMIT, "Show the latest this many actions.")
@json_option("Print a JSON array.")
@click.pass_context
def audit_command(ctx: click.Context, limit: int, as_json: bool) -> None:
    """List operator actions, latest first: when, who, what, why, which scope, how many."""
    from pipeline.tools.ops.audit import render_actions
    from pipeline.tools.ops.dlq.access import audit_log

    records = audit_log(settings_of(ctx), limit=limit)
    if as_json:
        _echo_json([record.as_json() for record in records])
    else:
        click.echo(printable_lines(render_actions(records)))


@dlq.command("unrouted")
@click.option(
    "--event-type", "event_types", multiple=True, help="Only events of this type (repeatable)."
)
@limit_option(LIST_LIMIT, "List at most this many (oldest first).")
@json_option("Print a JSON array.")
@click.pass_context
def unrouted_command(
    ctx: click.Context, event_types: tuple[str, ...], limit: int, as_json: bool
) -> None:
    """List events that were sent to no consumer (no registered consumer took their type).

    Nothing re-sends them by itself; once their consumers run, send them again with
    `pipeline dlq resend-unrouted`.
    """
    from pipeline.tools.ops.unrouted import list_unrouted, render_unrouted

    events = list_unrouted(settings_of(ctx), limit=limit, event_types=event_types)
    if as_json:
        _echo_json([event.as_json() for event in events])
    else:
        click.echo(printable_lines(render_unrouted(events, limit)))


@dlq.command("resend-unrouted")
@click.option(
    "--event-type", "event_types", multiple=True, help="Only events of this type (repeatable)."
)
@limit_option(None, "Send at most this many again (oldest first).")
@dry_run_option("Print what would be sent again; change nothing.")
@reason_option()
@apps_option()
@json_option()
@click.pass_context
def resend_unrouted_command(
    ctx: click.Context,
    event_types: tuple[str, ...],
    limit: int | None,
    dry_run: bool,
    reason: str | None,
    apps: tuple[str, ...],
    as_json: bool,
) -> None:
    """Send events that went to no consumer again, to the consumers that take them now.

    Each goes back to pending and the relay publishes it in its key's order. Only events
    whose type a consumer registered by PIPELINE_APP_MODULES / --app takes are sent;
    the others are listed and left alone. Audited; dry runs are not.
    """
    from pipeline.tools.ops.consumers import load_registry
    from pipeline.tools.ops.unrouted import render_resend, resend_unrouted

    why = _reason(reason, dry_run)
    settings = settings_of(ctx, apps)
    report = resend_unrouted(
        settings,
        load_registry(settings),
        event_types=event_types,
        limit=limit,
        dry_run=dry_run,
        reason=why,
    )
    if as_json:
        _echo_json(report.as_json())
    else:
        click.echo(printable_lines(render_resend(report)))
