"""Delete everything a pipeline keeps in its broker: what the demo, the drill and tests clean up."""

from __future__ import annotations

from pipeline.transport.factory import transport_class


def delete_namespace(url: str, namespace: str) -> None:
    """Delete the queues, wake-up lists and bookkeeping under ``namespace`` at ``url``
    (nothing outside it: a shared server keeps other pipelines' data)."""
    transport_class(url).delete_namespace(url, namespace)
