"""What differs between deployments of the ops kit: job names, base URLs, thresholds, the
latency SLO, and which optional features run.

The committed files in ``alerts/``, ``dashboards/`` and ``runbooks/`` are rendered with the
defaults below; ``pipeline opskit`` renders them again with a deployment's own values
(see docs/operations.md). Everything else in the kit is the same everywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

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

DEFAULT_RUNBOOK_BASE_URL = "http://localhost:8088"
"""Where docker-compose's ``runbooks`` service serves the rendered pages: a placeholder for
every other deployment, which renders the kit with its own ``--runbook-base-url``."""


def runbook_url_for_base(base: str) -> str:
    """The ``runbook_url`` template of pages published under ``base`` as ``<name>.md``."""
    return base.rstrip("/") + "/{name}.md"


THRESHOLDS: dict[str, str] = {
    "backlog_threshold": "Unsent outbox events above which a growing backlog alerts.",
    "oldest_pending_seconds": "Age in seconds of the oldest unsent event that alerts.",
    "publish_failure_ratio": "Share of failed publish attempts that alerts (0-1).",
    "consumer_failure_ratio": "Share of a consumer's failed handler attempts that alerts (0-1).",
    "queue_depth_threshold": "Messages on a consumer queue above which its growth alerts.",
    "redeliveries_per_second": "Re-deliveries per second to one consumer that alert.",
    "duplicate_ratio": "Share of a consumer's deliveries that are duplicates that alerts (0-1).",
    "canary_stale_seconds": "Seconds without a canary crossing the pipeline that alert.",
    "state_metrics_stale_seconds": "Age in seconds of the relay's state metrics that alerts.",
}
"""The alert thresholds a deployment may change, each with its CLI help."""

_RATIOS = ("publish_failure_ratio", "consumer_failure_ratio", "duplicate_ratio")


@dataclass(frozen=True)
class KitOptions:
    """Parameters of the rendered rules, dashboards and runbooks.

    ``runbook_url`` is a template with ``{name}`` (an alert or playbook name) and must be
    an absolute URL: a relative one resolves under Grafana's ``/d/<uid>/`` and is not a URL
    at all in Alertmanager. The default is where docker-compose serves the rendered
    runbooks; set it to where your team reads them, e.g.
    ``https://git.example.com/ops/pipeline/blob/main/runbooks/{name}.md``.
    ``group_labels`` are kept by every aggregation and become dashboard variables (e.g.
    ``namespace`` or ``cluster`` when one Prometheus watches several deployments).
    ``canary=False`` (relays run with ``PIPELINE_CANARY_INTERVAL=0``) drops the canary
    alert and panels; ``listen=False`` (relays run with ``--no-listen``) drops the alerts
    about the LISTEN connection; ``allowed_unrouted_types`` are event types sent to no
    consumer on purpose (relays run with ``--allow-unrouted``), which the unrouted-events
    alert ignores: no alert fires forever by design.
    """

    relay_job: str = "pipeline-relay"
    worker_job: str = "pipeline-worker"
    group_labels: tuple[str, ...] = ()
    runbook_url: str = runbook_url_for_base(DEFAULT_RUNBOOK_BASE_URL)
    grafana_url: str = "http://localhost:3000"
    trace_ui_url: str = "http://localhost:16686"
    latency_slo_seconds: float = 5.0
    latency_slo_target: float = 0.99
    canary: bool = True
    listen: bool = True
    allowed_unrouted_types: tuple[str, ...] = ()
    backlog_threshold: float = 1000
    oldest_pending_seconds: float = 600
    publish_failure_ratio: float = 0.05
    consumer_failure_ratio: float = 0.25
    queue_depth_threshold: float = 100
    redeliveries_per_second: float = 0.05
    duplicate_ratio: float = 0.25
    canary_stale_seconds: float = 120
    state_metrics_stale_seconds: float = 120

    def __post_init__(self) -> None:
        for job in (self.relay_job, self.worker_job):
            if not _LABEL_VALUE.match(job):
                raise ValueError(f"job name {job!r}: use letters, digits and _.:/-")
        for event_type in self.allowed_unrouted_types:
            if not _LABEL_VALUE.match(event_type):
                raise ValueError(f"event type {event_type!r}: use letters, digits and _.:/-")
        for label in self.group_labels:
            if not _LABEL_NAME.match(label) or label in ("job", "instance", "le"):
                raise ValueError(f"group label {label!r} is not a usable label name")
        if "{name}" not in self.runbook_url:
            raise ValueError("runbook_url must contain {name}")
        _absolute("runbook URL", self.runbook_url)
        _absolute("Grafana URL", self.grafana_url)
        _absolute("trace UI URL", self.trace_ui_url)
        if self.latency_slo_seconds not in LATENCY_BUCKETS:
            raise ValueError(
                f"latency_slo_seconds must be a histogram bucket boundary: {LATENCY_BUCKETS}"
            )
        if not 0.5 <= self.latency_slo_target < 1:
            raise ValueError("latency_slo_target must be in [0.5, 1)")
        for name in THRESHOLDS:
            value = getattr(self, name)
            if not value >= 0 or value == float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0")
            if name in _RATIOS and not 0 < value < 1:
                raise ValueError(f"{name} is a share: it must be in (0, 1)")

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
        return f'job=~"{self.jobs_regex}"'

    @property
    def routed_only(self) -> str:
        """Matchers that leave out the event types sent to no consumer on purpose."""
        if not self.allowed_unrouted_types:
            return ""
        types = "|".join(t.replace(".", "[.]") for t in self.allowed_unrouted_types)
        return f', event_type!~"{types}"'

    @property
    def jobs_regex(self) -> str:
        # Job names are letters, digits and _.:/- (checked above): only "." is special in
        # a regular expression, and PromQL strings reject backslash escapes like "\-".
        return "|".join(job.replace(".", "[.]") for job in (self.relay_job, self.worker_job))

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


def _absolute(what: str, url: str) -> None:
    parts = urlsplit(url.replace("{name}", "name"))
    if parts.scheme not in ("http", "https", "file") or (
        parts.scheme != "file" and not parts.netloc
    ):
        raise ValueError(
            f"the {what} must be absolute (http://, https:// or file://), not {url!r}: a "
            "relative link does not open from Grafana or Alertmanager"
        )


def number(value: float) -> str:
    """A threshold as PromQL and the runbooks write it: ``1000``, ``0.05``, ``120``."""
    return f"{value:g}"
