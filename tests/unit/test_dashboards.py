"""The committed Grafana dashboards pass the linter, parse, and link where they should."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from pipeline.tools.opskit import KitOptions
from tests.dashboard_lint import lint, lint_expression
from tests.opskit_support import (
    DASHBOARD_FILES,
    RUNBOOKS_DIR,
    check_rule_expressions,
    dashboards,
    panel_queries,
    panels,
    runbook_page,
)

EXPECTED_UIDS = {
    "pipeline-overview.json": "pipeline-overview",
    "pipeline-relay.json": "pipeline-relay",
    "pipeline-consumers.json": "pipeline-consumers",
}


def test_the_three_dashboards_exist_with_stable_uids_and_a_current_schema():
    boards = dashboards()
    assert {name: board["uid"] for name, board in boards.items()} == EXPECTED_UIDS
    for board in boards.values():
        assert board["schemaVersion"] >= 39
        assert board["id"] is None  # importable into any Grafana
        assert "pipeline" in board["tags"]
        assert len({p["title"] for p in panels(board)}) == len(list(panels(board)))


@pytest.mark.parametrize("name", sorted(EXPECTED_UIDS))
def test_dashboard_passes_the_linter(name):
    assert lint(dashboards()[name]) == []


def test_the_linter_finds_what_it_checks():
    board = copy.deepcopy(dashboards()["pipeline-overview.json"])
    first = next(p for p in board["panels"] if p["type"] != "row")
    first["targets"][0]["expr"] = (
        'sum(rate(pipeline_events_published_total{job=~"$job"}[5m])) '
        '+ sum(pipeline_inbox_processed_total{job=~"$job", instance=~"$instance"})'
    )
    first["fieldConfig"]["defaults"]["unit"] = "events"
    first["description"] = ""
    first["datasource"] = {"type": "prometheus", "uid": "prom-1"}
    board["templating"]["list"] = [v for v in board["templating"]["list"] if v["name"] != "job"]
    board["editable"] = True
    instance = next(v for v in board["templating"]["list"] if v["name"] == "instance")
    instance["label"], instance["refresh"] = "instance", 1
    problems = "\n".join(lint(board))
    for rule in (
        "uneditable-dashboard",
        "template-instance: label must be 'Instance'",
        "template-on-time-change-reload: 'instance'",
        "template-job: no 'job' variable",
        "target-instance: pipeline_events_published_total",
        "target-rate-interval: range [5m]",
        "target-counter-agg: pipeline_inbox_processed_total",
        "panel-units: unit 'events'",
        "panel-title-description",
        "panel-datasource: must use ${datasource}",
        "variable $job is used but not defined",
    ):
        assert rule in problems, problems


def test_the_overview_answers_the_four_questions():
    board = dashboards()["pipeline-overview.json"]
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == [
        "Is it flowing?",
        "How far behind?",
        "What is failing?",
        "What is dead-lettered?",
    ]
    text = json.dumps(board)
    for metric in (
        "pipeline_events_published_total",
        "pipeline_inbox_processed_total",
        "pipeline_outbox_backlog",
        "pipeline_outbox_oldest_pending_age_seconds",
        "pipeline_publish_lag_seconds_bucket",
        "pipeline_end_to_end_latency_seconds_bucket",
        "pipeline_publish_failures_total",
        "pipeline_inbox_failures_total",
        "pipeline_inbox_retries_total",
        "pipeline_inbox_duplicates_total",
        "pipeline_redeliveries_total",
        "pipeline_deliveries_owed",
        "pipeline_dead_letters_waiting",
        "pipeline_dead_letters_total",
        "pipeline_canary_last_success_timestamp_seconds",
        "pipeline_relay_listener_connected",
    ):
        assert metric in text, metric


def test_every_panel_expression_parses(tmp_path):
    queries = panel_queries()
    assert len(queries) > 60
    check_rule_expressions([q.promql for q in queries], tmp_path)


def test_counters_and_ranges_follow_the_rules_in_every_query():
    for query in panel_queries():
        assert lint_expression(query.expr) == [], query


def test_links_resolve():
    """Runbook links are absolute URLs of the configured base and name pages that exist;
    trace links use the trace_ui variable."""
    for board in dashboards().values():
        urls = [link["url"] for link in board["links"] if link["type"] == "link"]
        for panel in panels(board):
            urls += [link["url"] for link in panel.get("links", [])]
            for link in panel["fieldConfig"]["defaults"]["links"]:
                assert link["url"].startswith("${trace_ui}/search?"), link
        assert urls
        for url in urls:
            page = runbook_page(url, KitOptions())
            assert page is not None, f"not a runbook URL of the default base: {url}"
            assert page.is_file(), url
    assert RUNBOOKS_DIR.is_dir()


def test_no_phantom_zero_series():
    """A fallback 0 only where the query has no series at all (``or on() vector(0)``):
    ``sum by (x) (...) or vector(0)`` would add an unlabelled 0 series for good."""
    for query in panel_queries():
        assert not re.search(r"or vector\(0\)", query.expr), query


def test_ratios_never_divide_by_zero():
    ratios = [
        q
        for board in dashboards().values()
        for panel in panels(board)
        if panel["fieldConfig"]["defaults"]["unit"] == "percentunit" and "SLO" not in panel["title"]
        for q in panel["targets"]
    ]
    assert len(ratios) >= 5
    for target in ratios:
        assert "clamp_min(" in target["expr"], target["expr"]
    overview = dashboards()["pipeline-overview.json"]
    [publish] = [p for p in panels(overview) if p["title"] == "Publish failure ratio"]
    expr = publish["targets"][0]["expr"]
    assert "pipeline_publish_attempts_total" not in expr  # per delivery: another unit
    assert "pipeline_events_published_total" in expr


def test_dashboard_files_are_pretty_printed_json():
    for path in DASHBOARD_FILES:
        text = Path(path).read_text()
        assert text == json.dumps(json.loads(text), indent=2) + "\n"
