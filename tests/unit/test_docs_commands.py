"""Every ``pipeline …`` command the docs or the CLI's own messages name exists.

A command is taken from code: inline code spans and shell code blocks of README.md and
docs/*.md, and backtick-quoted spans of the string literals in the ``pipeline`` package
(its messages tell operators what to run). Each is walked down the click group of
``pipeline.tools.cli``: every word must name a subcommand until a command that takes arguments
is reached. Module paths (``pipeline.tools.cli``), metric names (``pipeline_…``) and Python
imports (``from pipeline import …``) are not commands and are skipped.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from pipeline.tools.cli import cli

ROOT = Path(__file__).resolve().parents[2]
SHELL_FENCES = {"bash", "sh", "shell", "console", ""}
# "pipeline" as a word of its own (not pipeline_x, pipeline.x, my-pipeline), followed by
# the words that may name subcommands.
COMMAND = re.compile(r"(?<![\w.-])pipeline((?:[ \t]+[a-z][a-z0-9-]*)*)(?![\w.-])")
NOT_A_COMMAND_BEFORE = re.compile(r"(?:from|import)\s+$")
CODE_SPAN = re.compile(r"`+([^`]+?)`+")


def commands_in(text: str) -> Iterator[list[str]]:
    """The word lists that follow ``pipeline`` in ``text`` (a piece of code)."""
    for match in COMMAND.finditer(text):
        if NOT_A_COMMAND_BEFORE.search(text[: match.start()]):
            continue
        yield match.group(1).split()


def markdown_code(text: str) -> Iterator[str]:
    """Inline code spans (a span may wrap lines within a paragraph), and the lines of
    shell (or unlabelled) fenced blocks."""
    fence: str | None = None
    paragraph: list[str] = []
    for line in [*text.splitlines(), ""]:
        stripped = line.strip()
        if fence is None and (not stripped or stripped.startswith("```")):
            yield from CODE_SPAN.findall(" ".join(paragraph))
            paragraph = []
        if stripped.startswith("```"):
            fence = stripped[3:].strip().lower() if fence is None else None
        elif fence is not None:
            if fence in SHELL_FENCES:
                yield line.split(" #", 1)[0]  # a shell comment is prose
        elif stripped:
            paragraph.append(stripped)


def string_literals(path: Path) -> Iterator[str]:
    """Every string literal of a module; an f-string's parts joined around a placeholder."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            yield "\0".join(
                part.value
                for part in node.values
                if isinstance(part, ast.Constant) and isinstance(part.value, str)
            )
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts
        ):
            yield node.value


def unknown_command(words: list[str], group: click.Group = cli) -> str | None:
    """Why ``pipeline WORDS`` names no command, or None when it does."""
    command: click.Command = group
    walked = ["pipeline"]
    for word in words:
        if not isinstance(command, click.Group):
            return None  # a leaf command: the rest are its arguments
        sub = command.commands.get(word)
        if sub is None:
            known = ", ".join(sorted(command.commands))
            return f"`{' '.join(walked)}` has no subcommand {word!r} (it has: {known})"
        command, walked = sub, [*walked, word]
    return None


def mentions() -> Iterator[tuple[str, list[str]]]:
    """(where, words) for every ``pipeline …`` named in the docs and the package."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for code in markdown_code(path.read_text()):
            for words in commands_in(code):
                yield str(path.relative_to(ROOT)), words
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        for literal in string_literals(path):
            for span in CODE_SPAN.findall(literal):
                for words in commands_in(span):
                    yield str(path.relative_to(ROOT)), words


def test_every_command_named_in_docs_and_messages_exists() -> None:
    found = list(mentions())
    problems = [
        f"{where}: `pipeline {' '.join(words)}`: {reason}"
        for where, words in found
        if (reason := unknown_command(words)) is not None
    ]
    assert problems == []
    named = {tuple(words[:1]) for _, words in found}
    # The scan sees the commands the README and the status messages name.
    assert {("relay",), ("worker",), ("status",), ("trace",), ("db",)} <= named


@pytest.mark.parametrize(
    "text",
    [
        "run `pipeline dlq resurrect` to see them",
        "`pipeline db prune`",
        "`pipeline no-such-command --json`",
    ],
)
def test_a_command_that_does_not_exist_is_reported(text: str) -> None:
    (words,) = [w for code in markdown_code(text) for w in commands_in(code)]
    reason = unknown_command(words)
    assert reason is not None and "has no subcommand" in reason


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("`pipeline trace EVENT_ID --json`", ["trace"]),
        ("`pipeline worker --processes P --threads T`", ["worker"]),
        ("`pipeline db upgrade`", ["db", "upgrade"]),
        ("```bash\n.venv/bin/pipeline demo   # no services needed\n```", ["demo"]),
        ("```bash\nexport PIPELINE_APP_MODULES=shop.consumers\n```", None),
        ("`pipeline.tools.cli`, `pipeline_relay_up`, `pipeline-bench`", None),
        ("```python\nfrom pipeline import add_event\n```", None),
        ("`from pipeline import add_event`", None),
        ("see `pipeline\ntrace EVENT_ID`, wrapped", ["trace"]),
        ("`a` the pipeline passes `b`", None),
    ],
)
def test_what_counts_as_a_command(text: str, words: list[str] | None) -> None:
    found = [w for code in markdown_code(text) for w in commands_in(code)]
    if words is None:
        assert found == []
    else:
        assert found == [words] and unknown_command(words) is None


def test_backticked_commands_in_string_literals_are_found(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text(
        'def f(n):\n    return f"{n} dead letters: see `pipeline dlq list`; run `pipeline'
        ' db upgrade`"\n'
    )
    spans = [span for literal in string_literals(module) for span in CODE_SPAN.findall(literal)]
    assert [w for span in spans for w in commands_in(span)] == [["dlq", "list"], ["db", "upgrade"]]
