"""What differs between deployments of the ops kit: job names, base URLs, the latency SLO.

The committed files in ``alerts/`` and ``dashboards/`` are rendered with the defaults
below; ``pipeline opskit`` renders them again with a deployment's own values
(see docs/operations.md). Everything else in the kit is the same everywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.observability.metrics import LATENCY_BUCKETS

_LABEL_VALUE = re.compile(r"^[A-Za-z0-9_.:/-]+$")
_LABEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

OVERVIEW_UID = "pipeline-overview"
RELAY_UID = "pipeline-relay"
CONSUMERS_UID = "pipeline-consumers"
DASHBOARD_SLUGS = {
    OVERVIEW_UID: "pipeline-overview",
    RELAY_UID: "pipeline-relay",
    CONSUMERS_UID: "pipeline-consumers",
}


@dataclass(frozen=True)
class KitOptions:
    """Parameters of the rendered rules and dashboards.

    ``runbook_url`` is a template with ``{name}`` (an alert or playbook name): the
    default is relative to the repository root, so it resolves in a checkout and in
    the tests; set it to where your team reads the runbooks, e.g.
    ``https://git.example.com/ops/pipeline/blob/main/runbooks/{name}.md``.
    ``group_labels`` are kept by every aggregation (e.g. ``namespace`` or ``cluster``
    when one Prometheus watches several deployments).
    """

    relay_job: str = "pipeline-relay"
    worker_job: str = "pipeline-worker"
    group_labels: tuple[str, ...] = ()
    runbook_url: str = "runbooks/{name}.md"
    grafana_url: str = "http://localhost:3000"
    trace_ui_url: str = "http://localhost:16686"
    latency_slo_seconds: float = 5.0
    latency_slo_target: float = 0.99

    def __post_init__(self) -> None:
        for job in (self.relay_job, self.worker_job):
            if not _LABEL_VALUE.match(job):
                raise ValueError(f"job name {job!r}: use letters, digits and _.:/-")
        for label in self.group_labels:
            if not _LABEL_NAME.match(label) or label in ("job", "instance", "le"):
                raise ValueError(f"group label {label!r} is not a usable label name")
        if "{name}" not in self.runbook_url:
            raise ValueError("runbook_url must contain {name}")
        if self.latency_slo_seconds not in LATENCY_BUCKETS:
            raise ValueError(
                f"latency_slo_seconds must be a histogram bucket boundary: {LATENCY_BUCKETS}"
            )
        if not 0.5 <= self.latency_slo_target < 1:
            raise ValueError("latency_slo_target must be in [0.5, 1)")

    # -- selectors ---------------------------------------------------------------------------
    @property
    def relay(self) -> str:
        """Label matchers of the relays' targets."""
        return f'job="{self.relay_job}"'

    @property
    def worker(self) -> str:
        return f'job="{self.worker_job}"'

    @property
    def pipeline(self) -> str:
        """Label matchers of every pipeline target (relays and workers)."""
        # Job names are letters, digits and _.:/- (checked above): only "." is special in
        # a regular expression, and PromQL strings reject backslash escapes like "\-".
        jobs = "|".join(job.replace(".", "[.]") for job in (self.relay_job, self.worker_job))
        return f'job=~"{jobs}"'

    # -- aggregation -------------------------------------------------------------------------
    def by(self, *labels: str) -> str:
        """A ``by (...)`` clause keeping the group labels and ``labels``; '' for none."""
        kept = [*self.group_labels, *labels]
        return f" by ({', '.join(kept)})" if kept else ""

    def on(self, *labels: str) -> str:
        """An ``on (...)`` matching clause over the group labels and ``labels``."""
        return f" on ({', '.join([*self.group_labels, *labels])})"

    def level(self, *labels: str) -> str:
        """The level part of a recording rule's name (``level:metric:operations``)."""
        return "_".join([*self.group_labels, *labels])

    # -- links -------------------------------------------------------------------------------
    def runbook(self, name: str) -> str:
        return self.runbook_url.format(name=name)

    def dashboard(self, uid: str, query: str = "") -> str:
        url = f"{self.grafana_url.rstrip('/')}/d/{uid}/{DASHBOARD_SLUGS[uid]}"
        return f"{url}?{query}" if query else url

    @property
    def latency_slo_le(self) -> str:
        """The ``le`` label of the SLO's bucket as prometheus_client writes it (``5.0``)."""
        return repr(float(self.latency_slo_seconds))

    @property
    def error_budget(self) -> float:
        return round(1 - self.latency_slo_target, 6)
