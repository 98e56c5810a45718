"""A ready Prometheus set-up for ``pipeline demo --keep-running``.

Writes a ``prometheus.yml`` that scrapes the demo's relay and workers under the ops kit's
job names and loads the kit's recording rules and alerts (rendered next to it), and says
how to start Prometheus on it. When the demo runs from a checkout, the alerts' runbook
links point at the checkout's ``runbooks/`` pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pipeline
from pipeline.tools.opskit import KitOptions, render_rule_files
from pipeline.tools.opskit.render import to_yaml

SCRAPE_INTERVAL = "5s"
CHECKOUT = Path(pipeline.__file__).resolve().parents[1]


@dataclass(frozen=True)
class PrometheusSetup:
    config: Path
    rules: list[Path]
    data: Path

    def instructions(self) -> list[str]:
        return [
            f"Prometheus config with the pipeline's rules: {self.config}",
            f"  start it: prometheus --config.file={self.config} "
            f"--storage.tsdb.path={self.data} --web.listen-address=127.0.0.1:9090",
            "  then open http://127.0.0.1:9090/alerts; import dashboards/*.json into Grafana "
            "with that Prometheus as data source (docs/operations.md)",
        ]


def kit_options() -> KitOptions:
    runbooks = CHECKOUT / "runbooks"
    if (runbooks / "README.md").is_file():
        return KitOptions(runbook_url=runbooks.as_uri() + "/{name}.md")
    return KitOptions()


def target(metrics_url: str) -> str:
    """``host:port`` of a ``http://host:port/metrics`` URL."""
    return urlsplit(metrics_url).netloc


def write_prometheus_setup(directory: Path, relay_url: str, worker_url: str) -> PrometheusSetup:
    options = kit_options()
    directory.mkdir(parents=True, exist_ok=True)
    rules = []
    for relative, text in render_rule_files(options).items():
        path = directory / Path(relative).name
        path.write_text(text)
        rules.append(path)
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
    return PrometheusSetup(path, rules, directory / "data")
