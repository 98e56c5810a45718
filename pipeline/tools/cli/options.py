"""Option groups that several commands share, written once.

Each is a decorator (``@json_option()``) or a function that returns one, so that the
flags, their help and their checks stay the same wherever they appear. Importing this
module is cheap (click and the settings): ``pipeline --help`` stays fast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import click

from pipeline.config import Settings, load_settings

F = TypeVar("F", bound=Callable[..., Any])

# The largest whole number an option takes (a row id, a count): what Postgres's bigint
# holds; a larger one is refused as a usage error instead of overflowing in the driver.
MAX_ID = 2**63 - 1
MAX_COUNT = 2**31 - 1
MAX_SECONDS = 100 * 365 * 86400.0  # a timeout or an age given in seconds
MIN_RATE = 0.001  # events per second: one every ~17 minutes; slower paces are a mistake
MAX_RATE = 1_000_000.0


class FiniteFloatRange(click.FloatRange):
    """``click.FloatRange`` that refuses ``nan`` and ``inf`` (which compare false to bounds)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


class Pace(click.ParamType[float]):
    """Events per second, from ``MIN_RATE`` to ``MAX_RATE`` (and ``0`` when allowed)."""

    name = "float"

    def __init__(self, zero_allowed: bool) -> None:
        self.zero_allowed = zero_allowed

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = FiniteFloatRange().convert(value, param, ctx)
        if number == 0 and self.zero_allowed:
            return number
        if not MIN_RATE <= number <= MAX_RATE:
            lowest = "0 or " if self.zero_allowed else ""
            self.fail(
                f"{value!r} is not a pace from {lowest}{MIN_RATE:g} to {MAX_RATE:g} per second.",
                param,
                ctx,
            )
        return number


def settings_of(ctx: click.Context, apps: tuple[str, ...] = ()) -> Settings:
    """The PIPELINE_* settings (read once per invocation), plus any ``--app`` modules."""
    settings: Settings = ctx.ensure_object(dict).setdefault("settings", load_settings())
    if apps:
        settings = settings.replace(app_modules=",".join([*settings.app_module_names(), *apps]))
    return settings


def _stack(options: list[Callable[[F], F]]) -> Callable[[F], F]:
    def decorate(function: F) -> F:
        for option in reversed(options):
            function = option(function)
        return function

    return decorate


def json_option(help: str = "Print one JSON object.") -> Callable[[F], F]:
    return click.option("--json", "as_json", is_flag=True, help=help)


def apps_option() -> Callable[[F], F]:
    return click.option(
        "--app", "apps", multiple=True, help="Module that registers consumers (repeatable)."
    )


def dry_run_option(help: str) -> Callable[[F], F]:
    return click.option("--dry-run", is_flag=True, help=help)


def yes_option(help: str) -> Callable[[F], F]:
    return click.option("--yes", is_flag=True, help=help)


def reason_option(
    help: str = "Why (kept in the audit log); required unless --dry-run.",
) -> Callable[[F], F]:
    return click.option("--reason", help=help)


def limit_option(default: int | None, help: str) -> Callable[[F], F]:
    return click.option(
        "--limit",
        type=click.IntRange(min=1, max=MAX_COUNT),
        default=default,
        show_default=default is not None,
        help=help,
    )


def rate_option(
    default: float | None,
    help: str,
    *,
    zero_allowed: bool = False,
    metavar: str | None = None,
) -> Callable[[F], F]:
    """``--rate``: a pace in events (or orders) per second."""
    return click.option(
        "--rate",
        type=Pace(zero_allowed),
        default=default,
        show_default=default is not None,
        metavar=metavar,
        help=help,
    )


def waiting_option() -> Callable[[F], F]:
    return click.option("--waiting", is_flag=True, help="Only dead letters not replayed yet.")


def metrics_port_option(name: str, help: str) -> Callable[[F], F]:
    return click.option(
        "--metrics-port", name, type=click.IntRange(0, 65535), default=None, help=help
    )


def count_option(
    flag: str,
    default: int,
    help: str | None = None,
    *,
    minimum: int = 0,
    short: tuple[str, ...] = (),
) -> Callable[[F], F]:
    """A whole number of things (processes, faults, dead letters), at least ``minimum``."""
    return click.option(
        flag,
        *short,
        type=click.IntRange(min=minimum, max=MAX_COUNT),
        default=default,
        show_default=True,
        help=help,
    )


def seconds_option(flag: str, default: float, help: str, *, minimum: float) -> Callable[[F], F]:
    """A number of seconds (a timeout, an age), at least ``minimum``."""
    return click.option(
        flag,
        type=FiniteFloatRange(min=minimum, max=MAX_SECONDS),
        default=default,
        show_default=True,
        help=help,
    )


def share_option(flag: str, name: str, default: float, help: str) -> Callable[[F], F]:
    """A share from 0 to 1 (of events, of attempts)."""
    return click.option(
        flag, name, type=FiniteFloatRange(0, 1), default=default, show_default=True, help=help
    )


def processes_option(
    default: int, help: str | None = None, *, short: tuple[str, ...] = ()
) -> Callable[[F], F]:
    return count_option("--processes", default, help, minimum=1, short=short)


def threads_option(
    default: int, help: str | None = None, *, short: tuple[str, ...] = ()
) -> Callable[[F], F]:
    return count_option("--threads", default, help, minimum=1, short=short)


def events_option(default: int, help: str) -> Callable[[F], F]:
    return count_option("--events", default, help, minimum=1, short=("-n",))


def seed_option(help: str) -> Callable[[F], F]:
    return click.option("--seed", type=int, default=None, help=help)


def server_url_options(database: str, redis: str) -> Callable[[F], F]:
    """``--database-url`` and ``--redis-url``: servers to use instead of throwaway ones."""
    return _stack(
        [
            click.option("--database-url", default=None, help=database),
            click.option("--redis-url", default=None, help=redis),
        ]
    )


def dead_letter_filters() -> Callable[[F], F]:
    """The FILTERS of ``pipeline dlq`` list, replay and purge."""
    return _stack(
        [
            click.option(
                "--stage", type=click.Choice(["publish", "consume"]), help="Only this stage."
            ),
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
                type=click.IntRange(min=1, max=MAX_ID),
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
            click.option(
                "--group",
                metavar="FINGERPRINT",
                help="The dead letters of one cause: a fingerprint `pipeline dlq groups` prints.",
            ),
        ]
    )


def http_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Callback of options that take a base URL."""
    if value is not None and not value.startswith(("http://", "https://")):
        raise click.BadParameter("expected an http:// or https:// URL")
    return value
