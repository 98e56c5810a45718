"""HTTP calls from handlers that are safe to retry: the context's key as ``Idempotency-Key``.

Each call is a CLIENT span (child of the handler's ``process`` span) and carries the
W3C trace context, so the called service continues the same trace.

In a sandbox context (``pipeline dlq replay --to-sandbox``) nothing is sent: the call
(method, URL, idempotency key; never the body) is recorded in the context, and the
handler gets a stand-in ``200`` response with an empty JSON object and the header
``X-Pipeline-Sandbox: recorded``.
"""

from __future__ import annotations

from typing import Any

import httpx
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from pipeline.inbox.context import ExternalCall, HandlerContext

SANDBOX_HEADER = "X-Pipeline-Sandbox"


def idempotent_request(
    client: httpx.Client,
    method: str,
    url: str,
    ctx: HandlerContext,
    *,
    step: str | None = None,
    **kwargs: Any,
) -> httpx.Response:
    """Send ``method url`` with ``Idempotency-Key`` = the handler's key (or its step key)."""
    headers = dict(kwargs.pop("headers", None) or {})
    headers["Idempotency-Key"] = ctx.step_key(step) if step else ctx.idempotency_key
    request = client.build_request(method, url, headers=headers, **kwargs)
    if ctx.sandbox is not None:
        ctx.sandbox.external_calls.append(
            ExternalCall(
                method.upper(), _without_credentials(request.url), headers["Idempotency-Key"]
            )
        )
        return httpx.Response(200, json={}, headers={SANDBOX_HEADER: "recorded"}, request=request)
    tracer = trace.get_tracer("pipeline")
    with tracer.start_as_current_span(
        method.upper(),
        kind=SpanKind.CLIENT,
        attributes={
            "http.request.method": method.upper(),
            "server.address": request.url.host,
            "server.port": request.url.port or (443 if request.url.scheme == "https" else 80),
            "url.path": request.url.path,
        },
    ) as span:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        request.headers.update(carrier)
        response = client.send(request)
        span.set_attribute("http.response.status_code", response.status_code)
        if response.status_code >= 500:
            span.set_status(Status(StatusCode.ERROR))
        return response


def idempotent_post(
    client: httpx.Client, url: str, ctx: HandlerContext, *, step: str | None = None, **kwargs: Any
) -> httpx.Response:
    return idempotent_request(client, "POST", url, ctx, step=step, **kwargs)


def _without_credentials(url: httpx.URL) -> str:
    """The URL as recorded in a sandbox: any user:password part left out."""
    return str(url.copy_with(userinfo=b"")) if url.userinfo else str(url)
