"""What the demo's and the drill's order workflows share: the payment API and the handlers' tools.

Both workflows (``pipeline.tools.demo.app``, ``pipeline.tools.drill.app``) take an
``order.placed`` event, charge the order through the payment API
(:mod:`pipeline.tools.harness.payment_api`) with the handler's idempotency key, write their
effects in the handler's transaction, and send one e-mail per order through the same API
with a step key. They differ in the consumers between those steps (stock in the demo,
ordered ledger and shipping in the drill) and in what their reports check.

Settings are read when a handler first runs, never at import time, from variables the
workflow names (its ``PIPELINE_DEMO_*`` or ``PIPELINE_DRILL_*``).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import httpx

from pipeline.inbox import HandlerContext
from pipeline.inbox.http import idempotent_post
from pipeline.tools.harness.payment_api import CHARGES_PATH, EMAILS_PATH
from pipeline.tools.harness.sql import WorkflowQueries

HTTP_TIMEOUT = 10.0


class ApiRejected(Exception):
    """The API refused the request for good (4xx other than 409): retrying cannot help."""


class ApiBusy(Exception):
    """The API answered 409 (the same key in flight) or 5xx: retry later."""


class Misconfigured(Exception):
    """A worker lacks a workflow setting; every attempt would fail the same way."""


API_FAILURES = (ApiRejected, Misconfigured)
"""What no retry of a handler that calls the API can fix: its ``non_retryable``."""


def api_url_from(variable: str) -> str:
    """The payment API's base URL from the environment variable ``variable``."""
    url = os.environ.get(variable, "").rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise Misconfigured(f"{variable} must be the payment API's http(s) URL")
    return url


_clients: dict[int, httpx.Client] = {}
_clients_lock = threading.Lock()


def http_client() -> httpx.Client:
    """One connection pool per process (Dramatiq forks workers after importing the app)."""
    pid = os.getpid()
    with _clients_lock:
        client = _clients.get(pid)
        if client is None:
            client = _clients[pid] = httpx.Client(timeout=HTTP_TIMEOUT)
        return client


def api_result(response: httpx.Response) -> dict[str, Any]:
    if response.status_code == 409 or response.status_code >= 500:
        raise ApiBusy(f"API answered {response.status_code}; retry later")
    if response.status_code >= 400:
        raise ApiRejected(f"API refused the request with {response.status_code}")
    result: dict[str, Any] = response.json()
    return result


def charge(ctx: HandlerContext, api_url: str, order: dict[str, Any], customer: str) -> str:
    """Charge the order once however often this runs (one idempotency key); the charge id."""
    body = {
        "run": order["run"],
        "order_id": order["order_id"],
        "customer": customer,
        "amount_cents": order["amount_cents"],
        "currency": "EUR",
    }
    response = idempotent_post(http_client(), api_url + CHARGES_PATH, ctx, json=body)
    return str(api_result(response)["id"])


def send_email(
    ctx: HandlerContext, api_url: str, step: str, order: dict[str, Any], user: str, template: str
) -> str:
    """Send one e-mail per order to ``user`` at example.com (a step key, like multi-call
    handlers); the message id."""
    to = f"{user}@example.com"
    body = {"run": order["run"], "order_id": order["order_id"], "to": to, "template": template}
    response = idempotent_post(http_client(), api_url + EMAILS_PATH, ctx, step=step, json=body)
    return str(api_result(response)["id"])


def execute(
    ctx: HandlerContext, queries: WorkflowQueries, name: str, params: dict[str, Any]
) -> Any:
    """Run a named query in the handler's transaction (the inbox record's transaction)."""
    return ctx.session.connection().exec_driver_sql(queries.text(name), params)


def validated(
    data: Any, strings: tuple[str, ...], integers: tuple[str, ...], poison: type[Exception]
) -> dict[str, Any]:
    """``data`` if it is an order (non-empty ``strings``, positive ``integers``), else
    ``poison``: such an event can never be processed and must be dead-lettered."""
    if not isinstance(data, dict):
        raise poison("payload is not a JSON object")
    for name in strings:
        if not isinstance(data.get(name), str) or not data[name]:
            raise poison(f"{name} must be a non-empty string")
    for name in integers:
        value = data.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise poison(f"{name} must be a positive integer, got a {type(value).__name__} value")
    return data


def follow_up(data: dict[str, Any], keep: tuple[str, ...], **extra: Any) -> dict[str, Any]:
    """The payload of a follow-up event: the order's fields that travel on, and ``extra``."""
    return {**{k: data[k] for k in keep if k in data}, **extra}
