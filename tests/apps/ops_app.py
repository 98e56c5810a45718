"""Consumers for the ops-kit tests, run by real worker processes; faults are files.

* **orders** handles ``order.placed``; it rejects an order marked ``poison`` for good
  (non-retryable: a dead letter at once) while the file named by ``OPS_POISON_FLAG``
  exists — deleting the file is the "fix" that makes a replay succeed.
* **ledger** handles ``order.placed`` too and fails every attempt while the file named
  by ``OPS_FAIL_FLAG`` exists (a consumer in a crash loop), retrying quickly.

Both record each committed run in ``ops_effects`` (created by the test), so a test can
count how often a handler's effects committed per event.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import text

from pipeline.envelope import ReceivedEvent
from pipeline.inbox import HandlerContext, consumer


class InvalidOrder(Exception):
    """The order can never be processed as it is."""


class LedgerUnavailable(Exception):
    """The ledger's downstream system is down (injected)."""


def _flag(variable: str) -> bool:
    name = os.environ.get(variable, "")
    return bool(name) and Path(name).exists()


def _effect(ctx: HandlerContext, name: str, event: ReceivedEvent) -> None:
    ctx.session.execute(
        text("INSERT INTO ops_effects (consumer, event_id) VALUES (:c, :e)"),
        {"c": name, "e": str(event.id)},
    )


@consumer("orders", ["order.placed"], non_retryable=[InvalidOrder], max_retries=3)
def orders(event: ReceivedEvent, ctx: HandlerContext) -> None:
    if event.data.get("poison") and _flag("OPS_POISON_FLAG"):
        raise InvalidOrder("order has no line items")
    _effect(ctx, "orders", event)


@consumer("ledger", ["order.placed"], max_retries=10_000, min_backoff=0.05, max_backoff=0.2)
def ledger(event: ReceivedEvent, ctx: HandlerContext) -> None:
    if _flag("OPS_FAIL_FLAG"):
        raise LedgerUnavailable("ledger API answered 503")
    _effect(ctx, "ledger", event)
