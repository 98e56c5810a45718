"""``pipeline doctor``'s message-key check: what an operator is told for each key setting."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from pipeline.config import Settings
from pipeline.tools.ops.doctor import Report, check_message_key, format_report

KEY = "k" * 32


def finding(**keys: str) -> tuple[str, str, str]:
    settings = Settings(**{name: SecretStr(value) for name, value in keys.items()})
    report = Report()
    check_message_key(settings, report)
    (only,) = report.findings
    assert only.check == "message_key"
    return only.status, only.summary, only.fix


def test_no_key_is_a_warning_with_its_fix_and_the_doctor_stays_healthy():
    status, summary, fix = finding()
    assert status == "warning"
    assert summary.startswith("PIPELINE_MESSAGE_KEY is not set: messages are not signed")
    assert "PIPELINE_MESSAGE_KEY=insecure" in fix
    report = Report()
    check_message_key(Settings(), report)
    assert report.healthy
    text = format_report(report).splitlines()
    assert text[0] == "pipeline doctor: healthy"
    assert text[1].startswith("  WARNING message_key: PIPELINE_MESSAGE_KEY is not set")
    assert text[2].startswith("          fix: set the same PIPELINE_MESSAGE_KEY")


@pytest.mark.parametrize("off", ["insecure", "none"])
def test_signing_off_on_purpose_is_information(off):
    status, summary, _ = finding(message_key=off)
    assert status == "info"
    assert summary.startswith(f"PIPELINE_MESSAGE_KEY={off}: messages are not signed, on purpose")


def test_a_key_is_ok_and_names_the_rotation():
    assert finding(message_key=KEY)[:2] == (
        "ok",
        "messages are signed; workers accept the current key only",
    )
    assert finding(message_key=KEY, message_key_previous="p" * 32)[:2] == (
        "ok",
        "messages are signed; workers accept the current key and the previous one only",
    )


def test_accepting_unsigned_messages_beside_a_key_is_a_warning():
    status, summary, fix = finding(message_key=KEY, message_key_previous="insecure")
    assert status == "warning"
    assert "workers still accept unsigned ones" in summary
    assert fix == "once every relay signs, unset PIPELINE_MESSAGE_KEY_PREVIOUS on the workers"
