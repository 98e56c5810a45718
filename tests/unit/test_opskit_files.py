"""alerts/, dashboards/ and runbooks/ are what pipeline.tools.opskit renders: edit the code
(or the page templates in pipeline/tools/opskit/pages/), then render."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from pipeline.tools.cli import cli
from pipeline.tools.cli.opskit import THRESHOLD_FLAGS, opskit
from pipeline.tools.opskit import KitOptions, render_kit
from pipeline.tools.opskit.options import THRESHOLDS
from pipeline.tools.opskit.runbooks import templates
from tests.dashboard_lint import lint
from tests.opskit_support import runbook_page, urls_in
from tests.support import ROOT, cli_argv


def render(*argv: str) -> tuple[int, str]:
    """``pipeline opskit ARGV`` in-process: exit code and stderr."""
    result = CliRunner().invoke(cli, ["opskit", *argv], prog_name="pipeline")
    return result.exit_code, result.stderr


def test_committed_files_equal_the_rendered_kit():
    rendered = render_kit(KitOptions())
    pages = {f"runbooks/{name}.md" for name in templates()}
    assert len(pages) > 30
    assert set(rendered) == {
        "alerts/pipeline-recording-rules.yaml",
        "alerts/pipeline-alerts.yaml",
        "dashboards/pipeline-overview.json",
        "dashboards/pipeline-relay.json",
        "dashboards/pipeline-consumers.json",
        *pages,
    }
    stale = [path for path, text in rendered.items() if (ROOT / path).read_text() != text]
    assert not stale, f"render again with `pipeline opskit`: {stale}"
    committed = {f"runbooks/{p.name}" for p in (ROOT / "runbooks").glob("*")}
    assert committed == pages  # no page left over from a template that is gone


def test_check_mode_reports_a_stale_file(tmp_path):
    assert render("--out", str(tmp_path)) == (0, "")
    assert render("--out", str(tmp_path), "--check") == (0, "")
    (tmp_path / "dashboards" / "pipeline-relay.json").write_text("{}\n")
    code, err = render("--out", str(tmp_path), "--check")
    assert code == 1
    assert err == "differs from the code: dashboards/pipeline-relay.json\n"


def test_a_deployment_renders_its_own_jobs_links_and_group_labels(tmp_path):
    # As docs/operations.md says: `python -m pipeline.tools.opskit`, in a process of its own.
    argv = [sys.executable, "-m", "pipeline.tools.opskit", "--out", str(tmp_path)]
    argv += ["--relay-job", "outbox-relay", "--worker-job", "outbox-worker"]
    argv += ["--group-label", "namespace", "--grafana-url", "https://grafana.example.com/"]
    argv += ["--runbook-url", "https://git.example.com/ops/pipeline/blob/main/runbooks/{name}.md"]
    result = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    alerts = (tmp_path / "alerts" / "pipeline-alerts.yaml").read_text()
    recording = (tmp_path / "alerts" / "pipeline-recording-rules.yaml").read_text()
    assert 'up{job="outbox-relay"}' in alerts
    assert 'job=~"outbox-relay|outbox-worker"' in recording
    assert 'job="pipeline-relay"' not in alerts + recording
    assert "namespace:pipeline_outbox_backlog:sum" in recording
    assert "sum by (namespace) (max by (namespace, status)" in recording
    assert "https://git.example.com/ops/pipeline/blob/main/runbooks/PipelineRelayDown.md" in alerts
    assert "https://grafana.example.com/d/pipeline-relay/pipeline-relay" in alerts
    overview = (tmp_path / "dashboards" / "pipeline-overview.json").read_text()
    assert "https://git.example.com/ops/pipeline/blob/main/runbooks/README.md" in overview


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--relay-job", 'x"y'], "job name"),
        (["--group-label", "job"], "group label"),
        (["--runbook-url", "https://example.com/runbooks/"], "{name}"),
        (["--runbook-url", "runbooks/{name}.md"], "must be absolute"),
        (["--runbook-base-url", "/srv/runbooks"], "must be absolute"),
        (
            ["--runbook-base-url", "https://a.example", "--runbook-url", "https://b/{name}"],
            "not both",
        ),
        (["--publish-failure-ratio", "5"], "share"),
        (["--latency-slo-seconds", "7"], "bucket"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(argv, message, tmp_path):
    code, err = render(*argv, "--out", str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and message in err
    assert err.startswith("pipeline: error: ") and "'pipeline opskit --help'" in err
    prog = "python -m pipeline.tools.opskit"
    alone = CliRunner().invoke(opskit, [*argv, "--out", str(tmp_path)], prog_name=prog)
    assert alone.exit_code == 2 and alone.stderr.count("\n") == 1
    assert alone.stderr.startswith(f"{prog}: error: ") and message in alone.stderr


# -- links -----------------------------------------------------------------------------------


def check_runbook_urls(files: dict[str, str], options: KitOptions, root: Path) -> int:
    """Every URL in the rendered files that is under the runbook base names a rendered
    page; no file has a relative runbook link. Returns how many runbook URLs there were."""
    prefix = options.runbook_url.split("{name}")[0]
    found = 0
    for path, text in files.items():
        assert "runbooks/{name}" not in text and '"runbooks/' not in text, path
        assert "runbook_url: runbooks/" not in text, path
        for url in urls_in(text):
            if url.startswith(prefix):
                page = runbook_page(url, options, root)
                assert page is not None and page.is_file(), f"{path}: {url}"
                found += 1
    return found


def test_every_runbook_url_in_the_committed_files_resolves_against_the_default_base():
    files = render_kit(KitOptions())
    assert KitOptions().runbook_url.startswith("http://localhost:8088/")
    assert check_runbook_urls(files, KitOptions(), ROOT) > 100


def test_every_runbook_url_resolves_against_a_configured_base(tmp_path):
    base = "https://runbooks.example.com/ops/pipeline"
    result = CliRunner().invoke(
        cli, ["opskit", "export", str(tmp_path), "--runbook-base-url", base + "/"]
    )
    assert result.exit_code == 0, result.output
    files = {
        str(path.relative_to(tmp_path)): path.read_text()
        for path in tmp_path.rglob("*")
        if path.is_file()
    }
    options = KitOptions(runbook_url=base + "/{name}.md")
    assert check_runbook_urls(files, options, tmp_path) > 100
    assert "http://localhost:8088" not in "".join(files.values())
    alerts = yaml.safe_load(files["alerts/pipeline-alerts.yaml"])
    urls = [r["annotations"]["runbook_url"] for g in alerts["groups"] for r in g["rules"]]
    assert f"{base}/PipelineRelayDown.md" in urls


# -- export ----------------------------------------------------------------------------------


def test_export_writes_what_an_installed_package_needs(tmp_path):
    """`pipeline opskit export DIR` writes rules, dashboards and runbooks from package data,
    rendered with the options given; nothing is read from the checkout."""
    out = tmp_path / "kit"
    argv = cli_argv("opskit", "export", str(out))
    argv += ["--relay-job", "outbox-relay", "--backlog-threshold", "5000"]
    argv += ["--runbook-base-url", "https://wiki.example.com/pipeline"]
    result = subprocess.run(
        argv, capture_output=True, text=True, check=False, cwd=tmp_path, timeout=120
    )
    assert result.returncode == 0, result.stderr
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert written == sorted(render_kit(KitOptions()))
    assert result.stdout.count("\n") == len(written)
    assert "wrote" in result.stderr and "https://wiki.example.com/pipeline" in result.stderr
    assert "runbook links point at" not in result.stderr  # a base was given
    alerts = (out / "alerts" / "pipeline-alerts.yaml").read_text()
    assert "pipeline_outbox_backlog:sum > 5000" in alerts
    assert 'up{job="outbox-relay"}' in alerts
    page = (out / "runbooks" / "PipelineOutboxBacklogGrowing.md").read_text()
    assert "pipeline_outbox_backlog:sum > 5000" in page  # its Verify recovery section
    relay_down = (out / "runbooks" / "relay-down.md").read_text()
    assert 'up{job="outbox-relay"}' in relay_down
    assert "](https://wiki.example.com/pipeline/PipelineRelayDown.md)" in relay_down


def test_export_warns_when_runbook_links_keep_the_compose_placeholder(tmp_path):
    result = CliRunner().invoke(cli, ["opskit", "export", str(tmp_path)])
    assert result.exit_code == 0
    assert "runbook links point at http://localhost:8088" in result.stderr


def test_the_page_templates_are_package_data():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"tools/opskit/pages/*.md"' in pyproject
    assert set(templates()) == {p.stem for p in (ROOT / "runbooks").glob("*.md")}


# -- options ---------------------------------------------------------------------------------


def names(files: dict[str, str]) -> set[str]:
    groups = yaml.safe_load(files["alerts/pipeline-alerts.yaml"])["groups"]
    return {rule["alert"] for group in groups for rule in group["rules"]}


def panel_titles(files: dict[str, str]) -> set[str]:
    titles = set()
    for path, text in files.items():
        if path.startswith("dashboards/"):
            titles |= {p["title"] for p in json.loads(text)["panels"]}
    return titles


def test_no_canary_and_no_listen_remove_the_alerts_that_would_fire_forever():
    default = render_kit(KitOptions())
    assert {"PipelineCanaryStale", "PipelineRelayListenerDown"} <= names(default)
    no_canary = render_kit(KitOptions(canary=False))
    assert names(default) - names(no_canary) == {"PipelineCanaryStale"}
    assert panel_titles(default) - panel_titles(no_canary) == {"Canary age", "Canary latency"}
    no_listen = render_kit(KitOptions(listen=False))
    assert names(default) - names(no_listen) == {
        "PipelineRelayListenerDown",
        "PipelineNotificationsMissing",
    }
    code, err = render("--no-canary", "--no-listen", "--check", "--out", str(ROOT))
    assert code == 1  # the committed files are the default's, so they differ
    assert "differs from the code: alerts/pipeline-alerts.yaml" in err


def test_every_threshold_has_a_flag_and_lands_in_rules_and_runbooks(tmp_path):
    assert set(THRESHOLD_FLAGS) == set(THRESHOLDS)
    argv = ["--out", str(tmp_path)]
    values = {
        "backlog_threshold": "4321",
        "oldest_pending_seconds": "987",
        "publish_failure_ratio": "0.07",
        "consumer_failure_ratio": "0.33",
        "queue_depth_threshold": "444",
        "redeliveries_per_second": "0.09",
        "duplicate_ratio": "0.41",
        "canary_stale_seconds": "321",
        "state_metrics_stale_seconds": "654",
    }
    assert set(values) == set(THRESHOLDS)
    for name, value in values.items():
        argv += ["--" + name.replace("_", "-"), value]
    argv += ["--latency-slo-seconds", "10", "--latency-slo-target", "0.995"]
    assert render(*argv) == (0, "")
    alerts = (tmp_path / "alerts" / "pipeline-alerts.yaml").read_text()
    recording = (tmp_path / "alerts" / "pipeline-recording-rules.yaml").read_text()
    for value in values.values():
        assert f"> {value}" in alerts, value
    assert "(14.4 * 0.005)" in alerts and 'le="10.0"' in recording
    index = (tmp_path / "runbooks" / "README.md").read_text()
    for name in ("backlog_threshold", "oldest_pending_seconds", "state_metrics_stale_seconds"):
        assert values[name] in index, name


def test_group_labels_reach_rules_and_dashboards():
    files = render_kit(KitOptions(group_labels=("cluster", "namespace")))
    for path, text in files.items():
        if not path.startswith("dashboards/"):
            continue
        board = json.loads(text)
        assert lint(board) == [], path
        variables = [v["name"] for v in board["templating"]["list"]]
        assert variables[:5] == ["datasource", "cluster", "namespace", "job", "instance"]
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                for selector in target["expr"].split('job=~"$job"')[:-1]:
                    assert selector.endswith('cluster=~"$cluster", namespace=~"$namespace", ')
    recording = files["alerts/pipeline-recording-rules.yaml"]
    assert "cluster_namespace:pipeline_outbox_backlog:sum" in recording


def test_event_types_unrouted_on_purpose_are_left_out_of_the_unrouted_alert(tmp_path):
    assert render("--out", str(tmp_path), "--allowed-unrouted-type", "audit.noted") == (0, "")
    alerts = yaml.safe_load((tmp_path / "alerts" / "pipeline-alerts.yaml").read_text())
    [rule] = [
        r
        for g in alerts["groups"]
        for r in g["rules"]
        if r.get("alert") == "PipelineEventsUnrouted"
    ]
    assert rule["expr"].count('event_type!~"audit[.]noted"') == 3
    code, err = render("--out", str(tmp_path), "--allowed-unrouted-type", 'a"b')
    assert code == 2 and "event type" in err


def test_the_demos_prometheus_setup_writes_the_kit_its_links_open(tmp_path):
    """`pipeline demo --keep-running` writes rules, dashboards and runbooks from the package
    (no checkout needed); every runbook link is a file:// URL of a page written there."""
    from pipeline.tools.demo.prometheus import kit_options, write_prometheus_setup

    setup = write_prometheus_setup(
        tmp_path / "prometheus", "http://127.0.0.1:9464/metrics", "http://127.0.0.1:9465/metrics"
    )
    root = (tmp_path / "prometheus").resolve()
    assert all(path.is_file() for path in setup.rules)
    assert sorted(p.name for p in setup.dashboards.glob("*.json")) == [
        "pipeline-consumers.json",
        "pipeline-overview.json",
        "pipeline-relay.json",
    ]
    files = {
        str(path.relative_to(root)): path.read_text()
        for path in root.rglob("*")
        if path.is_file() and path.name != "prometheus.yml"
    }
    assert check_runbook_urls(files, kit_options(root), root) > 100
    assert f"import {setup.dashboards}/*.json" in " ".join(setup.instructions())
