"""alerts/ and dashboards/ are what pipeline.tools.opskit renders: edit the code, then render."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.tools.opskit import KitOptions, render_kit
from pipeline.tools.opskit.__main__ import main
from tests.support import ROOT


def test_committed_files_equal_the_rendered_kit():
    rendered = render_kit(KitOptions())
    assert set(rendered) == {
        "alerts/pipeline-recording-rules.yaml",
        "alerts/pipeline-alerts.yaml",
        "dashboards/pipeline-overview.json",
        "dashboards/pipeline-relay.json",
        "dashboards/pipeline-consumers.json",
    }
    stale = [path for path, text in rendered.items() if (ROOT / path).read_text() != text]
    assert not stale, f"render again with `python -m pipeline.tools.opskit`: {stale}"


def test_check_mode_reports_a_stale_file(tmp_path, capsys):
    assert main(["--out", str(tmp_path)]) == 0
    assert main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "dashboards" / "pipeline-relay.json").write_text("{}\n")
    assert main(["--out", str(tmp_path), "--check"]) == 1
    assert "differs from the code: dashboards/pipeline-relay.json" in capsys.readouterr().err


def test_a_deployment_renders_its_own_jobs_links_and_group_labels(tmp_path):
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
    ],
)
def test_bad_options_are_one_line_and_exit_2(argv, message, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
