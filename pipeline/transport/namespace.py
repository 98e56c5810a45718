"""Delete everything a pipeline keeps in its broker: what the demo, the drill and tests clean up."""

from __future__ import annotations

from pipeline.transport.factory import transport_class


def delete_namespace(url: str, namespace: str, management_url: str | None = None) -> None:
    """Delete the queues, wake-up lists and bookkeeping under ``namespace`` at ``url``
    (nothing outside it: a shared server keeps other pipelines' data); ``management_url``:
    RabbitMQ's management API, where it is not the default one of ``url``."""
    transport_class(url).delete_namespace(url, namespace, management_url)
