"""The drill's consumers, run by real relay and worker processes (see :mod:`.workflow`).

Relays and workers load this module through ``PIPELINE_APP_MODULES=pipeline.tools.drill.app``.
Its settings are read when a handler first runs, never at import time:

* ``PIPELINE_DRILL_API_URL`` — base URL of the payment/e-mail API
  (``python -m pipeline.tools.demo.payment_api``), which honours ``Idempotency-Key``;
* ``PIPELINE_DRILL_APP_SCHEMA`` — the schema of the drill's business tables.

A poison order (an amount that is not a positive integer) is refused by every consumer of
``order.placed`` as non-retryable, so it must end as a dead letter and nothing else.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import httpx

from pipeline.config import validate_identifier
from pipeline.envelope import ReceivedEvent
from pipeline.inbox import HandlerContext, consumer
from pipeline.inbox.http import idempotent_post
from pipeline.tools.drill.sql import DrillQueries
from pipeline.tools.drill.workflow import (
    AGGREGATE_TYPE,
    API_URL_ENV,
    APP_SCHEMA_ENV,
    CHARGES_PATH,
    EMAIL_STEP,
    EMAILS_PATH,
    LEDGER,
    NOTIFICATIONS,
    ORDER_PLACED,
    ORDER_SHIPPED,
    PAYMENT_CHARGED,
    PAYMENTS,
    SHIPPING,
)

RETRIES: dict[str, Any] = {"max_retries": 20, "min_backoff": 0.05, "max_backoff": 2.0}


class PoisonOrder(Exception):
    """The order can never be processed as it is: dead-letter it at once."""


class ApiRejected(Exception):
    """The API refused the request for good (4xx other than 409)."""


class DrillMisconfigured(Exception):
    """A worker lacks a drill setting; every attempt would fail the same way."""


class ApiBusy(Exception):
    """The API answered 409 (the same key in flight) or 5xx: retry later."""


@dataclass(frozen=True)
class DrillConfig:
    api_url: str
    queries: DrillQueries


@lru_cache(maxsize=1)
def drill_config() -> DrillConfig:
    """This process's drill settings, read from the environment on first use."""
    api_url = os.environ.get(API_URL_ENV, "").rstrip("/")
    if not api_url.startswith(("http://", "https://")):
        raise DrillMisconfigured(f"{API_URL_ENV} must be the payment API's http(s) URL")
    schema = validate_identifier(os.environ.get(APP_SCHEMA_ENV, ""), APP_SCHEMA_ENV)
    # The handlers' queries use only {app}; the pipeline schema name is a placeholder.
    return DrillConfig(api_url, DrillQueries("pipeline", schema))


_clients: dict[int, httpx.Client] = {}
_clients_lock = threading.Lock()


def http_client() -> httpx.Client:
    """One connection pool per process (Dramatiq forks workers after importing this)."""
    pid = os.getpid()
    with _clients_lock:
        client = _clients.get(pid)
        if client is None:
            client = _clients[pid] = httpx.Client(timeout=10.0)
        return client


def _execute(ctx: HandlerContext, name: str, params: dict[str, Any]) -> Any:
    """Run a named query in the handler's transaction (the inbox record's transaction)."""
    return ctx.session.connection().exec_driver_sql(drill_config().queries.text(name), params)


def _api_result(response: httpx.Response) -> dict[str, Any]:
    if response.status_code == 409 or response.status_code >= 500:
        raise ApiBusy(f"API answered {response.status_code}; retry later")
    if response.status_code >= 400:
        raise ApiRejected(f"API refused the request with {response.status_code}")
    result: dict[str, Any] = response.json()
    return result


def parse_order(data: Any) -> dict[str, Any]:
    """The order in an ``order.placed`` payload, or :class:`PoisonOrder`."""
    if not isinstance(data, dict):
        raise PoisonOrder("payload is not a JSON object")
    for name in ("run", "order_id", "account"):
        if not isinstance(data.get(name), str) or not data[name]:
            raise PoisonOrder(f"{name} must be a non-empty string")
    for name in ("n", "amount_cents"):
        value = data.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise PoisonOrder(f"{name} must be a positive integer, got {type(value).__name__}")
    return data


def _record(
    ctx: HandlerContext,
    event: ReceivedEvent,
    data: dict[str, Any],
    *,
    ordered: bool,
    ref: str | None = None,
) -> None:
    """The consumer's effect row; an ordered consumer also takes its next position for the key."""
    position = None
    if ordered:
        row = _execute(ctx, "take_position", {"consumer": ctx.consumer, "key": event.ordering_key})
        position = int(row.scalar_one())
    _execute(
        ctx,
        "record_effect",
        {
            "consumer": ctx.consumer,
            "event_id": event.id,
            "order_id": data["order_id"],
            "key": event.ordering_key,
            "seq": event.seq,
            "n": data["n"],
            "position": position,
            "ref": ref,
        },
    )


def _follow_up(data: dict[str, Any], **extra: Any) -> dict[str, Any]:
    keep = ("run", "order_id", "account", "n", "amount_cents")
    return {**{k: data[k] for k in keep if k in data}, **extra}


@consumer(
    PAYMENTS,
    [ORDER_PLACED],
    non_retryable=[PoisonOrder, ApiRejected, DrillMisconfigured],
    **RETRIES,
)
def charge(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Charge the order once however often this runs: the API sees one idempotency key."""
    order = parse_order(event.data)
    response = idempotent_post(
        http_client(),
        drill_config().api_url + CHARGES_PATH,
        ctx,
        json={
            "run": order["run"],
            "order_id": order["order_id"],
            "customer": order["account"],
            "amount_cents": order["amount_cents"],
            "currency": "EUR",
        },
    )
    charge_id = str(_api_result(response)["id"])
    _record(ctx, event, order, ordered=False, ref=charge_id)
    ctx.publish(
        PAYMENT_CHARGED,
        _follow_up(order, charge_id=charge_id),
        aggregate_type=AGGREGATE_TYPE,
        aggregate_id=order["account"],
    )


@consumer(LEDGER, [ORDER_PLACED], ordered=True, non_retryable=[PoisonOrder], **RETRIES)
def post_to_ledger(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Record the order in the account's ledger, in the account's order."""
    _record(ctx, event, parse_order(event.data), ordered=True)


@consumer(SHIPPING, [PAYMENT_CHARGED], ordered=True, **RETRIES)
def ship(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Ship a paid order, in the account's order, and announce it (an unordered event)."""
    _record(ctx, event, event.data, ordered=True)
    ctx.publish(ORDER_SHIPPED, _follow_up(event.data), ordered=False)


@consumer(
    NOTIFICATIONS,
    [ORDER_SHIPPED],
    non_retryable=[ApiRejected, DrillMisconfigured],
    **RETRIES,
)
def notify(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Send one shipping e-mail per order (with a step key, like multi-call handlers)."""
    data = event.data
    response = idempotent_post(
        http_client(),
        drill_config().api_url + EMAILS_PATH,
        ctx,
        step=EMAIL_STEP,
        json={
            "run": data["run"],
            "order_id": data["order_id"],
            "to": f"{data['account']}@example.com",
            "template": "order-shipped",
        },
    )
    message_id = str(_api_result(response)["id"])
    _record(ctx, event, data, ordered=False, ref=message_id)
