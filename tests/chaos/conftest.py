"""The chaos tier's shared fixture: settings that make faults show within seconds."""

from __future__ import annotations

import pytest

from pipeline import Settings
from tests.chaos.orders import TABLES, fault_settings


@pytest.fixture
def chaos_settings(settings: Settings, engine):
    with fault_settings(settings, engine, TABLES) as value:
        yield value
