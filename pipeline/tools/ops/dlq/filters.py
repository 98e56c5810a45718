"""Which dead letters an operator command acts on: the FILTERS of ``pipeline dlq``.

A filter becomes bound parameters of one statement (``dlq_select`` in dlq.sql), where
NULL means "not filtered"; it is also recorded, as given, in the audit log. Time bounds
are ISO-8601 timestamps or durations back from now (``30m``, ``2h``, ``7d``).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

STAGES = ("publish", "consume")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
MAX_DURATION_SECONDS = 100 * 365 * 86400
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
FINGERPRINT = re.compile(r"^[0-9a-f]{12}$")
"""A failure fingerprint as ``pipeline dlq groups`` prints it (``dlq_groups`` in dlq.sql)."""


class FilterError(ValueError):
    """An option value that cannot be a filter; the message names the option."""


def parse_when(text: str, option: str, now: datetime | None = None) -> datetime:
    """A timestamp from ISO-8601 (no offset: UTC) or a duration back from ``now``."""
    match = _DURATION.match(text)
    if match:
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
        if seconds > MAX_DURATION_SECONDS:
            raise FilterError(f"{option} {text!r} is longer than 100 years")
        return (now or datetime.now(UTC)) - timedelta(seconds=seconds)
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise FilterError(
            f"{option} {text!r} is neither an ISO-8601 timestamp nor a duration "
            "such as 30m, 2h or 7d"
        ) from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def parse_event_id(text: str, option: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise FilterError(f"{option} {text!r} is not an event id (a UUID)") from None


@dataclass(frozen=True)
class DeadLetterFilter:
    """The scope of a ``pipeline dlq`` command; every field left empty matches everything."""

    stage: str | None = None
    consumer: str | None = None
    event_type: str | None = None
    error_class: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    ids: tuple[int, ...] = ()
    event_ids: tuple[uuid.UUID, ...] = ()
    caused_by: uuid.UUID | None = None
    waiting: bool = False
    """Only dead letters not replayed yet."""
    group: str | None = None
    """Only the dead letters of this failure fingerprint (``pipeline dlq groups``)."""
    group_ids: tuple[int, ...] | None = None
    """The group's dead letters, once looked up (the fingerprint is computed in SQL)."""
    given: dict[str, Any] = field(default_factory=dict, compare=False)
    """The options as the operator typed them (durations unresolved), for the audit log."""

    def __post_init__(self) -> None:
        if self.stage is not None and self.stage not in STAGES:
            raise FilterError(f"--stage must be one of {', '.join(STAGES)}, not {self.stage!r}")
        if self.since and self.until and self.since >= self.until:
            raise FilterError("--since must be earlier than --until")
        if self.group is not None and not FINGERPRINT.match(self.group):
            raise FilterError(
                f"--group {self.group!r} is not a fingerprint (12 hex digits, as "
                "`pipeline dlq groups` prints them)"
            )

    @property
    def scoped(self) -> bool:
        """Whether any filter narrows the scope (purge refuses an unscoped run without --all)."""
        return any(
            (
                self.stage,
                self.consumer,
                self.event_type,
                self.error_class,
                self.since,
                self.until,
                self.ids,
                self.event_ids,
                self.caused_by,
                self.waiting,
                self.group,
            )
        )

    def params(self, *, limit: int | None = None, in_event_order: bool = False) -> dict[str, Any]:
        """The bound parameters of ``dlq_select``."""
        return {
            "stage": self.stage,
            "consumer": self.consumer,
            "event_type": self.event_type,
            "error_class": self.error_class,
            "since": self.since,
            "until": self.until,
            "ids": list(self.ids) or None,
            "event_ids": list(self.event_ids) or None,
            "caused_by": self.caused_by,
            "waiting": self.waiting,
            "group_ids": None if self.group_ids is None else list(self.group_ids),
            "in_event_order": in_event_order,
            "limit": limit,
        }

    def as_json(self) -> dict[str, Any]:
        """The filter for the audit log: the options given, and the time window resolved."""
        recorded: dict[str, Any] = dict(self.given)
        if self.since is not None:
            recorded["since_resolved"] = self.since.isoformat()
        if self.until is not None:
            recorded["until_resolved"] = self.until.isoformat()
        return recorded


def build_filter(
    *,
    stage: str | None = None,
    consumer: str | None = None,
    event_type: str | None = None,
    error_class: str | None = None,
    since: str | None = None,
    until: str | None = None,
    ids: tuple[int, ...] = (),
    event_ids: tuple[str, ...] = (),
    caused_by: str | None = None,
    waiting: bool = False,
    group: str | None = None,
    now: datetime | None = None,
) -> DeadLetterFilter:
    """A filter from command-line values; raises :class:`FilterError` naming the bad option."""
    given: dict[str, Any] = {
        "stage": stage,
        "consumer": consumer,
        "event_type": event_type,
        "error_class": error_class,
        "since": since,
        "until": until,
        "id": list(ids) or None,
        "event_id": list(event_ids) or None,
        "caused_by": caused_by,
        "waiting": waiting or None,
        "group": group,
    }
    for bad in (i for i in ids if i <= 0):
        raise FilterError(f"--id {bad} is not a dead-letter id (a positive number)")
    clock = now or datetime.now(UTC)
    return DeadLetterFilter(
        stage=stage,
        consumer=consumer,
        event_type=event_type,
        error_class=error_class,
        since=parse_when(since, "--since", clock) if since is not None else None,
        until=parse_when(until, "--until", clock) if until is not None else None,
        ids=tuple(ids),
        event_ids=tuple(parse_event_id(e, "--event-id") for e in event_ids),
        caused_by=parse_event_id(caused_by, "--caused-by") if caused_by is not None else None,
        waiting=waiting,
        group=group.strip().lower() if group is not None else None,
        given={k: v for k, v in given.items() if v is not None},
    )
