"""Redis clients for every URL the Redis transport takes, Sentinel included.

``redis://``, ``rediss://`` (TLS) and ``unix://`` are redis-py's own URLs. A highly
available Redis behind Sentinel is named by the sentinels and the service they watch::

    redis+sentinel://[:password@]host:port[,host:port...]/service_name[/db][?sentinel_password=...]

The password (if any) is the data nodes'; ``sentinel_password`` the sentinels' own when
they require one. The client asks the sentinels for the current master and asks again
after a failover: a connection that finds its server demoted to a replica
(``READONLY``) is closed and the command fails with a connection error, which the relay
and workers treat as an outage (retried, never acknowledged away), and the next command
goes to the new master.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.sentinel import Sentinel

from pipeline.errors import ConfigurationError

SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelAddress:
    """What a ``redis+sentinel://`` URL names."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int
    username: str | None
    password: str | None
    sentinel_password: str | None


def is_sentinel_url(url: str) -> bool:
    return urlsplit(url).scheme == SENTINEL_SCHEME


def parse_sentinel_url(url: str) -> SentinelAddress:
    """The parts of a ``redis+sentinel://`` URL; :class:`ConfigurationError` naming what is
    wrong otherwise (never the password)."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    sentinels = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":") if ":" in item else (item.strip(), "", "")
        if not host:
            raise ConfigurationError(f"Sentinel URL: {item!r} is not host:port")
        try:
            number = int(port) if port else DEFAULT_SENTINEL_PORT
        except ValueError:
            raise ConfigurationError(f"Sentinel URL: port {port!r} is not a number") from None
        if not 0 < number < 65536:
            raise ConfigurationError(f"Sentinel URL: port {number} is out of range")
        sentinels.append((host.strip("[]"), number))
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ConfigurationError(
            "Sentinel URL: the path must be /service_name or /service_name/db, as in "
            "redis+sentinel://host:26379/mymaster/0"
        )
    db = 0
    if len(path) == 2:
        if not path[1].isdigit():
            raise ConfigurationError(f"Sentinel URL: database {path[1]!r} is not a number")
        db = int(path[1])
    sentinel_password = parse_qs(parts.query).get("sentinel_password")
    return SentinelAddress(
        tuple(sentinels),
        path[0],
        db,
        unquote(username) or None,
        unquote(password) or None,
        sentinel_password[0] if sentinel_password else None,
    )


def redis_client(url: str, timeout: float | None = None, **options: Any) -> redis.Redis:
    """A client for ``url`` (any URL of the module docstring); ``timeout`` bounds each call
    (connect and reply), None waits as long as a call takes."""
    if timeout is not None:
        options = {"socket_timeout": timeout, "socket_connect_timeout": timeout, **options}
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **options)
    address = parse_sentinel_url(url)
    sentinel_options = {k: v for k, v in options.items() if k.startswith("socket_")}
    if address.sentinel_password:
        sentinel_options["password"] = address.sentinel_password
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        list(address.sentinels), sentinel_kwargs=sentinel_options, **sentinel_options
    )
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        address.service,
        db=address.db,
        username=address.username,
        password=address.password,
        **options,
    )
    return client
