"""Tests share a process (an xdist worker), and so the process-wide consumer registry.

An app imported into it by one test (the demo's routes, loaded by a demo test that runs in
this process) once stayed there, and a later test's app with a consumer of the same name
was refused at import ("consumer 'payments' is registered twice") or, lent to an
in-process command, lost to the other app's handler. Which modules shared a worker decided
it. These tests run in file order in one process: the first leaves the demo's consumers
behind, the next ones find them gone.
"""

from __future__ import annotations

import importlib
import sys

from pipeline.registry import registry as global_registry
from tests.support import _APP_REGISTRIES, app_in_global_registry, app_registry

DEMO_APP = "pipeline.tools.demo.app"
DLQ_APP = "tests.apps.dlq_app"
SLOW_APP = "tests.apps.slow_retry_app"


def test_a_test_that_loads_the_demo_app_leaves_its_consumers_behind() -> None:
    sys.modules.pop(DEMO_APP, None)  # as if loaded for the first time in this process
    importlib.import_module(DEMO_APP)
    assert {"payments", "inventory", "notifications"} <= consumers()


def test_the_next_test_finds_them_gone_and_their_module_imports_again() -> None:
    assert "payments" not in consumers()
    importlib.import_module(DEMO_APP)  # registers again: it was dropped from the cache
    assert "payments" in consumers()


def test_an_app_lent_to_a_command_steps_over_a_consumer_of_the_same_name() -> None:
    importlib.import_module(DEMO_APP)
    demo_handler = global_registry.get("payments").handler
    lent = app_registry(DLQ_APP).get("payments").handler
    assert lent is not demo_handler
    with app_in_global_registry(DLQ_APP):
        assert global_registry.get("payments").handler is lent
    assert global_registry.get("payments").handler is demo_handler  # as before


def test_an_app_a_command_imported_meanwhile_is_found_again_afterwards() -> None:
    """A command's ``--app`` imports a module into the process-wide registry; when the
    registry is put back, the module leaves the import cache with its consumers, so the
    next import finds them: cached without them, it once gave an in-process worker no
    consumers at all (its tests timed out with nothing delivered)."""
    sys.modules.pop(SLOW_APP, None)
    _APP_REGISTRIES.pop(SLOW_APP, None)
    with app_in_global_registry(DLQ_APP):
        importlib.import_module(SLOW_APP)  # what `pipeline status --app SLOW_APP` does
        assert "slowpoke" in consumers()
    assert "slowpoke" not in consumers()
    assert [s.consumer for s in app_registry(SLOW_APP).all()] == ["slowpoke"]


def consumers() -> set[str]:
    return {subscription.consumer for subscription in global_registry.all()}
