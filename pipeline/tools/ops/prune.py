"""``pipeline prune``: one retention pass now, or a dry run that counts what would go.

The same pass as the relay's janitor (:mod:`pipeline.db.retention`), under the same
lock: if a janitor is pruning, this command says so and exits non-zero. A real prune
leaves an audit record (who, the ages used, how many rows); a dry run writes nothing.
Like the janitor, it refuses an inbox retention shorter than a known consumer's retry
horizon (:func:`pipeline.policy.require_retention`), dry run or not.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import psycopg

from pipeline.config import Settings
from pipeline.db.connect import connect
from pipeline.db.retention import Pruner, PruneResult, RetentionPolicy
from pipeline.db.stores.audit import AuditStore
from pipeline.errors import MigrationError, PipelineError
from pipeline.policy import ConsumerPolicy, require_retention
from pipeline.tools.ops.audit import os_user


class PruneBusyError(PipelineError):
    """Another prune pass (a relay's janitor, or another ``pipeline prune``) holds the lock."""


def run_prune(
    settings: Settings, consumers: Iterable[ConsumerPolicy], *, dry_run: bool
) -> PruneResult:
    """Prune (or count) now; raises :class:`PruneBusyError` when another pass runs, and
    ``ConfigurationError`` when the inbox retention is short for one of ``consumers``."""
    require_retention(settings, consumers)
    policy = RetentionPolicy.from_settings(settings)
    pruner = Pruner(settings.schema_name, policy)
    with connect(settings, autocommit=True) as conn:
        try:
            result = pruner.run(conn, dry_run=dry_run)
        except psycopg.errors.UndefinedTable:
            raise MigrationError(
                f"the pipeline schema {settings.schema_name!r} is not installed: "
                "run `pipeline db upgrade`"
            ) from None
        if result.skipped:
            raise PruneBusyError(
                "another prune is running (a relay's janitor or `pipeline prune`); "
                "try again when it has finished"
            )
        if not dry_run:
            AuditStore(settings.schema_name).record_prune(
                conn, os_user(), json.dumps(_parameters(policy)), result.deleted
            )
    return result


def prune_now(settings: Settings, *, dry_run: bool) -> PruneResult:
    """``pipeline prune``: one pass, judged on the registered consumers' policies."""
    from pipeline.tools.ops.consumers import consumer_policies

    return run_prune(settings, consumer_policies(settings), dry_run=dry_run)


def _parameters(policy: RetentionPolicy) -> dict[str, Any]:
    return {
        "retention_seconds": {
            "outbox": policy.outbox,
            "inbox": policy.inbox,
            "attempts": policy.attempts,
            "audit_log": policy.audit_log,
        },
        "batch_size": policy.batch_size,
    }


def format_prune(result: PruneResult) -> str:
    """The human-readable report, one line per table."""
    verb = "would delete" if result.dry_run else "deleted"
    total = result.eligible if result.dry_run else result.deleted
    lines = [f"prune{' (dry run)' if result.dry_run else ''}: {verb} {total} rows"]
    for table in result.tables:
        count = table.eligible if result.dry_run else table.deleted
        line = f"  {table.table}: {verb} {count} older than {table.cutoff:%Y-%m-%d %H:%M:%S%z}"
        if table.kept:
            line += f", kept {table.kept} still needed"
        if not table.complete:
            line += " (stopped early: lock or statement timeout; run again)"
        lines.append(line)
    return "\n".join(lines)
