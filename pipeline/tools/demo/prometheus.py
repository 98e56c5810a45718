"""A ready Prometheus set-up for ``pipeline demo --keep-running``.

Writes the ops kit (rules, dashboards and runbooks, rendered from the installed package:
no checkout needed) and a ``prometheus.yml`` that scrapes the demo's relay and workers
under the kit's job names and loads its rules, and says how to start Prometheus on it.
The alerts' and dashboards' runbook links point at the pages written next to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pipeline.tools.opskit import KitOptions, render_kit
from pipeline.tools.opskit.options import runbook_url_for_base
from pipeline.tools.opskit.render import ALERT_RULES, RECORDING_RULES, to_yaml, write_files

SCRAPE_INTERVAL = "5s"


@dataclass(frozen=True)
class PrometheusSetup:
    config: Path
    rules: list[Path]
    data: Path
    dashboards: Path

    def instructions(self) -> list[str]:
        return [
            f"Prometheus config with the pipeline's rules: {self.config}",
            f"  start it: prometheus --config.file={self.config} "
            f"--storage.tsdb.path={self.data} --web.listen-address=127.0.0.1:9090",
            f"  then open http://127.0.0.1:9090/alerts; import {self.dashboards}/*.json into "
            "Grafana with that Prometheus as data source (docs/operations.md)",
        ]


def kit_options(directory: Path) -> KitOptions:
    """The kit as written into ``directory``: runbook links open the pages written there."""
    return KitOptions(runbook_url=runbook_url_for_base((directory / "runbooks").as_uri()))


def target(metrics_url: str) -> str:
    """``host:port`` of a ``http://host:port/metrics`` URL."""
    return urlsplit(metrics_url).netloc


def write_prometheus_setup(directory: Path, relay_url: str, worker_url: str) -> PrometheusSetup:
    directory = directory.resolve()
    options = kit_options(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_files(render_kit(options), directory)
    rules = [directory / RECORDING_RULES, directory / ALERT_RULES]
    config = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [str(path) for path in rules],
        "scrape_configs": [
            {"job_name": options.relay_job, "static_configs": [{"targets": [target(relay_url)]}]},
            {"job_name": options.worker_job, "static_configs": [{"targets": [target(worker_url)]}]},
        ],
    }
    path = directory / "prometheus.yml"
    path.write_text(to_yaml(config))
    return PrometheusSetup(path, rules, directory / "data", directory / "dashboards")
