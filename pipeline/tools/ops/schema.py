"""``pipeline db``: apply the schema's migrations, or list those not applied yet."""

from __future__ import annotations

from pipeline.config import Settings
from pipeline.db.connect import make_engine
from pipeline.db.migrate import UpgradeResult, pending_migrations, upgrade
from pipeline.driver_errors import wrap_driver_errors


def upgrade_schema(settings: Settings) -> UpgradeResult:
    """Apply pending migrations in one transaction (safe concurrently and repeatedly).

    Without the pipeline's lock and statement timeouts: a migration may rightly wait for
    its table locks and run long."""
    engine = make_engine(settings, timeouts=False)
    try:
        with wrap_driver_errors(settings), engine.begin() as connection:
            return upgrade(connection, settings.schema_name)
    finally:
        engine.dispose()


def pending_versions(settings: Settings) -> list[int]:
    """Migration versions not applied yet (all of them when the schema does not exist)."""
    engine = make_engine(settings)
    try:
        with wrap_driver_errors(settings), engine.connect() as connection:
            return pending_migrations(connection, settings.schema_name)
    finally:
        engine.dispose()
