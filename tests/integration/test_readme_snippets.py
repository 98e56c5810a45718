"""The README's Quickstart, run as written: its Python blocks against a real database.

The Quickstart's two Python blocks are taken from README.md in order (the producing
script, then ``shop/consumers.py``) and run unchanged, with only the environment they
read set to this test's Postgres and Redis: the script must create its table, write the
order and its event in one transaction and print the event's id; the consumer module,
imported through ``PIPELINE_APP_MODULES`` as ``pipeline worker`` imports it, must
register its consumer, and its handler, run by a relay and a Dramatiq worker in this
process, must charge once, mark the order paid and publish its follow-up event, which
``pipeline trace`` then shows. A snippet edited into something that does not run, or
that no longer does what the README says around it, fails here.
"""

from __future__ import annotations

import json
import re
import runpy
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import httpx
import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, create_engine, text

from pipeline.config import configure, get_settings
from pipeline.registry import registry
from pipeline.runtime import build_runtime
from pipeline.tools.cli import cli
from tests.support import running_relay, wait_until

ROOT = Path(__file__).resolve().parents[2]
CONSUMER = "billing"


def quickstart_python() -> list[str]:
    """The Python blocks of the README's Quickstart section, in order."""
    text_ = (ROOT / "README.md").read_text()
    section = text_.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.fixture
def readme_env(
    database_url: str, redis_server_url: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """The environment the Quickstart exports, pointed at this test's servers."""
    monkeypatch.setenv("PIPELINE_DATABASE_URL", database_url)
    monkeypatch.setenv("PIPELINE_REDIS_URL", redis_server_url)
    monkeypatch.setenv("PIPELINE_REDIS_NAMESPACE", redis_namespace)
    monkeypatch.setenv("PIPELINE_APP_MODULES", "shop.consumers")
    monkeypatch.setenv("PIPELINE_CANARY_INTERVAL", "0")
    configure(None)  # get_settings() reads the environment set here
    yield
    configure(None)


@pytest.fixture
def shop_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on the import path for the README's ``shop/consumers.py``."""
    (tmp_path / "shop").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "shop"
    for name in ("shop.consumers", "shop"):
        sys.modules.pop(name, None)
    if CONSUMER in {s.consumer for s in registry.all()}:
        registry.remove(CONSUMER)


def run_script(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], str]:
    """Run ``path`` as ``python path`` would; its globals and what it printed."""
    namespace = runpy.run_path(str(path), run_name="__main__")
    return namespace, capsys.readouterr().out


def test_quickstart_snippets_run_as_written(
    readme_env: None,
    shop_package: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    produce, consume = quickstart_python()
    check = create_engine(get_settings().sqlalchemy_url())
    try:
        script = shop_package.parent / "place_order.py"
        script.write_text(produce)
        event_id = _produce(script, check, capsys)
        _consume(consume, shop_package, check, event_id)
        result = CliRunner().invoke(cli, ["trace", str(event_id)])
        assert result.exit_code == 0, result.output
        assert str(event_id) in result.output
        assert CONSUMER in result.output and "payment.charged" in result.output
    finally:
        check.dispose()


def _produce(script: Path, check: Engine, capsys: pytest.CaptureFixture[str]) -> uuid.UUID:
    """The script: one order row, one event in the outbox, its id returned and printed."""
    namespace, printed = run_script(script, capsys)
    namespace["engine"].dispose()
    event_id = namespace["event_id"]
    assert isinstance(event_id, uuid.UUID)
    assert printed.split() == [str(event_id)]
    with check.connect() as conn:
        orders = conn.execute(text("SELECT id, total_cents, paid FROM orders")).all()
        events = conn.execute(
            text(
                "SELECT id, event_type, aggregate_type, aggregate_id, payload FROM pipeline.outbox"
            )
        ).all()
    assert [tuple(row) for row in orders] == [("o-1", 4200, False)]
    assert [tuple(row) for row in events] == [
        (event_id, "order.placed", "order", "o-1", {"order_id": "o-1", "total_cents": 4200})
    ]
    return event_id


def _consume(code: str, package: Path, check: Engine, event_id: uuid.UUID) -> None:
    """The module, imported through PIPELINE_APP_MODULES, handles the event once."""
    (package / "consumers.py").write_text(code)
    requests: list[httpx.Request] = []

    def payments(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(201, json={"id": "ch_1", "status": "succeeded"})

    runtime = build_runtime(get_settings())  # imports shop.consumers, as `pipeline worker` does
    try:
        subscription = registry.get(CONSUMER)
        assert subscription.accepts("order.placed")
        assert not subscription.accepts("payment.charged")
        module: Any = sys.modules["shop.consumers"]
        module.http.close()
        module.http = httpx.Client(transport=httpx.MockTransport(payments))
        worker = dramatiq.Worker(runtime.broker, queues={subscription.queue}, worker_threads=1)
        worker.start()
        try:
            with running_relay(runtime, registry):
                outcome = wait_until(lambda: _outcome(check, event_id), timeout=60)
        finally:
            worker.stop()
    finally:
        runtime.close()

    assert outcome == ("processed", None), f"the handler failed: {outcome}"
    (request,) = requests
    assert request.url == "https://payments.example/v1/charges"
    assert json.loads(request.content) == {"order_id": "o-1", "amount": 4200}
    assert request.headers["Idempotency-Key"]
    with check.connect() as conn:
        paid = conn.execute(text("SELECT paid FROM orders WHERE id = 'o-1'")).scalar()
        follow_up = conn.execute(
            text(
                "SELECT aggregate_id, payload, headers->>'causation_id' FROM pipeline.outbox"
                " WHERE event_type = 'payment.charged'"
            )
        ).all()
    assert paid is True
    assert [tuple(row) for row in follow_up] == [("o-1", {"order_id": "o-1"}, str(event_id))]


def _outcome(check: Engine, event_id: uuid.UUID) -> tuple[str, str | None] | None:
    """The consumer's first outcome for the event (status, last error), once it has one."""
    with check.connect() as conn:
        row = conn.execute(
            text(
                "SELECT status, last_error FROM pipeline.inbox"
                " WHERE consumer = :consumer AND event_id = :id"
                " AND status IN ('processed', 'failed', 'dead')"
            ),
            {"consumer": CONSUMER, "id": event_id},
        ).first()
    return None if row is None else (row[0], row[1])
