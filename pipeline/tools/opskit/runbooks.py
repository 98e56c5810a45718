"""The runbook pages, rendered for a deployment from the templates in ``pages/``.

A page is Markdown as an operator reads it. Rendering makes it fit the deployment:

* links between pages (``[x](relay-down.md)``) become absolute runbook URLs, so a page
  copied into a wiki or opened from Grafana still links to its neighbours;
* the default job matchers (``job="pipeline-relay"``) become the deployment's;
* ``{{kit:NAME}}`` is the value of a :class:`KitOptions` field (thresholds: ``1000``,
  ``0.05``), and ``{{kit:expr:ALERT}}`` the expression of that alert as rendered;
* an alert's page that has no ``## Verify recovery`` section of its own ends with one
  that shows the alert's own expression: recovered once that query returns nothing.

Every page ends with its ``## Verify recovery`` section.
"""

from __future__ import annotations

import re
import textwrap
from importlib import resources

from pipeline.tools.opskit.options import KitOptions, number
from pipeline.tools.opskit.rules import all_alerts

PAGES = "pages"
TOKEN = re.compile(r"\{\{kit:(expr:)?([A-Za-z_]+)\}\}")
LINK = re.compile(r"\]\(([A-Za-z-]+)\.md(#[a-z0-9-]+)?\)")
VERIFY = "## Verify recovery"


def templates() -> dict[str, str]:
    """Page name (no ``.md``) -> template text, from the package's data."""
    folder = resources.files("pipeline.tools.opskit").joinpath(PAGES)
    return {
        entry.name.removesuffix(".md"): entry.read_text(encoding="utf-8")
        for entry in sorted(folder.iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".md")
    }


def alert_expressions(o: KitOptions) -> dict[str, list[str]]:
    expressions: dict[str, list[str]] = {}
    for alert in all_alerts(o):
        expressions.setdefault(alert.name, []).append(alert.expr)
    return expressions


def _verify_section(name: str, expressions: list[str]) -> str:
    blocks = "\n\n".join(f"```promql\n{expr}\n```" for expr in expressions)
    several = len(expressions) > 1
    sentence = (
        f"The condition of {name} no longer holds when "
        f"{'each of these queries returns' if several else 'this query returns'} no series "
        "in Prometheus (the alert's own expression, as rendered; the alert resolves at its "
        "next evaluation):"
    )
    return f"{VERIFY}\n\n{textwrap.fill(sentence, 88)}\n\n{blocks}\n"


def render_page(name: str, template: str, o: KitOptions, pages: set[str]) -> str:
    expressions = alert_expressions(o)

    def token(match: re.Match[str]) -> str:
        if match.group(1):
            return "\n".join(expressions[match.group(2)])
        value = getattr(o, match.group(2))
        return number(value) if isinstance(value, int | float) else str(value)

    def link(match: re.Match[str]) -> str:
        target, anchor = match.group(1), match.group(2) or ""
        if target not in pages:
            return match.group(0)
        return f"]({o.runbook(target)}{anchor})"

    text = TOKEN.sub(token, template)
    text = text.replace('job=~"pipeline-relay|pipeline-worker"', o.pipeline)
    text = text.replace('job="pipeline-relay"', o.relay).replace('job="pipeline-worker"', o.worker)
    text = LINK.sub(link, text)
    if f"\n{VERIFY}\n" not in text and name in expressions:
        text = text.rstrip("\n") + "\n\n" + _verify_section(name, expressions[name])
    return text


def render_runbooks(o: KitOptions) -> dict[str, str]:
    """``runbooks/<page>.md`` -> rendered text, for every page and the index."""
    pages = templates()
    return {
        f"runbooks/{name}.md": render_page(name, template, o, set(pages))
        for name, template in pages.items()
    }
