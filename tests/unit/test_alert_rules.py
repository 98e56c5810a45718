"""The committed Prometheus rules: promtool's checks and unit tests, and the kit's hygiene.

promtool comes from Debian's ``prometheus`` package (``.ci/run`` installs it); without it
these tests fail in CI and skip on a developer's machine.
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any

import pytest
import yaml

from tests.opskit_support import (
    ALERTS_DIR,
    RULE_FILES,
    alert_rules,
    dashboards,
    family,
    metric_names,
    recording_rules,
    tool,
)
from tests.support import ROOT

TEST_FILES = sorted((ALERTS_DIR / "tests").glob("*.yaml"))
REQUIRED = {
    "PipelineRelayDown",
    "PipelineWorkersDown",
    "PipelineTargetDown",
    "PipelineRelayListenerDown",
    "PipelineRelayClockSkewed",
    "PipelineNotificationsMissing",
    "PipelinePostgresUnreachable",
    "PipelineRedisUnreachable",
    "PipelineStateMetricsStale",
    "PipelineStateMetricsAbsent",
    "PipelineEventsUnrouted",
    "PipelineUnauthenticMessages",
    "PipelineOutboxBacklogGrowing",
    "PipelineOldestPendingEventTooOld",
    "PipelinePublishFailureRatioHigh",
    "PipelineDeadLettersWaiting",
    "PipelineConsumerFailureRatioHigh",
    "PipelineConsumerQueueGrowing",
    "PipelineRedeliveriesSpiking",
    "PipelineDuplicateRatioHigh",
    "PipelineDeliveriesOwed",
    "PipelineCanaryStale",
    "PipelineLatencyBudgetBurn",
    "PipelineWatchdog",
}


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    # GOGC=400: promtool's rule tests spend a fifth of their CPU collecting garbage otherwise
    env = {**os.environ, "GOGC": "400"}
    return subprocess.run(argv, capture_output=True, text=True, check=False, cwd=ROOT, env=env)


def test_promtool_check_rules_with_every_lint_fatal():
    result = run(
        tool("promtool"), "check", "rules", "--lint=all", "--lint-fatal", *map(str, RULE_FILES)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(RULE_FILES)


def test_there_are_promtool_unit_tests_for_every_area():
    assert {path.stem for path in TEST_FILES} >= {"availability", "flow", "meta", "slo"}


@pytest.mark.parametrize("test_file", TEST_FILES, ids=lambda path: path.stem)
def test_promtool_unit_tests_pass(test_file):
    """One file per test: slo.yaml alone evaluates days of samples, and runs beside the rest."""
    result = run(tool("promtool"), "test", "rules", str(test_file))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == 1


def test_promtool_unit_tests_fail_when_a_threshold_moves(tmp_path):
    """The unit tests bite: the same tests against a rule with another threshold fail.

    Only flow.yaml's cases for that alert run (the others would take the time and pass)."""
    (tmp_path / "tests").mkdir()
    for path in RULE_FILES:
        text = path.read_text().replace(":ratio_rate5m > 0.05", ":ratio_rate5m > 0.5")
        (tmp_path / path.name).write_text(text)
    flow = yaml.safe_load((ALERTS_DIR / "tests" / "flow.yaml").read_text())
    flow["tests"] = [
        case
        for case in flow["tests"]
        if {check["alertname"] for check in case.get("alert_rule_test", [])}
        == {"PipelinePublishFailureRatioHigh"}
    ]
    assert len(flow["tests"]) >= 2  # the firing cases and the quiet one
    (tmp_path / "tests" / "flow.yaml").write_text(yaml.safe_dump(flow, sort_keys=False))
    result = run(tool("promtool"), "test", "rules", str(tmp_path / "tests" / "flow.yaml"))
    assert result.returncode != 0
    assert "alertname: PipelinePublishFailureRatioHigh" in result.stdout + result.stderr


def test_every_required_alert_exists():
    assert {rule["alert"] for rule in alert_rules()} == REQUIRED


def test_alert_hygiene():
    for rule in alert_rules():
        name = rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url", "dashboard_url"}
        assert annotations["summary"].endswith("."), name
        if name != "PipelineWatchdog":  # no labels or value worth naming
            assert re.search(r"\{\{ \$(labels\.\w+|value)", annotations["description"]), name
            seconds = _seconds(rule["for"])
            assert seconds >= 60, f"{name}: for {rule['for']} does not ride out a scrape gap"


def _seconds(duration: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([smhd])", duration))


def test_burn_rate_windows():
    burns = [r for r in alert_rules() if r["alert"] == "PipelineLatencyBudgetBurn"]
    windows = {(r["labels"]["long_window"], r["labels"]["short_window"]): r for r in burns}
    assert set(windows) == {("1h", "5m"), ("6h", "30m"), ("3d", "6h")}
    for (long, short), factor in {
        ("1h", "5m"): 14.4,
        ("6h", "30m"): 6.0,
        ("3d", "6h"): 1.0,
    }.items():
        expr = windows[(long, short)]["expr"]
        assert f"slo_miss_ratio_rate{long} > ({factor} * 0.01)" in expr
        assert f"slo_miss_ratio_rate{short} > ({factor} * 0.01)" in expr
    assert 'le="5.0"' in "".join(r["expr"] for r in recording_rules())


def test_recording_rules_are_named_level_metric_operations():
    for rule in recording_rules():
        assert re.fullmatch(r"[a-z_]*:pipeline_[a-z_]+:[a-z0-9_]+", rule["record"]), rule


def test_every_metric_a_rule_uses_is_documented():
    text = (ROOT / "docs" / "metrics.md").read_text()
    documented = {family(n) for n in re.findall(r"^\| `(pipeline_\w+)`", text, re.MULTILINE)}
    for rule in alert_rules() + recording_rules():
        for name in metric_names(rule["expr"]) - {"up"}:
            assert family(name) in documented, f"{name} in {rule.get('alert') or rule['record']}"


def test_dashboard_urls_name_a_dashboard_and_its_variables():
    boards = {board["uid"]: board for board in dashboards().values()}
    for rule in alert_rules():
        url = rule["annotations"]["dashboard_url"]
        match = re.fullmatch(r"http://localhost:3000/d/([a-z-]+)/([a-z-]+)(?:\?(.*))?", url)
        assert match, url
        uid, _slug, query = match.groups()
        assert uid in boards, url
        variables = {v["name"] for v in boards[uid]["templating"]["list"]}
        for parameter in (query or "").split("&"):
            if parameter:
                assert parameter.split("=")[0].removeprefix("var-") in variables, url


def test_every_alert_has_a_firing_and_a_not_firing_case():
    """Per alert (per burn-rate window): a test expecting it, and one expecting it absent."""
    rules = alert_rules()  # parsed once: the YAML is slow to read for every check
    every = {_key(r["alert"], r["labels"]) for r in rules}
    fires: set[str] = set()
    quiet: set[str] = set()
    for path in TEST_FILES:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                keys = _expected_keys(check)
                fires |= keys
                possible = {
                    _key(r["alert"], r["labels"]) for r in rules if r["alert"] == check["alertname"]
                }
                quiet |= possible - keys
    assert fires >= every, sorted(every - fires)
    assert quiet >= every - {"PipelineWatchdog"}, sorted(every - {"PipelineWatchdog"} - quiet)


def _key(name: str, labels: dict[str, Any]) -> str:
    window = labels.get("long_window")
    return f"{name}/{window}" if window else name


def _expected_keys(check: dict[str, Any]) -> set[str]:
    return {_key(check["alertname"], a.get("exp_labels", {})) for a in check.get("exp_alerts", [])}


def test_rule_files_are_what_yaml_reads():
    for path in RULE_FILES:
        assert yaml.safe_load(path.read_text())["groups"]


def test_operations_doc_tables_every_alert_with_its_runbook():
    text = (ROOT / "docs" / "operations.md").read_text()
    for name in REQUIRED:
        row = next((line for line in text.splitlines() if line.startswith(f"| `{name}` |")), "")
        assert f"(../runbooks/{name}.md)" in row, name
