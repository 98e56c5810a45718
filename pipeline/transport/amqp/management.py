"""The few calls of RabbitMQ's management HTTP API the pipeline makes (stdlib only).

AMQP itself cannot list queues, tell a quorum queue from a classic one after the fact,
or name the cluster's members; the management plugin (``rabbitmq_management``) can. The
pipeline works without it: then ``pipeline status`` lists only the queues it knows of,
``pipeline doctor`` says what it could not check, and namespace clean-up needs it.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from pipeline.config import Settings
from pipeline.errors import ServiceUnavailableError
from pipeline.redaction import redact_url

DEFAULT_PORTS = {"amqp": 15672, "amqps": 15671}


def management_url(broker_url: str, explicit: str | None = None) -> str:
    """The management API's base URL: ``explicit``, else the broker's host on 15672
    (15671 for ``amqps``) with the broker URL's credentials."""
    if explicit:
        return explicit.rstrip("/")
    parts = urlsplit(broker_url.split(";", maxsplit=1)[0])
    scheme = "https" if parts.scheme == "amqps" else "http"
    user = parts.username or "guest"
    password = parts.password or "guest"
    host = parts.hostname or "localhost"
    if ":" in host:
        host = f"[{host}]"
    port = DEFAULT_PORTS.get(parts.scheme, 15672)
    userinfo = f"{quote(unquote(user), safe='')}:{quote(unquote(password), safe='')}"
    return f"{scheme}://{userinfo}@{host}:{port}"


def virtual_host(broker_url: str) -> str:
    """The virtual host the broker URL names (``/`` when it names none)."""
    path = urlsplit(broker_url.split(";", maxsplit=1)[0]).path
    return unquote(path[1:]) if len(path) > 1 else "/"


class Management:
    """A client of the management API for one broker URL."""

    def __init__(self, broker_url: str, explicit: str | None = None, timeout: float = 5.0) -> None:
        base = management_url(broker_url, explicit)
        parts = urlsplit(base)
        self.vhost = virtual_host(broker_url)
        netloc = parts.netloc.rsplit("@", 1)[-1]
        self.base = f"{parts.scheme}://{netloc}"
        self.shown = redact_url(base)
        token = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
        self.auth = "Basic " + base64.b64encode(token.encode()).decode()
        self.timeout = timeout

    @classmethod
    def for_settings(cls, settings: Settings, timeout: float = 5.0) -> Management:
        explicit = settings.broker_management_url
        return cls(
            settings.require_broker_url(),
            explicit.get_secret_value() if explicit is not None else None,
            timeout,
        )

    def _call(self, method: str, path: str) -> Any:
        request = urllib.request.Request(  # noqa: S310 - http(s) only, validated in settings
            self.base + path, method=method, headers={"Authorization": self.auth}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310
                body = response.read()
        except urllib.error.HTTPError as exc:
            if method == "DELETE" and exc.code == 404:
                return None
            raise ServiceUnavailableError(
                f"RabbitMQ management API at {self.shown}: HTTP {exc.code} for {path}"
            ) from None
        except (OSError, ValueError) as exc:
            raise ServiceUnavailableError(
                f"cannot reach the RabbitMQ management API at {self.shown}: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        return json.loads(body) if body else None

    def queues(self) -> list[dict[str, Any]]:
        """The virtual host's queues: name, type, messages, arguments, members."""
        columns = "name,type,messages,messages_ready,arguments,members,online,leader"
        found: list[dict[str, Any]] = self._call(
            "GET", f"/api/queues/{quote(self.vhost, safe='')}?columns={columns}"
        )
        return found

    def queue_traffic(self) -> list[dict[str, Any]]:
        """The virtual host's queues with their leader, depth and publish rate (per second,
        ``message_stats.publish_details.rate``; absent on a queue nothing was published to)."""
        columns = "name,messages,leader,message_stats.publish_details.rate"
        found: list[dict[str, Any]] = self._call(
            "GET", f"/api/queues/{quote(self.vhost, safe='')}?columns={columns}"
        )
        return found

    def delete_queue(self, name: str) -> None:
        self._call("DELETE", f"/api/queues/{quote(self.vhost, safe='')}/{quote(name, safe='')}")

    def nodes(self) -> list[dict[str, Any]]:
        """The cluster's nodes: name and ``running``."""
        found: list[dict[str, Any]] = self._call("GET", "/api/nodes?columns=name,running")
        return found
