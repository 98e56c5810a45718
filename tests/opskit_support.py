"""Helpers for the ops-kit tests: the committed rules, dashboards and runbooks, and a real
Prometheus server started from the Debian ``prometheus`` package."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.tools.harness.embedded import free_port
from pipeline.tools.opskit import KitOptions
from tests.support import ROOT, wait_until

ALERTS_DIR = ROOT / "alerts"
DASHBOARDS_DIR = ROOT / "dashboards"
RUNBOOKS_DIR = ROOT / "runbooks"
RULE_FILES = sorted(ALERTS_DIR.glob("*.yaml"))
DASHBOARD_FILES = sorted(DASHBOARDS_DIR.glob("*.json"))

# What Grafana substitutes into a query, as the tests substitute it for Prometheus.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$job": ".+",
    "$instance": ".+",
    "$consumer": ".+",
}


def tool(name: str) -> str:
    """The path of a Prometheus binary; a failure in CI, a skip on a developer's machine."""
    found = shutil.which(name)
    if found:
        return found
    package = "prometheus-alertmanager" if name == "amtool" else "prometheus"
    message = f"{name} is not installed (Debian package {package}: apt-get install {package})"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


# -- the committed kit ----------------------------------------------------------------------

URL = re.compile(r"""(?:https?|file)://[^\s"'`<>)\]]+""")


def runbook_page(url: str, options: KitOptions, root: Path = ROOT) -> Path | None:
    """The rendered page a runbook URL of ``options`` names (under ``root/runbooks``), or
    None when ``url`` is not a runbook URL of that configuration."""
    prefix, suffix = options.runbook_url.split("{name}")
    url = url.split("#", 1)[0]
    if not (url.startswith(prefix) and url.endswith(suffix)):
        return None
    name = url[len(prefix) : len(url) - len(suffix)]
    return root / "runbooks" / f"{name}.md" if re.fullmatch(r"[A-Za-z-]+", name) else None


def urls_in(text: str) -> list[str]:
    return URL.findall(text)


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = []
    for path in RULE_FILES:
        groups += yaml.safe_load(path.read_text())["groups"]
    return groups


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in rule_groups() for rule in group["rules"] if "alert" in rule]


def recording_rules() -> list[dict[str, Any]]:
    return [rule for group in rule_groups() for rule in group["rules"] if "record" in rule]


def dashboards() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in DASHBOARD_FILES}


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    expr: str

    @property
    def promql(self) -> str:
        """The query as Grafana sends it with every variable at "All"."""
        text = self.expr
        for variable, value in GRAFANA_VARIABLES.items():
            text = text.replace(variable, value)
        assert "$" not in text, f"unsubstituted variable in {self}"
        return text


def panel_queries() -> list[PanelQuery]:
    return [
        PanelQuery(board["uid"], panel["title"], target["expr"])
        for board in dashboards().values()
        for panel in panels(board)
        for target in panel["targets"]
    ]


METRIC = re.compile(r"\b(pipeline_[a-z_]+|up)\b(?=\s*[{\[)\s])")


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (histogram series folded to their family)."""
    found = set()
    for name in METRIC.findall(expr):
        found.add(name)
    return found


def family(name: str) -> str:
    """A series or family name reduced to its family (OpenMetrics style: no ``_total``)."""
    return re.sub(r"_(bucket|count|sum|total)$", "", name)


def check_rule_expressions(exprs: list[str], tmp_path: Path) -> None:
    """Every expression parses: promtool checks them as recording rules of a temporary file."""
    rules = [{"record": f"check:expression_{i}:parses", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "expressions.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "expressions", "rules": rules}]}))
    result = subprocess.run(
        [tool("promtool"), "check", "rules", str(path)], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- runbooks -------------------------------------------------------------------------------

STEP = re.compile(r"^( *)```sh step\n(.*?)^\1```$", re.MULTILINE | re.DOTALL)


def runbook_steps(name: str) -> list[str]:
    """The fenced ``sh step`` blocks of a runbook page, in order: what an operator runs."""
    text = (RUNBOOKS_DIR / f"{name}.md").read_text()
    return [textwrap.dedent(body) for _, body in STEP.findall(text)]


# -- a test copy of the rules, with short durations ------------------------------------------

DURATION = re.compile(r"(\d+)([smhd])")
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
TIME_SCALE = 30  # every `for:` and range window is this many times shorter in the test copy


def _scaled(text: str, floor: int, scale: int = TIME_SCALE) -> str:
    seconds = sum(int(n) * SECONDS[unit] for n, unit in DURATION.findall(text))
    return f"{max(floor, seconds // scale)}s"


def shortened_rules(
    groups: list[dict[str, Any]], for_scale: int = TIME_SCALE
) -> list[dict[str, Any]]:
    """The rules with range windows TIME_SCALE times shorter and `for:` ``for_scale`` times
    shorter (test copy only). A shorter `for:` changes only how soon a pending alert fires:
    which alerts go pending is the expressions' and windows' business."""
    copy = json.loads(json.dumps(groups))
    for group in copy:
        for rule in group["rules"]:
            rule["expr"] = re.sub(
                r"\[(\d+[smhd])\]", lambda m: f"[{_scaled(m.group(1), 10)}]", rule["expr"]
            )
            rule["expr"] = re.sub(
                r"offset (\d+[smhd])", lambda m: f"offset {_scaled(m.group(1), 10)}", rule["expr"]
            )
            if "for" in rule:
                rule["for"] = _scaled(rule["for"], 2, for_scale)
    return copy


# -- a real Prometheus ----------------------------------------------------------------------


class Prometheus:
    """A Prometheus server of the test's own: config, port and data directory in tmp."""

    def __init__(self, directory: Path, targets: dict[str, str], rules: list[dict[str, Any]]):
        self.directory = directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        rules_path = directory / "rules.yaml"
        rules_path.write_text(yaml.safe_dump({"groups": rules}, sort_keys=False))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules_path)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [target]}]}
                for job, target in targets.items()
            ],
        }
        self.config_path = directory / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = directory / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None

    @classmethod
    def from_config(cls, config: Path, directory: Path) -> Prometheus:
        """A server on ``config`` as written by someone else (e.g. ``pipeline demo``)."""
        server = cls.__new__(cls)
        server.directory = directory
        server.port = free_port()
        server.url = f"http://127.0.0.1:{server.port}"
        server.config_path = config
        server.log = directory / "prometheus.log"
        server.process = None
        return server

    def start(self) -> None:
        argv = [
            tool("prometheus"),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--web.enable-lifecycle",
        ]
        handle = self.log.open("wb")
        self.process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT)
        wait_until(self._ready, timeout=60, interval=0.2)

    def _ready(self) -> bool:
        assert self.process is not None and self.process.poll() is None, self.log.read_text()
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read())
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets")["activeTargets"])

    def rules(self) -> list[dict[str, Any]]:
        return [rule for group in self.api("rules")["groups"] for rule in group["rules"]]

    def alerts(self, state: str = "firing") -> list[dict[str, Any]]:
        return [a for a in self.api("alerts")["alerts"] if a["state"] == state]

    def firing(self, name: str, **labels: str) -> list[dict[str, Any]]:
        return [
            alert
            for alert in self.alerts()
            if alert["labels"]["alertname"] == name
            and all(alert["labels"].get(k) == v for k, v in labels.items())
        ]

    def wait_firing(self, name: str, timeout: float, **labels: str) -> dict[str, Any]:
        found = wait_until(lambda: self.firing(name, **labels), timeout=timeout, interval=0.5)
        return dict(found[0])

    def wait_resolved(self, name: str, timeout: float, **labels: str) -> None:
        wait_until(
            lambda: (
                not [
                    a
                    for a in self.api("alerts")["alerts"]
                    if a["labels"]["alertname"] == name
                    and all(a["labels"].get(k) == v for k, v in labels.items())
                ]
            ),
            timeout=timeout,
            interval=0.5,
        )

    def metric_names(self) -> set[str]:
        return set(self.api("label/__name__/values"))
