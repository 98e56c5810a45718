"""Write the ops kit's files: rule files (YAML), dashboards (JSON) and runbooks (Markdown).

``render_kit`` returns file contents by relative path, so the tests can compare them
with the committed files and ``pipeline demo`` can write a rendered copy of its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from pipeline.tools.opskit.dashboards import all_dashboards
from pipeline.tools.opskit.options import KitOptions
from pipeline.tools.opskit.rules import alert_rule_file, recording_rule_file
from pipeline.tools.opskit.runbooks import render_runbooks

RECORDING_RULES = "alerts/pipeline-recording-rules.yaml"
ALERT_RULES = "alerts/pipeline-alerts.yaml"
HEADER = (
    "# Rendered by `python -m pipeline.tools.opskit` from pipeline/tools/opskit/{source}:\n"
    "# edit that, then render again (tests/unit/test_opskit_files.py fails when this file\n"
    "# and the code differ).\n"
)


class _Dumper(yaml.SafeDumper):
    """Block style, keys in insertion order, multi-line strings as literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(document: Any) -> str:
    return yaml.dump(
        document, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000
    )


def render_rule_files(options: KitOptions) -> dict[str, str]:
    return {
        RECORDING_RULES: HEADER.format(source="rules.py") + to_yaml(recording_rule_file(options)),
        ALERT_RULES: HEADER.format(source="rules.py") + to_yaml(alert_rule_file(options)),
    }


def render_kit(options: KitOptions) -> dict[str, str]:
    """Relative path -> content of every rendered file."""
    files = render_rule_files(options)
    for name, board in all_dashboards(options).items():
        files[f"dashboards/{name}"] = json.dumps(board, indent=2) + "\n"
    files.update(render_runbooks(options))
    return files


def write_files(files: dict[str, str], root: Path) -> list[Path]:
    written = []
    for relative, content in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        written.append(path)
    return written


def stale_files(files: dict[str, str], root: Path) -> list[str]:
    """Paths under ``root`` whose content differs from ``files`` (or that are missing)."""
    stale = []
    for relative, content in files.items():
        path = root / relative
        if not path.is_file() or path.read_text() != content:
            stale.append(relative)
    return stale
