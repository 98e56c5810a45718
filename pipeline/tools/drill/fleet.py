"""The relays and workers the drill runs: real ``pipeline relay`` / ``pipeline worker`` processes.

Each runs in its own session (process group), so a SIGKILL of the group takes a worker's
Dramatiq processes down with it, as a crashed machine would. Every process gets its own
``application_name`` (through ``PGAPPNAME``), which is how the drill finds its
connections in ``pg_stat_activity`` to terminate them, on its own servers or on a
staging server shared with others. Each start of a process (an incarnation) has its own
log file and, for workers, its own metrics directory, so nothing of a killed process is
overwritten.

Processes are started through :mod:`pipeline.tools.drill.guard`, so they end with the drill.
All starts happen on the drill's main thread (the thread Linux watches for that).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Kind = Literal["relay", "worker"]
WORKER_READY_LINE = "Worker process is ready for action"
STOP_GRACE_SECONDS = 15.0


@dataclass
class Member:
    """One relay or worker slot; its process is replaced on every restart."""

    name: str
    kind: Kind
    application_name: str
    process: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    log_path: Path | None = None
    metrics_dir: Path | None = None
    expected_exit: bool = False  # the drill killed or stopped it

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class Exit:
    """A process that exited without the drill asking it to."""

    member: str
    code: int | None
    at: float
    log_tail: str


@dataclass
class Fleet:
    log_dir: Path
    env: dict[str, str]
    run: str
    relays: int = 2
    workers: int = 2
    processes: int = 1
    threads: int = 4
    members: list[Member] = field(default_factory=list)
    exits: list[Exit] = field(default_factory=list)

    def __post_init__(self) -> None:
        counts: tuple[tuple[Kind, int], ...] = (("relay", self.relays), ("worker", self.workers))
        for kind, count in counts:
            for number in range(1, count + 1):
                name = f"{kind}-{number}"
                self.members.append(Member(name, kind, f"drill-{self.run}-{name}"))

    def of(self, kind: Kind) -> list[Member]:
        return [member for member in self.members if member.kind == kind]

    def application_names(self, kind: Kind) -> list[str]:
        return [member.application_name for member in self.of(kind)]

    def metrics_dirs(self) -> list[Path]:
        root = self.log_dir / "metrics"
        return sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []

    # -- lifecycle -----------------------------------------------------------------------------
    def start_all(self) -> None:
        for member in self.members:
            self.start(member)

    def start(self, member: Member) -> None:
        """Start the member's next incarnation (nothing if its process is still running)."""
        if member.running():
            return
        member.incarnation += 1
        member.expected_exit = False
        stem = f"{member.name}.{member.incarnation}"
        member.log_path = self.log_dir / f"{stem}.log"
        env = {**self.env, "PGAPPNAME": member.application_name}
        cli = [sys.executable, "-m", "pipeline.tools.cli"]
        if member.kind == "relay":
            argv = [*cli, "relay", "--metrics-port", "0", "--no-state-metrics"]
        else:
            member.metrics_dir = self.log_dir / "metrics" / stem
            member.metrics_dir.mkdir(parents=True)
            env["PROMETHEUS_MULTIPROC_DIR"] = env["PIPELINE_METRICS_MULTIPROC_DIR"] = str(
                member.metrics_dir
            )
            argv = [
                *cli, "worker", "--processes", str(self.processes),
                "--threads", str(self.threads), "--metrics-port", "0",
            ]  # fmt: skip
        guarded = [
            sys.executable,
            "-m",
            "pipeline.tools.drill.guard",
            str(os.getpid()),
            "--",
            *argv,
        ]
        with member.log_path.open("ab") as log:
            member.process = subprocess.Popen(
                guarded,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self, member: Member) -> None:
        """SIGKILL the member's whole process group and reap it."""
        member.expected_exit = True
        process = member.process
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)

    def ready(self, member: Member) -> bool:
        """A worker is ready once every Dramatiq process of this incarnation says so."""
        if member.kind == "relay":
            return member.running()
        return member.running() and _count(member.log_path, WORKER_READY_LINE) >= self.processes

    def reap(self) -> list[Member]:
        """Members whose process exited on its own (recorded in :attr:`exits`)."""
        dead = []
        for member in self.members:
            process = member.process
            if process is None or process.poll() is None or member.expected_exit:
                continue
            self.exits.append(Exit(member.name, process.returncode, time.time(), self.tail(member)))
            member.expected_exit = True
            dead.append(member)
        return dead

    def tail(self, member: Member, lines: int = 2) -> str:
        if member.log_path is None:
            return ""
        try:
            text = member.log_path.read_text("utf-8", "replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(line.strip()[:300] for line in text[-lines:])

    def stop_all(self) -> None:
        """SIGTERM every process, then SIGKILL the groups still there after the grace period."""
        for member in self.members:
            member.expected_exit = True
            if member.running() and member.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for member in self.members:
            process = member.process
            if process is None:
                continue
            while process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            self.kill(member)  # also reaps what outlived a clean exit in the group


def _count(path: Path | None, needle: str) -> int:
    if path is None:
        return 0
    try:
        return path.read_text("utf-8", "replace").count(needle)
    except OSError:
        return 0
