"""Every pipeline connection bounds its waits: the libpq parameters built from settings."""

from __future__ import annotations

from pipeline import Settings
from pipeline.db.connect import session_parameters


def settings(url: str = "postgresql://u@h/db", **values: object) -> Settings:
    return Settings(database_url=url, **values)  # type: ignore[arg-type]


def test_timeouts_and_keepalives_travel_in_the_startup_packet():
    params = session_parameters(settings())
    assert params["options"] == (
        "-c lock_timeout=5000 -c statement_timeout=60000 "
        "-c idle_in_transaction_session_timeout=120000 "
        "-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3"
    )
    assert (params["keepalives"], params["keepalives_idle"]) == (1, 10)
    assert (params["keepalives_interval"], params["keepalives_count"]) == (5, 3)


def test_options_already_in_the_url_are_kept_and_settings_apply():
    params = session_parameters(
        settings(
            "postgresql://u@h/db?options=-c%20search_path%3Dapp",
            lock_timeout_ms=250,
            tcp_keepalives_idle_seconds=0,
        )
    )
    assert params["options"].startswith("-c search_path=app -c lock_timeout=250 ")
    assert "keepalives" not in params and "tcp_keepalives_idle" not in params["options"]


def test_migrations_keep_only_the_keepalives():
    params = session_parameters(settings(), timeouts=False)
    assert "timeout" not in params["options"].replace("tcp_keepalives", "")
    assert params["keepalives"] == 1
