"""Every pipeline connection bounds its waits: the settings built for its session."""

from __future__ import annotations

from pipeline import Settings
from pipeline.db.connect import keepalive_parameters, session_settings


def settings(**values: object) -> Settings:
    return Settings(database_url="postgresql://u@h/db", **values)  # type: ignore[arg-type]


def test_timeouts_and_keepalives_by_default():
    assert session_settings(settings()) == {
        "lock_timeout": "5000",
        "statement_timeout": "60000",
        "idle_in_transaction_session_timeout": "120000",
        "tcp_keepalives_idle": "10",
        "tcp_keepalives_interval": "5",
        "tcp_keepalives_count": "3",
    }
    assert keepalive_parameters(settings()) == {
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
    }


def test_a_setting_at_zero_leaves_the_servers_own():
    values = session_settings(settings(lock_timeout_ms=0, tcp_keepalives_idle_seconds=0))
    assert set(values) == {"statement_timeout", "idle_in_transaction_session_timeout"}
    assert keepalive_parameters(settings(tcp_keepalives_idle_seconds=0)) == {}


def test_migrations_keep_only_the_keepalives():
    assert set(session_settings(settings(), timeouts=False)) == {
        "tcp_keepalives_idle",
        "tcp_keepalives_interval",
        "tcp_keepalives_count",
    }
