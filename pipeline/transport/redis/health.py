"""``pipeline doctor``'s checks of Redis: reachable, ``noeviction``, how it persists, and
behind Sentinel the sentinels' quorum and the replicas' lag."""

from __future__ import annotations

import time
from typing import Any, Literal

import redis

from pipeline.config import Settings
from pipeline.policy import redelivery_horizon
from pipeline.redaction import redact_url
from pipeline.transport.base import BrokerDiagnosis
from pipeline.transport.redis.client import is_sentinel_url, parse_sentinel_url, redis_client


def diagnose(settings: Settings) -> BrokerDiagnosis:
    """Reachability, eviction policy, persistence, and the measured round trip."""
    found = BrokerDiagnosis()
    if is_sentinel_url(settings.require_broker_url()):
        _check_sentinels(settings.require_broker_url(), found)
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


def _check_sentinels(url: str, found: BrokerDiagnosis) -> None:
    """How many sentinels answer against the quorum, and each replica's link and lag."""
    address = parse_sentinel_url(url)
    options: dict[str, Any] = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0}
    if address.sentinel_password:
        options["password"] = address.sentinel_password
    answered, master, replicas = 0, None, []
    for host, port in address.sentinels:
        try:
            with redis.Redis(host=host, port=port, **options) as client:
                state = client.sentinel_master(address.service)
                replicas = client.sentinel_slaves(address.service)
        except redis.RedisError:
            continue
        answered += 1
        master = state
    if master is None:
        found.add(
            "redis_sentinel",
            "problem",
            f"no sentinel of {len(address.sentinels)} answers for service {address.service!r}",
            "start the sentinels or fix the hosts and service name in PIPELINE_BROKER_URL",
        )
        return
    quorum = int(master.get("quorum", 0))
    known = int(master.get("num-other-sentinels", 0)) + 1
    status: Literal["ok", "problem"] = "ok" if known >= quorum and answered >= quorum else "problem"
    found.add(
        "redis_sentinel",
        status,
        f"{answered} of {len(address.sentinels)} listed sentinels answer, {known} watch "
        f"{address.service!r} (quorum {quorum}); master {master.get('ip')}:{master.get('port')}",
        "" if status == "ok" else "start more sentinels: without a quorum nobody fails over",
    )
    if not replicas:
        found.add(
            "redis_replicas",
            "problem",
            "the master has no replica: a failover has nothing to promote",
            "start a replica (replicaof the master)",
        )
    offset = _master_offset(master, address.password)
    for replica in replicas:
        name = f"{replica.get('ip')}:{replica.get('port')}"
        healthy = replica.get("flags") == "slave" and replica.get("master-link-status") == "ok"
        behind = (
            f"{max(0, offset - int(replica.get('slave-repl-offset', 0)))} bytes behind"
            if offset is not None
            else "lag unknown (the master's offset could not be read)"
        )
        found.add(
            "redis_replicas",
            "ok" if healthy else "problem",
            f"replica {name}: {replica.get('flags')}, link {replica.get('master-link-status')}, "
            f"{behind}",
            "" if healthy else "a replica that is down or out of sync cannot take over",
        )


def _master_offset(master: dict[str, Any], password: str | None) -> int | None:
    """The master's replication offset, against which replicas' lag is measured."""
    try:
        with redis.Redis(
            host=str(master.get("ip")),
            port=int(master.get("port", 0)),
            password=password,
            socket_timeout=5.0,
            socket_connect_timeout=5.0,
        ) as client:
            return int(client.info("replication").get("master_repl_offset", 0))
    except (redis.RedisError, ValueError):
        return None


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
