"""Wiring for a relay or worker process: settings -> transport, publisher, actors.

Both process kinds build the same runtime from the same settings and application
modules, so the relay's routing and the workers' actors always agree.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import dramatiq

from pipeline.config import Settings
from pipeline.errors import ConfigurationError
from pipeline.inbox.actors import ProcessEngine, declare_inbox_actors
from pipeline.inbox.canary import register_canary
from pipeline.registry import Registry, registry
from pipeline.relay.actors import PublishingDispatcher, declare_publishing_actor
from pipeline.signing import event_source
from pipeline.transport.base import Transport
from pipeline.transport.factory import open_transport
from pipeline.transport.publisher import Publisher


@dataclass
class Runtime:
    settings: Settings
    registry: Registry
    transport: Transport
    publisher: Publisher
    publish_actor: dramatiq.Actor[Any, Any]
    dispatcher: PublishingDispatcher
    engine: ProcessEngine
    inbox_actors: dict[str, dramatiq.Actor[Any, Any]]

    @property
    def broker(self) -> Any:
        """The transport's Dramatiq broker: the actors are declared on it."""
        return self.transport.broker

    def close(self) -> None:
        self.transport.close()
        self.engine.dispose()


def import_app_modules(names: list[str]) -> None:
    """Import the application modules that register consumers (clear error if one is missing)."""
    for name in names:
        try:
            importlib.import_module(name)
        except (ImportError, TypeError, ValueError) as exc:  # ".x" and ".." raise TypeError
            raise ConfigurationError(
                f"PIPELINE_APP_MODULES / --app: cannot import module {name!r}: {exc}"
            ) from None


def build_runtime(
    settings: Settings, consumers: Registry = registry, *, set_global_broker: bool = True
) -> Runtime:
    import_app_modules(settings.app_module_names())
    register_canary(consumers)
    transport = open_transport(settings)
    if set_global_broker:
        dramatiq.set_broker(transport.broker)
    publisher = transport.publisher(event_source(settings))
    actor = declare_publishing_actor(transport, settings, consumers, publisher)
    engine = ProcessEngine(settings)
    inbox_actors = declare_inbox_actors(transport, settings, consumers, engine)
    return Runtime(
        settings=settings,
        registry=consumers,
        transport=transport,
        publisher=publisher,
        publish_actor=actor,
        dispatcher=PublishingDispatcher(settings, transport, actor),
        engine=engine,
        inbox_actors=inbox_actors,
    )
