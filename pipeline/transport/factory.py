"""The one place a broker URL's scheme maps to a transport implementation.

:mod:`pipeline.transport.redis` serves ``redis://``, ``rediss://`` and ``unix://``;
:mod:`pipeline.transport.amqp` serves ``amqp://`` and ``amqps://`` (RabbitMQ).
A new broker is a new package beside them (its
:class:`~pipeline.transport.base.Transport` subclass, publisher and whatever private
layout it needs) plus its schemes here; the relay, the inbox and the tools only ever see
:class:`~pipeline.transport.base.Transport`.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from pipeline.config import Settings
from pipeline.errors import ConfigurationError
from pipeline.transport.base import Transport

REDIS_SCHEMES = frozenset({"redis", "rediss", "unix", "redis+sentinel"})
AMQP_SCHEMES = frozenset({"amqp", "amqps"})


def transport_class(url: str) -> type[Transport]:
    """The implementation for ``url``'s scheme (imported on first use)."""
    scheme = urlsplit(url).scheme
    if scheme in REDIS_SCHEMES:
        from pipeline.transport.redis.transport import RedisTransport

        return RedisTransport
    if scheme in AMQP_SCHEMES:
        from pipeline.transport.amqp.transport import AmqpTransport

        return AmqpTransport
    raise ConfigurationError(f"PIPELINE_BROKER_URL: no transport for the scheme {scheme!r}")


def open_transport(
    settings: Settings, middleware: list[Any] | None = None, *, timeout: float | None = None
) -> Transport:
    """The configured transport, with its Dramatiq broker (see :class:`Transport`)."""
    return transport_class(settings.require_broker_url())(settings, middleware, timeout=timeout)


def broker_problem(settings: Settings) -> str | None:
    """Why the configured broker cannot be used yet, or None."""
    return transport_class(settings.require_broker_url()).problem(settings)
