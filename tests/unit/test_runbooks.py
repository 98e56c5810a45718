"""Runbooks: a page per alert with the required sections, the playbooks, working links,
PromQL that parses, `pipeline` commands that the CLI accepts, and a last section that
verifies recovery with the alert's own condition."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pipeline.tools.opskit import KitOptions
from tests.opskit_support import (
    RUNBOOKS_DIR,
    alert_rules,
    check_rule_expressions,
    runbook_page,
    runbook_steps,
    urls_in,
)
from tests.unit.test_compose import check_pipeline_command

SECTIONS = ("Meaning", "Impact", "Diagnosis", "Mitigation", "Escalation", "Verify recovery")
KIT = KitOptions()
PLAYBOOKS = (
    "relay-down",
    "broker-down",
    "postgres-down",
    "consumer-crash-loop",
    "poison-message",
    "outbox-growing",
    "redelivery-storm",
    "clock-skew",
    "replay-dead-letters",
    "sentinel-failover",
    "partitioned-worker-host",
)
PAGES = sorted(p for p in RUNBOOKS_DIR.glob("*.md") if p.name != "README.md")
FENCE = re.compile(r"^( *)```(\w+)[^\n]*\n(.*?)^\1```$", re.MULTILINE | re.DOTALL)


def blocks(page: Path, language: str) -> list[str]:
    return [
        re.sub(r"(?m)^" + indent, "", body)
        for indent, lang, body in FENCE.findall(page.read_text())
        if lang == language
    ]


def headings(page: Path) -> list[str]:
    return re.findall(r"^## (.+)$", page.read_text(), re.MULTILINE)


def test_every_alert_has_a_page_and_every_page_an_index_entry():
    names = {rule["alert"] for rule in alert_rules()}
    assert names <= {p.stem for p in PAGES}
    assert set(PLAYBOOKS) <= {p.stem for p in PAGES}
    assert {p.stem for p in PAGES} == names | set(PLAYBOOKS)  # no orphan pages
    index = (RUNBOOKS_DIR / "README.md").read_text()
    for page in PAGES:
        assert f"]({KIT.runbook(page.stem)})" in index, page.name


def test_every_runbook_url_resolves_to_a_page_with_the_required_sections():
    for rule in alert_rules():
        url = rule["annotations"]["runbook_url"]
        assert url == KIT.runbook(rule["alert"])
        page = runbook_page(url, KIT)
        assert page is not None and page.is_file(), url
        assert page.read_text().startswith(f"# {rule['alert']}\n")
        assert [h for h in headings(page) if h in SECTIONS] == list(SECTIONS), url


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_page_sections_and_diagnosis_content(page):
    found = headings(page)
    assert [h for h in found if h in SECTIONS] == list(SECTIONS)
    assert found[-1] == "Verify recovery", "every page ends with how to verify recovery"
    diagnosis = page.read_text().split("## Diagnosis", 1)[1].split("\n## ", 1)[0]
    assert "```promql" in diagnosis, "Diagnosis needs the exact PromQL"
    assert re.search(r"^\s*pipeline \w+", diagnosis, re.MULTILINE), "and pipeline commands"
    assert re.search(r"trace|Traces", diagnosis), "and where to look in traces"


def test_links_between_pages_resolve():
    """Links between pages are absolute runbook URLs (a page opened from Grafana or copied
    into a wiki still links), each to a page that exists; no relative link is left."""
    for page in [*PAGES, RUNBOOKS_DIR / "README.md"]:
        text = page.read_text()
        assert not re.findall(r"\]\((?![a-z]+://)[^)]*\)", text), page.name
        for url in urls_in(text):
            target = runbook_page(url, KIT)
            if target is not None:
                assert target.is_file(), f"{page.name} links {url}"


def test_every_alert_page_verifies_recovery_with_its_own_condition():
    """The last section of an alert's page shows that alert's expression as rendered (the
    condition that fired it, not every problem at once)."""
    for rule in alert_rules():
        page = RUNBOOKS_DIR / f"{rule['alert']}.md"
        verify = page.read_text().split("\n## Verify recovery\n", 1)[1]
        assert rule["expr"] in verify, rule["alert"]


def test_the_dead_letters_page_lists_the_alerts_stage_however_old():
    text = (RUNBOOKS_DIR / "PipelineDeadLettersWaiting.md").read_text()
    assert 'pipeline dlq list --stage "$STAGE" --waiting' in text
    assert "--since" not in text


def test_relay_down_waits_on_the_backlog_only_and_curl_fails_loudly():
    [wait] = [step for step in runbook_steps("relay-down") if "timeout" in step]
    assert "oldest_pending_age_seconds" in wait
    assert "until pipeline status --max-pending-age" not in wait
    for page in PAGES:
        for line in page.read_text().splitlines():
            if "curl " in line:
                assert "curl -sS --fail " in line, f"{page.name}: {line}"


def test_pages_of_alerts_by_transport_say_what_to_do_on_each_transport():
    """An alert that keeps a ``transport`` label fires for Redis and for RabbitMQ under one
    name: its page, and the playbooks it links (lower-case names), must tell the on-call
    what to look at on either, not only on Redis."""
    by_transport = [rule for rule in alert_rules() if "transport" in rule["expr"]]
    assert by_transport, "no alert keeps the transport label"
    for rule in by_transport:
        page = RUNBOOKS_DIR / f"{rule['alert']}.md"
        playbooks = set(re.findall(r"/([a-z][a-z-]+\.md)\)", page.read_text()))
        assert playbooks, rule["alert"]
        for shown in [page, *(RUNBOOKS_DIR / name for name in sorted(playbooks))]:
            text = shown.read_text()
            assert 'transport="rabbitmq"' in text, shown.name
            assert "rabbitmq-diagnostics" in text, shown.name


def test_every_promql_block_parses(tmp_path):
    exprs = [b.strip() for page in PAGES for b in blocks(page, "promql")]
    assert len(exprs) > 40
    check_rule_expressions(exprs, tmp_path)


EXAMPLES = {
    "EVENT_ID": "0190c5a4-0000-7000-8000-000000000001",
    "DEAD_LETTER_ID": "41",
    "STAGE": "consume",
    "FINGERPRINT": "3b1f0c9a7d22",
    "APP_MODULES": "shop.consumers",
}


def example(match: re.Match[str]) -> str:
    """A value for a shell variable the page asks the operator to set."""
    return EXAMPLES.get(match.group(1), match.group(1).lower())


def pipeline_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for block in blocks(page, "sh"):
            for raw in block.splitlines():
                line = re.sub(r"\$\{?([A-Z_]+)\}?", example, raw.strip())
                if line.startswith("pipeline "):
                    found.append((page.stem, shlex.split(line)[1:]))
                elif "pipeline " in line:  # inside sh -c '...' or after nohup
                    for inner in re.findall(r"(?:^|[\s'(])pipeline ([^;'&>|)]+)", line):
                        found.append((page.stem, shlex.split(inner)))
    return found


def test_runbook_pipeline_commands_parse_with_the_real_cli():
    """Every `pipeline ...` line in a runbook's sh blocks is accepted by the CLI, with
    example values for the shell variables the pages use."""
    commands = pipeline_commands()
    assert len(commands) > 30
    for page, args in commands:
        try:
            check_pipeline_command(args)
        except Exception as exc:
            raise AssertionError(f"{page}: pipeline {shlex.join(args)}: {exc}") from exc


def test_verified_playbooks_have_step_blocks():
    assert len(runbook_steps("relay-down")) == 4
    assert len(runbook_steps("poison-message")) == 7
