"""alerts/ and dashboards/ are what pipeline.tools.opskit renders: edit the code, then render."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from pipeline.tools.cli import cli
from pipeline.tools.cli.opskit import opskit
from pipeline.tools.opskit import KitOptions, render_kit
from tests.support import ROOT


def render(*argv: str) -> tuple[int, str]:
    """``pipeline opskit ARGV`` in-process: exit code and stderr."""
    result = CliRunner().invoke(cli, ["opskit", *argv], prog_name="pipeline")
    return result.exit_code, result.stderr


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
    assert not stale, f"render again with `pipeline opskit`: {stale}"


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
