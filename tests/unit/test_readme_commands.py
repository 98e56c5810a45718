"""The set-up promise: .ci/run runs exactly the README's two commands."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_ci_runs_the_readme_commands_verbatim():
    install, tests = readme_commands()
    assert "pip install" in install and "pipeline demo" in install
    assert tests == ".venv/bin/pytest"
    ci_lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert install in ci_lines
    assert tests in ci_lines
    assert ci_lines.index(install) < ci_lines.index(tests)
