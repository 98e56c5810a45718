"""``pipeline demo`` end to end: its own servers, relay and workers, and a clean exit.

The tests run the real console command with every ``PIPELINE_*`` variable removed, so
the demo starts throwaway Postgres and Redis itself, as on a fresh machine; and they
end it as users do (Ctrl-C) or as a crash or ``kill -9`` would.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

from tests.support import cli_argv

DEMO_TIMEOUT = 240


def demo_command(*args: str) -> list[str]:
    script = Path(sys.executable).with_name("pipeline")
    if script.exists():
        return [str(script), "demo", *args]
    return cli_argv("demo", *args)


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE_")}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    # Any free ports, not the defaults 9464/9465: relays and workers of tests running in
    # parallel take those, and a port taken between the demo's choice and its child's bind
    # leaves that child without an endpoint (a Prometheus target that never comes up).
    env.update(PIPELINE_METRICS_PORT="0", PIPELINE_WORKER_METRICS_PORT="0")
    return env


@pytest.mark.xdist_group("kept_demo")
def test_demo_json_summary_holds_the_invariants(kept_demo: KeptDemo) -> None:
    summary = kept_demo.summary  # stdout holds the JSON document and nothing else
    assert summary["ok"] is True, summary["failed_invariants"]
    assert all(value is True for value in summary["invariants"].values()), summary["invariants"]
    # charges equal orders: one charge per order, none for the poison order
    charges = summary["charges"]
    assert charges["made"] == charges["orders_charged"] == charges["orders"] == 200
    # every order reached every stage exactly once (inbox, business rows, e-mails)
    assert summary["processed"] == {"payments": 200, "inventory": 200, "notifications": 200}
    for stage, effect in summary["effects"].items():
        assert effect == {"rows": 200, "orders": 200}, stage
    assert summary["orders"]["confirmed"] == 200
    assert summary["confirmations"]["sent"] == summary["confirmations"]["orders"] == 200
    assert summary["events"]["produced"] == {
        "order.placed": 201,
        "payment.charged": 200,
        "stock.reserved": 200,
    }
    assert summary["events"]["published"] == 601
    assert summary["events"]["unsent"] == 0
    # duplicate deliveries were injected and every one was absorbed by the inbox
    duplicates = summary["duplicates"]
    assert duplicates["injected_total"] > 0
    assert duplicates["absorbed_total"] >= duplicates["injected_total"]
    # the poison order ended in the dead letters, with its reason, uncharged
    [dead] = summary["dead_letters"]
    assert dead["consumer"] == "payments"
    assert dead["event_type"] == "order.placed"
    assert dead["order_id"].endswith("-poison")
    assert dead["error_class"] == "InvalidOrder"
    assert "non-retryable" in dead["reason"]
    assert "amount_cents" in dead["error"]
    # latency and the trace of one order, rebuilt from the database lineage
    latency = summary["latency_seconds"]
    assert latency["orders"] == 200
    assert 0 <= latency["p50"] <= latency["p99"] <= latency["max"]
    trace = summary["trace"]
    assert trace["single_trace"] is True
    assert re.fullmatch(r"[0-9a-f]{32}", trace["trace_id"])
    root = trace["root"]
    assert root["event_type"] == "order.placed"
    [payments] = root["consumers"]
    [charged] = payments["follow_ups"]
    assert charged["event_type"] == "payment.charged"
    assert charged["consumers"][0]["follow_ups"][0]["event_type"] == "stock.reserved"


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of a live process, from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[19])


def descendants(root: int) -> set[tuple[int, int]]:
    """Every process below ``root`` as (pid, start time), so a reused pid is not mistaken."""
    parents: dict[int, list[tuple[int, int]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat is not None and stat[0] != "Z":
                parents.setdefault(stat[1], []).append((int(entry.name), stat[2]))
    found: set[tuple[int, int]] = set()
    todo = [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child[0])
    return found


def alive(process: tuple[int, int]) -> bool:
    stat = _proc_stat(process[0])
    return stat is not None and stat[0] != "Z" and stat[2] == process[1]


def server_dirs(processes: set[tuple[int, int]]) -> set[Path]:
    """The data directories of the throwaway servers among ``processes`` (their cwd)."""
    dirs = set()
    for pid, _ in processes:
        with contextlib.suppress(OSError):
            cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
            if cwd.name.startswith(("pipeline-postgres-", "pipeline-redis-")):
                dirs.add(cwd)
    return dirs


class RunningDemo:
    """``pipeline demo`` in the background, its stderr (and stdout if asked) collected."""

    def __init__(self, *args: str, stdout: bool = False, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            demo_command(*args),
            env={**clean_env(), **(env or {})},
            stdout=subprocess.PIPE if stdout else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.out_lines: queue.Queue[str] = queue.Queue()
        self.readers = [self._read(self.process.stderr, self.lines)]
        if stdout:
            self.readers.append(self._read(self.process.stdout, self.out_lines))

    @staticmethod
    def _read(stream: IO[str] | None, into: queue.Queue[str]) -> threading.Thread:
        assert stream is not None
        reader = threading.Thread(target=lambda: [into.put(line) for line in stream], daemon=True)
        reader.start()
        return reader

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.seen):
            assert self.process.poll() is None, self.output()
            assert time.monotonic() < deadline, f"the demo never said {text!r}: {self.output()}"
            with contextlib.suppress(queue.Empty):
                self.seen.append(self.lines.get(timeout=1))

    def stdout_document(self) -> str:
        """Everything on stdout up to the end of the indented JSON document (a lone ``}``)."""
        lines: list[str] = []
        while not lines or lines[-1] != "}\n":
            lines.append(self.out_lines.get(timeout=10))
        return "".join(lines)

    def log_dir(self) -> Path:
        return next(
            Path(m.group(1)) for line in self.seen if (m := re.search(r"logs in (\S+)\)", line))
        )

    def output(self) -> str:
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return "".join(self.seen)

    def finish(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for reader in self.readers:
            reader.join(timeout=5)


@dataclass
class KeptDemo:
    demo: RunningDemo
    summary: dict[str, Any]


@pytest.fixture(scope="module")
def kept_demo() -> Iterator[KeptDemo]:
    """One ``pipeline demo --json --keep-running`` whose summary and set-up two tests read.

    Its summary (the run) and its Prometheus set-up (what it leaves up afterwards) are two
    different things of one run, so they share it: a demo run is the expensive part.
    """
    demo = RunningDemo(
        "--events",
        "200",
        "--json",
        "--keep-running",
        stdout=True,
        env={"PIPELINE_LOG_LEVEL": "DEBUG"},  # payloads must stay out of logs at any level
    )
    try:
        demo.wait_for("--config.file=", timeout=DEMO_TIMEOUT)
        yield KeptDemo(demo, json.loads(demo.stdout_document()))
    finally:
        demo.finish()


@pytest.mark.xdist_group("kept_demo")
def test_the_demo_at_debug_logs_no_payload(kept_demo: KeptDemo) -> None:
    """The relay's and workers' DEBUG logs, Dramatiq's own lines included, carry no payload:
    the customer ids and amounts exist only in the events' data."""
    # With --json the demo names its directory only in the Prometheus set-up it leaves.
    config = next(
        Path(m.group(1))
        for line in kept_demo.demo.seen
        if (m := re.search(r"--config\.file=(\S+)", line))
    )
    log_dir = config.parent.parent  # <log dir>/prometheus/prometheus.yml
    logs = {path.name: path.read_text() for path in log_dir.glob("*.log")}
    assert {"relay.log", "worker.log"} <= set(logs), sorted(logs)
    assert "Received args=" in logs["worker.log"]  # Dramatiq's DEBUG line, arguments withheld
    for name, text in logs.items():
        for marker in ("cus_", "amount_cents", "sku-"):
            assert marker not in text, (name, marker)
    assert "cus_" not in kept_demo.demo.output()


def wait_gone(
    processes: set[tuple[int, int]], paths: set[Path], timeout: float = 60
) -> tuple[list[tuple[int, int]], list[Path]]:
    """Whatever of ``processes`` and ``paths`` is still there after up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in processes if alive(p)]
        kept = [path for path in paths if path.exists()]
        if (not left and not kept) or time.monotonic() > deadline:
            return left, kept
        time.sleep(0.2)


def test_ctrl_c_mid_run_stops_everything_and_leaves_nothing_behind():
    demo = RunningDemo("--events", "100000", "--rate", "50")
    try:
        demo.wait_for("placing")
        time.sleep(2)  # orders flowing through relay and workers
        children = descendants(demo.process.pid)
        assert len(children) >= 5, children  # Postgres, Redis, relay, workers, ...
        dirs = server_dirs(children)
        assert len(dirs) == 2, dirs
        log_dir = demo.log_dir()
        assert log_dir.exists()

        demo.process.send_signal(signal.SIGINT)
        code = demo.process.wait(timeout=120)  # bounded: the demo's own budget is seconds
    finally:
        demo.finish()
    output = demo.output()
    assert code == 130, output
    assert "Traceback" not in output, output
    assert "interrupted" in output
    left, kept = wait_gone(children, {*dirs, log_dir}, timeout=10)
    assert not left, f"processes survived the demo: {left}"
    assert not kept, f"left behind: {kept}"


def test_a_killed_demo_takes_its_servers_relay_and_workers_with_it():
    demo = RunningDemo("--events", "20", "--rate", "0", "--keep-running")
    try:
        demo.wait_for("still running (--keep-running)")
        children = descendants(demo.process.pid)
        dirs = server_dirs(children)
        assert len(dirs) == 2, dirs  # the throwaway Postgres and Redis
        log_dir = demo.log_dir()
        assert log_dir.exists()

        demo.process.kill()  # SIGKILL: none of the demo's own cleanup can run
        demo.process.wait(timeout=30)
        left, kept = wait_gone(children, {*dirs, log_dir})
    finally:
        demo.finish()
    assert len(children) >= 6, children  # servers, their watchdogs, relay, workers, ...
    assert not left, f"still running after the demo was killed: {left}"
    assert not kept, f"left behind: {kept}"


def test_unreachable_database_is_one_clear_line():
    env = clean_env()
    env["PIPELINE_DATABASE_URL"] = "postgresql://demo@127.0.0.1:1/nowhere"
    env["PIPELINE_REDIS_URL"] = "redis://127.0.0.1:1/0"
    result = subprocess.run(
        demo_command("--events", "1"),
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    [error] = [line for line in result.stderr.splitlines() if line.startswith("pipeline: error:")]
    assert "127.0.0.1:1" in error, error


def test_payment_api_honours_idempotency_keys_like_stripe():
    import httpx

    from pipeline.tools.harness.payment_api import PaymentServer

    api = PaymentServer(delay=0.3).start()
    try:
        with httpx.Client(base_url=api.url, timeout=10) as client:
            body = {"run": "r1", "order_id": "o1", "amount_cents": 500}
            first = client.post("/v1/charges", json=body, headers={"Idempotency-Key": "k1"})
            again = client.post("/v1/charges", json=body, headers={"Idempotency-Key": "k1"})
            assert first.status_code == again.status_code == 200
            assert first.json() == again.json()  # the stored response, no new charge
            other = client.post(
                "/v1/charges", json={**body, "amount_cents": 501}, headers={"Idempotency-Key": "k1"}
            )
            assert other.status_code == 422
            assert client.post("/v1/charges", json=body).status_code == 400  # no key

            results: list[int] = []

            def post() -> None:
                with httpx.Client(base_url=api.url, timeout=10) as own:
                    response = own.post(
                        "/v1/emails", json={"run": "r2"}, headers={"Idempotency-Key": "k2"}
                    )
                    results.append(response.status_code)

            threads = [threading.Thread(target=post) for _ in range(2)]
            for thread in threads:
                thread.start()
                time.sleep(0.1)  # the second arrives while the first is still running
            for thread in threads:
                thread.join()
            assert sorted(results) == [200, 409]

            assert client.get("/health").json() == {"status": "ok"}
            ledger = client.get("/ledger", params={"run": "r1"}).json()
            assert [c["id"] for c in ledger["charges"]] == ["ch_1"]
            assert ledger["by_path"]["/v1/charges"] == {
                "requests": 4,
                "created": 1,
                "replayed": 1,
                "mismatch": 1,
                "rejected": 1,
            }
            assert ledger["outcomes_by_key"]["k1"] == ["created", "replayed", "mismatch"]
            emails = client.get("/ledger", params={"run": "r2"}).json()["charges"]
            assert [c["id"] for c in emails] == ["em_2"]
    finally:
        api.stop()


@pytest.mark.xdist_group("kept_demo")
def test_keep_running_writes_a_prometheus_config_that_scrapes_the_demo(
    kept_demo: KeptDemo, tmp_path: Path
) -> None:
    """The printed command starts a real Prometheus that scrapes both endpoints up; Ctrl-C
    then ends ``--keep-running`` cleanly, with nothing more on stdout than the summary."""
    from tests.opskit_support import Prometheus, tool

    demo = kept_demo.demo
    prometheus = None
    try:
        [command] = [line for line in demo.seen if "start it: prometheus" in line]
        config = Path(re.search(r"--config.file=(\S+)", command).group(1))
        checked = subprocess.run(
            [tool("promtool"), "check", "config", str(config)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert "SUCCESS: 2 rule files found" in checked.stdout
        # the same config, served on a port of the test's own
        prometheus = Prometheus.from_config(config, tmp_path)
        prometheus.start()
        up = wait_until_up(prometheus)
        assert up == {"pipeline-relay", "pipeline-worker"}
        check_every_counter_is_present(prometheus)
        alerting = [r for r in prometheus.rules() if r["type"] == "alerting"]
        assert len(alerting) >= 19
        runbook = alerting[0]["annotations"]["runbook_url"]
        assert runbook.startswith("file://") and runbook.endswith(".md")
        assert Path(runbook.removeprefix("file://")).is_file()
        demo.process.send_signal(signal.SIGINT)
        code = demo.process.wait(timeout=60)
    finally:
        if prometheus is not None:
            prometheus.stop()
        demo.finish()
    assert code == 0, demo.output()
    assert demo.out_lines.empty()  # stdout held the JSON summary and nothing else


# Counters of what a healthy demo never provokes (it injects duplicate deliveries, handler
# failures and one poison order, so those counters move): every known label set at 0.
UNPROVOKED = {
    "pipeline_publish_failures": ("event_type",),
    "pipeline_events_unrouted": ("event_type",),
    "pipeline_inbox_infrastructure_retries": ("consumer",),
    "pipeline_inbox_duplicates_dropped": ("queue",),
    "pipeline_deliveries_lost": ("queue",),
    "pipeline_unauthentic_messages": ("consumer",),
    "pipeline_broker_memory_lost": (),
    "pipeline_relay_listener_reconnects": (),
}


def declared_counters() -> dict[str, tuple[str, ...]]:
    """Every counter the metrics module declares: family name -> label names."""
    from prometheus_client import Counter

    from pipeline.observability import metrics

    return {
        c.describe()[0].name: tuple(c._labelnames)  # no public accessor
        for c in vars(metrics).values()
        if isinstance(c, Counter)
    }


def check_every_counter_is_present(prometheus) -> None:
    """Every declared counter has a series in Prometheus from the live demo (none appears
    only after its first increment); the kinds that did not happen read 0 for every
    consumer, queue and event type the demo registers."""
    from pipeline.config import Settings
    from pipeline.tools.demo.layout import APP_MODULE
    from pipeline.tools.ops.consumers import load_registry

    subscriptions = load_registry(Settings(app_modules=APP_MODULE)).all()
    known = {
        "consumer": {s.consumer for s in subscriptions},
        "queue": {s.queue for s in subscriptions},
        "event_type": {t for s in subscriptions for t in s.event_types},
    }
    counters = declared_counters()
    assert set(UNPROVOKED) <= set(counters)

    # both targets are up; their first scrapes may land a scrape interval apart
    deadline = time.monotonic() + 30
    while True:
        series = prometheus.query('{__name__=~"pipeline_.*_total"}')
        families = {s["metric"]["__name__"].removesuffix("_total") for s in series}
        if families >= set(counters) or time.monotonic() > deadline:
            break
        time.sleep(1)
    by_family: dict[str, list[dict]] = {}
    for sample in series:
        by_family.setdefault(sample["metric"]["__name__"].removesuffix("_total"), []).append(sample)
    assert set(counters) <= set(by_family)
    for family, labels in UNPROVOKED.items():
        assert tuple(counters[family][: len(labels)]) == labels, family
        samples = by_family[family]
        assert {float(s["value"][1]) for s in samples} == {0.0}, (family, samples)
        for label in labels:
            seen = {s["metric"][label] for s in samples}
            assert known[label] <= seen, (family, label, known[label] - seen)


def wait_until_up(prometheus) -> set[str]:
    deadline = time.monotonic() + 60
    while True:
        jobs = {r["metric"]["job"] for r in prometheus.query("up == 1")}
        if len(jobs) == 2 or time.monotonic() > deadline:
            return jobs
        time.sleep(1)
