"""What every benchmark shares: servers, the report, the CPU accounts, rounds and spreads.

A number never travels without its context, so every report starts with :func:`header`:
the exact command (passwords masked), the machine, the code measured (commit,
uncommitted ``pipeline/`` changes and a hash of ``pipeline/``), and, from
:func:`durability`, the server settings that decide what a commit costs (``fsync``,
``synchronous_commit``, Redis persistence). Reports are written whole or not at all
(:func:`write_report`).

The machine is shared and its speed drifts by tens of percent within an hour, hence the
CPU accounts read from ``/proc`` (who used the CPU during a window, neighbours included),
the speed probe, and the helpers for interleaved rounds (:func:`rotated`, :func:`spread`,
:func:`bootstrap_interval`): a comparison means something only between runs made next to
each other.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import multiprocessing as mp
import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import redis
import sqlalchemy
from psycopg import sql

from pipeline.tools.harness.embedded import EmbeddedPostgres, EmbeddedRedis
from pipeline.tools.harness.fleet import Fleet
from pipeline.tools.harness.rabbitmq_cluster import RabbitCluster

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SHOWN_SETTINGS = (
    "server_version",
    "fsync",
    "synchronous_commit",
    "full_page_writes",
    "wal_level",
    "wal_sync_method",
    "commit_delay",
    "shared_buffers",
    "max_wal_size",
    "checkpoint_timeout",
    "max_connections",
)
BOOTSTRAP_SAMPLES = 10_000


# -- servers ------------------------------------------------------------------------------


@dataclass
class Servers:
    """The Postgres and Redis a benchmark runs against; the embedded ones when started here."""

    database_url: str
    redis_url: str
    postgres: EmbeddedPostgres | None
    redis: EmbeddedRedis | None

    @property
    def postgres_pid(self) -> int | None:
        return self.postgres.pid if self.postgres else None

    @property
    def redis_pid(self) -> int | None:
        return self.redis.pid if self.redis else None

    def describe(self) -> dict[str, Any]:
        """Where the servers came from, their settings, and the data disk's fsync rate."""
        described: dict[str, Any] = {
            "postgres": "embedded (EmbeddedPostgres durable=True)" if self.postgres else "external",
            "postgres_settings": durability(self.database_url),
        }
        if self.postgres is not None:
            described["disk"] = fsync_probe(self.postgres.data_dir.parent)
        if self.redis_url:
            described["redis"] = "embedded (EmbeddedRedis)" if self.redis else "external"
            described["redis_settings"] = redis_info(self.redis_url)
        return described


@contextlib.contextmanager
def servers(
    database_url: str | None, redis_url: str | None = None, with_redis: bool = True
) -> Iterator[Servers]:
    """The given servers, or a throwaway durable Postgres (fsync on) and Redis, removed after."""
    with contextlib.ExitStack() as stack:
        postgres = redis_server = None
        if database_url is None:
            postgres = stack.enter_context(EmbeddedPostgres(durable=True))
            database_url = postgres.url
        if redis_url is None and with_redis:
            redis_server = stack.enter_context(EmbeddedRedis())
            redis_url = redis_server.url
        yield Servers(database_url, redis_url or "", postgres, redis_server)


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[Fleet]:
    """``count`` processes spinning on the CPU meanwhile: a contended machine (a noisy
    neighbour, a container sharing its cores), the same for every system measured. They
    die with this process whatever ends it (the harness's fleet and its watchdog)."""
    fleet = Fleet()
    try:
        for index in range(count):
            fleet.start(f"cpu-hog-{index}", [sys.executable, "-c", "while True: pass"])
        yield fleet
    finally:
        fleet.close()


TRANSPORTS = {"redis": 0, "rabbitmq": 1, "rabbitmq-cluster": 3}
"""The transports a benchmark can run on, and the RabbitMQ nodes each starts here."""


@dataclass
class Broker:
    """One transport of a sitting: its broker URL and, for RabbitMQ, the nodes started here."""

    name: str
    url: str
    cluster: RabbitCluster | None = None

    @property
    def management_url(self) -> str | None:
        """The management API of the nodes started here (None: the broker URL's default)."""
        return self.cluster.nodes[0].management_url if self.cluster else None

    def node_pids(self) -> list[int]:
        nodes = self.cluster.nodes if self.cluster else []
        return [node.process.pid for node in nodes if node.process is not None]

    def describe(self) -> dict[str, Any]:
        if self.cluster is None:
            server = "RabbitMQ (given)" if self.url.startswith("amqp") else "Redis (as above)"
            return {"transport": self.name, "server": server}
        first = self.cluster.nodes[0]
        version = self.cluster.ctl(first, "version").strip()
        return {
            "transport": self.name,
            "server": f"RabbitMQ {version}, {self.cluster.size} node(s) on this machine "
            "(Debian rabbitmq-server, RabbitCluster), quorum queues, publisher confirms",
        }


def parse_transports(value: str) -> list[str]:
    """``--transports``: a comma-separated subset of :data:`TRANSPORTS`, in the given order."""
    names = [name for name in value.split(",") if name]
    if unknown := [name for name in names if name not in TRANSPORTS]:
        raise SystemExit(f"unknown transports {unknown}: use {', '.join(TRANSPORTS)}")
    return names


@contextlib.contextmanager
def brokers(names: Sequence[str], redis_url: str) -> Iterator[dict[str, Broker]]:
    """Each named transport's broker: the given Redis, or RabbitMQ nodes started here (one
    node; a three-node cluster), all running for the whole sitting and removed after."""
    with contextlib.ExitStack() as stack:
        found: dict[str, Broker] = {}
        for name in names:
            size = TRANSPORTS[name]
            if size == 0:
                found[name] = Broker(name, redis_url)
                continue
            cluster = RabbitCluster(size)
            stack.callback(cluster.cleanup)  # also after a start that failed half-way
            cluster.start()
            found[name] = Broker(name, cluster.url, cluster)
        yield found


def durability(url: str) -> dict[str, str]:
    """The Postgres settings that decide what a commit costs."""
    shown = {}
    with psycopg.connect(url) as conn:
        for name in SHOWN_SETTINGS:
            row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
            shown[name] = str(row[0]) if row else ""
    return shown


def redis_info(url: str) -> dict[str, Any]:
    """Redis's version and persistence (none, in the embedded server)."""
    client = redis.Redis.from_url(url)
    try:
        server, persistence = client.info("server"), client.info("persistence")
        return {
            "redis_version": server.get("redis_version"),
            "aof_enabled": persistence.get("aof_enabled"),
            "save": client.config_get("save").get("save"),
            "appendfsync": client.config_get("appendfsync").get("appendfsync"),
        }
    finally:
        client.close()


def fsync_probe(directory: Path, seconds: float = 1.0) -> dict[str, float]:
    """8 KiB write + fdatasync in a loop on ``directory``'s disk: what bounds serialised commits."""
    block = os.urandom(8192)
    count = 0
    fd, name = tempfile.mkstemp(dir=directory, prefix="fsync-probe-")
    try:
        started = time.monotonic()
        while time.monotonic() < started + seconds:
            os.pwrite(fd, block, 0)
            os.fdatasync(fd)
            count += 1
        elapsed = time.monotonic() - started
    finally:
        os.close(fd)
        os.unlink(name)
    return {"fdatasync_per_s": round(count / elapsed, 1), "ms": round(1000 * elapsed / count, 3)}


# -- the report ---------------------------------------------------------------------------


def without_passwords(text: str) -> str:
    """``text`` with the password of every URL in it replaced (reports are shared)."""
    return re.sub(r"://([^:/@\s]*):[^@/\s]+@", r"://\1:***@", text)


def machine() -> dict[str, Any]:
    """The machine and the library versions a figure depends on."""
    cpu_model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model,
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "loadavg_at_start": os.getloadavg(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "psycopg": psycopg.__version__,
        "sqlalchemy": sqlalchemy.__version__,
        "redis_py": redis.__version__,
    }


def code_version() -> dict[str, Any]:
    """The code under test: commit, uncommitted changes, and a hash of pipeline/ itself.

    The hash identifies the measured code when the tree is dirty; compared before and
    after a run (:func:`finish`) it catches edits made while the benchmark ran.
    """
    digest = hashlib.sha256()
    for path in sorted((ROOT / "pipeline").rglob("*")):
        if path.suffix in (".py", ".sql") and path.is_file():
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.rstrip()

    status = git("status", "--porcelain", "--", "pipeline")
    return {
        "commit": git("rev-parse", "HEAD"),
        "pipeline_changes": status.splitlines() if status else [],
        "pipeline_sha256": digest.hexdigest(),
    }


def header(benchmark: str, argv: Sequence[str] | None) -> dict[str, Any]:
    """The head of every report: what ran, when, where, on which code."""
    args = sys.argv[1:] if argv is None else list(argv)
    return {
        "benchmark": benchmark,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": without_passwords(
            shlex.join([sys.executable, "-m", f"benchmarks.{benchmark}", *args])
        ),
        "machine": machine(),
        "code": code_version(),
    }


def finish(report: dict[str, Any]) -> None:
    """Note whether ``pipeline/`` changed while the benchmark ran (then the figure is whose?)."""
    changed = code_version()["pipeline_sha256"] != report["code"]["pipeline_sha256"]
    report["code"]["changed_during_run"] = changed
    if changed:
        print("warning: pipeline/ changed while the benchmark ran", file=sys.stderr)


def done(report: dict[str, Any], path: Path | str) -> int:
    """The end of a run: note any edit of ``pipeline/`` meanwhile, write the report."""
    finish(report)
    write_report(path, report)
    print(f"wrote {path}")
    return 0


def write_report(path: Path | str, report: dict[str, Any]) -> None:
    """Replace the report in one step, so that a crash mid-write leaves the previous one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2, default=str) + "\n")
    partial.replace(path)


# -- statistics ---------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


def latency_ms(values: Sequence[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 / max in milliseconds of durations in seconds."""
    return {
        "p50": ms(percentile(values, 0.50)),
        "p90": ms(percentile(values, 0.90)),
        "p99": ms(percentile(values, 0.99)),
        "max": ms(max(values)) if values else None,
    }


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Per-round values (``None`` where a round measured nothing), median, min and max."""
    measured = [v for v in values if v is not None]
    if not measured:
        return {"by_round": list(values), "median": None, "min": None, "max": None}
    return {
        "by_round": list(values),
        "median": round(statistics.median(measured), 3),
        "min": min(measured),
        "max": max(measured),
    }


def bootstrap_interval(values: Sequence[float], seed: int = 1) -> tuple[float, float]:
    """95 % interval of the mean, by resampling ``values`` with replacement."""
    rng = random.Random(seed)
    means = sorted(
        statistics.fmean(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP_SAMPLES)
    )
    return means[int(0.025 * len(means))], means[int(0.975 * len(means)) - 1]


def ratios(values: Sequence[float]) -> dict[str, Any]:
    """Ratios over rounds: median, mean with its bootstrap 95 % interval, range, each round."""
    low, high = bootstrap_interval(values)
    return {
        "median": round(statistics.median(values), 3),
        "mean": round(statistics.fmean(values), 3),
        "ci95_of_mean": [round(low, 3), round(high, 3)],
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "each_round": [round(v, 3) for v in values],
    }


def rotated(items: Sequence[str], round_index: int) -> list[str]:
    """The order of one round: round r starts at item r mod the number of items.

    The machine's load drifts within minutes; rotating keeps that drift from always
    landing on the same item.
    """
    start = round_index % len(items)
    return [*items[start:], *items[:start]]


# -- CPU accounts -------------------------------------------------------------------------


def machine_ticks() -> tuple[int, int, int]:
    """(busy, iowait, total) jiffies over all CPUs since boot, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle, iowait = fields[3], fields[4]
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle - iowait, iowait, total


def machine_busy_seconds() -> float:
    """CPU time all processes on this machine spent busy so far."""
    return machine_ticks()[0] / os.sysconf("SC_CLK_TCK")


def processes() -> dict[int, tuple[str, int, int]]:
    """(name, ppid, utime + stime of all threads in clock ticks) of every live process.

    Processes that start or end inside a window are missed: their CPU shows up only in
    the machine-wide share, not by name.
    """
    found: dict[int, tuple[str, int, int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                name = stat[stat.index("(") + 1 : stat.rindex(")")]
                found[int(entry.name)] = (name, int(fields[1]), int(fields[11]) + int(fields[12]))
    return found


@dataclass
class CpuSample:
    machine: tuple[int, int, int]
    processes: dict[int, tuple[str, int, int]]


def sample() -> CpuSample:
    return CpuSample(machine_ticks(), processes())


def cpu_shares(before: CpuSample, after: CpuSample, pids: Sequence[int]) -> float:
    """Percent of the machine's CPU capacity used by ``pids`` between two samples."""
    total = after.machine[2] - before.machine[2]
    used = sum(
        after.processes[pid][2] - before.processes[pid][2]
        for pid in pids
        if pid in after.processes and pid in before.processes
    )
    return round(100 * used / total, 1) if total > 0 else 0.0


def cpu_report(
    before: CpuSample,
    after: CpuSample,
    units: int,
    pids: Sequence[int],
    server_pid: int | None,
    unit: str = "tx",
    who: str = "producers",
) -> dict[str, Any]:
    """Where the machine's CPU went during a window: ``pids`` (``who``), Postgres, the rest.

    Percentages are of the machine's capacity; CPU milliseconds per ``unit`` is what a
    CPU-bound machine pays for one. ``other`` is everything else (this script included),
    by process name, so a noisy neighbour shows up in the data.
    """
    total = after.machine[2] - before.machine[2]
    if total <= 0:
        return {}
    hz = os.sysconf("SC_CLK_TCK")
    used = {
        pid: ticks - before.processes[pid][2]
        for pid, (_, _, ticks) in after.processes.items()
        if pid in before.processes
    }
    ours = sum(used.get(pid, 0) for pid in pids)
    server_pids = {
        pid
        for pid, (_, ppid, _) in after.processes.items()
        if server_pid is not None and server_pid in (pid, ppid)
    }
    server = sum(used.get(pid, 0) for pid in server_pids)
    others: dict[str, int] = {}
    for pid, ticks in used.items():
        if ticks and pid not in server_pids and pid not in pids:
            name = after.processes[pid][0]
            others[name] = others.get(name, 0) + ticks

    def pct(ticks: int) -> float:
        return round(100 * ticks / total, 1)

    def per_unit(ticks: int) -> float | None:
        return round(1000 * ticks / hz / units, 3) if units else None

    busy = after.machine[0] - before.machine[0]
    known = server_pid is not None
    return {
        "machine_busy_pct": pct(busy),
        "iowait_pct": pct(after.machine[1] - before.machine[1]),
        f"{who}_pct": pct(ours),
        "postgres_pct": pct(server) if known else None,
        "other_pct": pct(busy - ours - server) if known else None,
        "other_top": {
            name: pct(ticks)
            for name, ticks in sorted(others.items(), key=lambda item: -item[1])[:4]
        },
        f"{who}_cpu_ms_per_{unit}": per_unit(ours),
        f"postgres_cpu_ms_per_{unit}": per_unit(server) if known else None,
    }


def speed_probe_ms() -> float:
    """Milliseconds for a fixed pure-Python loop, taken before each measurement.

    Runs are comparable only when their probes are close.
    """
    started = time.perf_counter()
    total = 0
    for n in range(2_000_000):
        total += n
    return round((time.perf_counter() - started) * 1000, 1)


# -- child processes ----------------------------------------------------------------------


class Children:
    """Named child processes, each logging to a file, stopped together (SIGTERM, then kill)."""

    def __init__(self, commands: dict[str, list[str]], logs: Path, env: dict[str, str]) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = logs
        self.processes = {}
        # Processes started elsewhere whose CPU counts under a name (a broker's nodes).
        self.neighbours: dict[int, str] = {}
        for name, command in commands.items():
            with (logs / f"{name}.log").open("wb") as log:
                self.processes[name] = subprocess.Popen(
                    command,
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with code {process.returncode}; see {self.logs}")

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


class Spawned:
    """Spawned worker processes, started together: each connects, reports ready, waits for
    :attr:`go`, works, reports its results and waits for :attr:`finish`.

    ``target(spec, go, finish, ready, results)`` puts ``None`` (or an error) on ``ready``
    once connected, so that connecting is not measured, and keeps what it must (its
    database backends) until ``finish``, so that the parent can sample their CPU first.
    """

    def __init__(self, target: Callable[..., None], specs: Sequence[Any]) -> None:
        context = mp.get_context("spawn")
        self.go, self.finish = context.Event(), context.Event()
        self._ready, self._results = context.Queue(), context.Queue()
        self.processes = [
            context.Process(
                target=target,
                args=(spec, self.go, self.finish, self._ready, self._results),
                daemon=True,
            )
            for spec in specs
        ]
        for process in self.processes:
            process.start()
        try:
            for _ in self.processes:
                error = self._ready.get(timeout=120)
                if error is not None:
                    raise RuntimeError(f"a spawned process failed to start: {error}")
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]

    def results(self, timeout: float) -> list[Any]:
        return [self._results.get(timeout=timeout) for _ in self.processes]

    def close(self) -> None:
        """Release every process and wait for it; kill any that outlive the grace period."""
        self.go.set()
        self.finish.set()
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


class OtlpSink(ThreadingHTTPServer):
    """A local OTLP/HTTP endpoint that accepts and discards spans (a collector stand-in)."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


# -- retained rows ------------------------------------------------------------------------


def seed_sent_rows(url: str, rows: int, age: str, step: str, chunk: int = 250_000) -> float:
    """``rows`` sent outbox events to consumer ``e2e`` and their processed inbox rows.

    They start ``age`` ago (an SQL interval) and are ``step`` apart; ids increase as
    UUIDv7s do. Stands for what retention keeps (or has to delete). Returns seconds.
    """
    uid = "('00000000-0000-7000-8000-' || lpad(to_hex(i), 12, '0'))::uuid"
    at = "now() - %(age)s::interval + i * %(step)s::interval"
    started = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        for low in range(0, rows, chunk):
            span = {"low": low, "high": min(rows, low + chunk) - 1, "age": age, "step": step}
            with conn.transaction():
                conn.execute(
                    "INSERT INTO pipeline.outbox (id, event_type, payload, headers, status, "
                    "attempts, created_at, published_at, consumers) "
                    f'SELECT {uid}, \'bench.e2e\', \'{{"n": 1, "note": "benchmark"}}\', '
                    f"'{{\"correlation_id\": \"x\"}}', 'sent', 1, {at}, {at}, ARRAY['e2e'] "
                    "FROM generate_series(%(low)s::bigint, %(high)s::bigint) AS i",
                    span,
                )
                conn.execute(
                    "INSERT INTO pipeline.inbox (consumer, event_id, event_type, status, "
                    "attempts, received_at, processed_at, delivered_at) "
                    f"SELECT 'e2e', {uid}, 'bench.e2e', 'processed', 1, {at}, {at}, {at} "
                    "FROM generate_series(%(low)s::bigint, %(high)s::bigint) AS i",
                    span,
                )
        conn.execute("VACUUM ANALYZE pipeline.outbox, pipeline.inbox")
        with contextlib.suppress(psycopg.Error):
            conn.execute("CHECKPOINT")
    return time.perf_counter() - started


def json_file(path: Path | str) -> Any:
    """A report read back."""
    return json.loads(Path(path).read_text())
