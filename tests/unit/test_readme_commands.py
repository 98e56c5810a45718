"""The set-up promise: .ci/run runs exactly the README's two commands, and the Quickstart
runs the command they installed."""

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


def test_quickstart_runs_the_installed_command() -> None:
    """The install command does not activate its venv, so a bare ``pipeline`` in the
    Quickstart only works after the Quickstart activates that venv."""
    install, _ = readme_commands()
    venv = re.search(r"python3 -m venv (\S+)", install)
    assert venv is not None
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    lines = [
        line.split(" #", 1)[0].strip()
        for block in re.findall(r"```bash\n(.*?)```", section, re.S)
        for line in block.splitlines()
    ]
    bare = [i for i, line in enumerate(lines) if re.match(r"pipeline\b", line)]
    assert bare, "the Quickstart runs no pipeline command"
    assert f"source {venv.group(1)}/bin/activate" in lines[: bare[0]]
