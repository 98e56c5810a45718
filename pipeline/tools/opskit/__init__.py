"""The ops kit as code: Prometheus rules and Grafana dashboards, rendered per deployment.

The repository's ``alerts/`` and ``dashboards/`` are this package's output with the
default :class:`KitOptions`; ``pipeline opskit`` renders them with your job
names, runbook and Grafana URLs (docs/operations.md).
"""

from pipeline.tools.opskit.options import KitOptions
from pipeline.tools.opskit.render import render_kit, render_rule_files

__all__ = ["KitOptions", "render_kit", "render_rule_files"]
