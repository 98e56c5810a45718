"""The chaos tier's shared fixture: settings that make faults show within seconds."""

from __future__ import annotations

import pytest

from pipeline import Settings, configure
from tests.chaos.orders import TABLES


@pytest.fixture
def chaos_settings(settings: Settings, engine):
    with engine.begin() as conn:
        conn.exec_driver_sql(TABLES)
    value = settings.replace(
        lease_seconds=3.0,
        poll_interval_max=0.5,
        broker_heartbeat_timeout_ms=3000,
        broker_maintenance_chance=200_000,
        canary_interval=0,
        redelivery_horizon_seconds=3.0,
        reconcile_interval_seconds=0.5,
    )
    configure(value)
    yield value
    configure(settings)
