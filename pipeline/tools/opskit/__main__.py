"""``python -m pipeline.tools.opskit``: render the alert rules and dashboards for a deployment.

Without options it renders the repository's committed files (``alerts/``,
``dashboards/``); ``--check`` only compares and exits 1 when they differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.tools.opskit.options import KitOptions
from pipeline.tools.opskit.render import render_kit, stale_files, write_files


def build_parser() -> argparse.ArgumentParser:
    defaults = KitOptions()
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.tools.opskit",
        description="Render the pipeline's Prometheus rules and Grafana dashboards.",
    )
    parser.add_argument("--out", type=Path, default=Path(), help="directory to write into")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    parser.add_argument("--relay-job", default=defaults.relay_job, help="job label of relays")
    parser.add_argument("--worker-job", default=defaults.worker_job, help="job label of workers")
    parser.add_argument(
        "--group-label",
        action="append",
        default=[],
        help="label every aggregation keeps, e.g. namespace (repeatable)",
    )
    parser.add_argument(
        "--runbook-url",
        default=defaults.runbook_url,
        help="runbook URL template with {name} (default: %(default)s, relative to the repository)",
    )
    parser.add_argument("--grafana-url", default=defaults.grafana_url, help="Grafana base URL")
    parser.add_argument("--trace-ui-url", default=defaults.trace_ui_url, help="trace UI base URL")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        options = KitOptions(
            relay_job=args.relay_job,
            worker_job=args.worker_job,
            group_labels=tuple(args.group_label),
            runbook_url=args.runbook_url,
            grafana_url=args.grafana_url,
            trace_ui_url=args.trace_ui_url,
        )
    except ValueError as exc:
        print(f"python -m pipeline.tools.opskit: error: {exc}", file=sys.stderr)
        return 2
    files = render_kit(options)
    if args.check:
        stale = stale_files(files, args.out)
        for relative in stale:
            print(f"differs from the code: {relative}", file=sys.stderr)
        return 1 if stale else 0
    for path in write_files(files, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
