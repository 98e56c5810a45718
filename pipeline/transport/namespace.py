"""Delete every Redis key under a namespace: what the demo, the drill and tests clean up."""

from __future__ import annotations

import redis


def delete_namespace(redis_url: str, namespace: str) -> None:
    """Delete the keys named ``<namespace>:*``, in chunks of 500.

    Scans rather than ``KEYS``, so a shared Redis is not blocked, and touches nothing
    outside the namespace: the queues, wake-up lists and acks of one pipeline only.
    """
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])
    finally:
        client.close()
