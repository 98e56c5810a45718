"""``pipeline doctor``'s checks of Redis: reachable, ``noeviction``, how it persists."""

from __future__ import annotations

import time
from typing import Any

import redis

from pipeline.config import Settings, redact_url
from pipeline.policy import redelivery_horizon
from pipeline.transport.base import BrokerDiagnosis
from pipeline.transport.redis.client import redis_client


def diagnose(settings: Settings) -> BrokerDiagnosis:
    """Reachability, eviction policy, persistence, and the measured round trip."""
    found = BrokerDiagnosis()
    url = redact_url(settings.require_broker_url())
    client = redis_client(settings.require_broker_url(), 5.0)
    try:
        start = time.perf_counter()
        client.ping()
        rtt = time.perf_counter() - start
        try:
            config = _redis_config(client)
        except redis.ResponseError:  # CONFIG disabled (managed Redis, renamed command)
            found.add(
                "redis",
                "info",
                f"Redis at {url} answers but does not allow CONFIG GET",
                "check in your provider's settings that maxmemory-policy is noeviction",
            )
            found.round_trip = rtt
            return found
    except redis.RedisError as exc:
        found.add(
            "redis",
            "problem",
            f"cannot reach Redis at {url}: {type(exc).__name__}",
            "start Redis or fix PIPELINE_BROKER_URL",
        )
        return found
    finally:
        client.close()
    found.round_trip = rtt
    found.add("redis", "ok", f"Redis at {url} answers ({rtt * 1000:.1f} ms)")
    policy = config.get("maxmemory-policy", "")
    if policy != "noeviction":
        found.add(
            "redis_eviction",
            "problem",
            f"maxmemory-policy is {policy!r}: Redis may evict queued messages when full",
            "CONFIG SET maxmemory-policy noeviction (and in redis.conf); evicted deliveries "
            "are sent again by the ledger sweep only after PIPELINE_REDELIVERY_HORIZON_SECONDS",
        )
    else:
        found.add("redis_eviction", "ok", "maxmemory-policy is noeviction")
    found.add("redis_persistence", "info", _persistence(config, settings), "")
    return found


def _redis_config(client: redis.Redis) -> dict[str, str]:
    config: dict[str, str] = {}
    for name in ("maxmemory-policy", "appendonly", "appendfsync", "save"):
        for key, value in client.config_get(name).items():
            config[_text(key)] = _text(value)
    return config


def _persistence(config: dict[str, str], settings: Settings) -> str:
    horizon = redelivery_horizon(settings)
    aof = config.get("appendonly") == "yes"
    snapshots = config.get("save", "").strip()
    if aof:
        kept = (
            f"appendonly yes, appendfsync {config.get('appendfsync', '?')}: a crash loses "
            "at most the last second of queued messages (everysec; none with always)"
        )
    elif snapshots:
        kept = (
            f"RDB snapshots only (save {snapshots!r}): a crash loses what was queued since "
            "the last snapshot"
        )
    else:
        kept = "no persistence: a restart loses every queued message"
    return (
        f"{kept}. Lost deliveries are not lost events: the delivery ledger sends them again "
        f"after the redelivery horizon ({horizon:.0f}s), so a Redis that forgets only delays them"
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
