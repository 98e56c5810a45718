"""The relays and workers the drill runs: real ``pipeline relay`` / ``pipeline worker`` processes.

Each is a child of the drill's :class:`~pipeline.tools.harness.fleet.Fleet`: in a session
(process group) of its own, so a SIGKILL of the group takes a worker's Dramatiq processes
down with it, as a crashed machine would, and killed by the fleet's watchdog should the
drill die. Every process gets its own ``application_name`` (through ``PGAPPNAME``),
which is how the drill finds its connections in ``pg_stat_activity`` to terminate them,
on its own servers or on a staging server shared with others. Each start of a process
(an incarnation) has its own log file and, for workers, its own metrics directory, so
nothing of a killed process is overwritten.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pipeline.tools.harness.commands import relay_command, worker_command, workers_ready
from pipeline.tools.harness.fleet import Child, Fleet

Kind = Literal["relay", "worker"]
STOP_GRACE_SECONDS = 15.0


@dataclass
class Member:
    """One relay or worker slot; its process is replaced on every restart."""

    name: str
    kind: Kind
    application_name: str
    child: Child | None = None
    incarnation: int = 0
    metrics_dir: Path | None = None
    expected_exit: bool = False  # the drill killed or stopped it

    def running(self) -> bool:
        return self.child is not None and self.child.running()

    def tail(self, lines: int = 2) -> str:
        return self.child.log_tail(lines, width=300) if self.child is not None else ""


@dataclass
class Exit:
    """A process that exited without the drill asking it to."""

    member: str
    code: int | None
    at: float
    log_tail: str


@dataclass
class Members:
    fleet: Fleet
    log_dir: Path
    env: dict[str, str]
    run: str
    relays: int = 2
    workers: int = 2
    processes: int = 1
    threads: int = 4
    place: Callable[[Member, Sequence[str]], list[str]] | None = None  # run it on a host
    by_kind: dict[Kind, dict[str, str]] = field(default_factory=dict)  # env of one kind only
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

    def children(self) -> list[Child]:
        return [member.child for member in self.members if member.child is not None]

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
        if member.child is not None:
            self.fleet.forget(member.child)
            member.child.close_log()
        member.incarnation += 1
        member.expected_exit = False
        stem = f"{member.name}.{member.incarnation}"
        env = {
            **self.env,
            **self.by_kind.get(member.kind, {}),
            "PGAPPNAME": member.application_name,
        }
        if member.kind == "relay":
            argv = relay_command(0, "--no-state-metrics")
        else:
            member.metrics_dir = self.log_dir / "metrics" / stem
            member.metrics_dir.mkdir(parents=True)
            env["PROMETHEUS_MULTIPROC_DIR"] = env["PIPELINE_METRICS_MULTIPROC_DIR"] = str(
                member.metrics_dir
            )
            argv = worker_command(self.processes, self.threads, 0)
        if self.place is not None:
            argv = self.place(member, argv)
        member.child = self.fleet.start(
            member.name, argv, env=env, log_path=self.log_dir / f"{stem}.log"
        )

    def kill(self, member: Member) -> None:
        """SIGKILL the member's whole process group and reap it."""
        member.expected_exit = True
        if member.child is not None:
            member.child.kill()

    def pause(self, member: Member) -> bool:
        """SIGSTOP the member's process group; False if it is not running."""
        if member.child is None or not member.child.running():
            return False
        member.child.signal_group(signal.SIGSTOP)
        return True

    def resume(self, member: Member) -> None:
        """SIGCONT the member's process group."""
        if member.child is not None:
            member.child.signal_group(signal.SIGCONT)

    def ready(self, member: Member) -> bool:
        """A relay is ready once it runs, a worker once every Dramatiq process says so."""
        if member.child is None:
            return False
        if member.kind == "relay":
            return member.child.running()
        return workers_ready(member.child, self.processes)

    def reap(self) -> list[Member]:
        """Members whose process exited on its own (recorded in :attr:`exits`)."""
        dead = []
        for member in self.members:
            child = member.child
            if child is None or child.running() or member.expected_exit:
                continue
            self.exits.append(Exit(member.name, child.returncode, time.time(), member.tail()))
            member.expected_exit = True
            dead.append(member)
        return dead

    def stop_all(self, remaining: Callable[[float], float] | None = None) -> None:
        """SIGTERM every process, then SIGKILL the groups still there after the grace period
        (or what ``remaining`` allows of it: a second Ctrl-C ends the wait)."""
        for member in self.members:
            member.expected_exit = True
        self.fleet.stop(self.children(), STOP_GRACE_SECONDS, remaining)
