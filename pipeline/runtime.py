"""Wiring for a relay or worker process: settings -> broker, publisher, actors.

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
from pipeline.transport.broker import PipelineRedisBroker, make_broker
from pipeline.transport.publisher import DramatiqRedisPublisher


@dataclass
class Runtime:
    settings: Settings
    registry: Registry
    broker: PipelineRedisBroker
    publisher: DramatiqRedisPublisher
    publish_actor: dramatiq.Actor[Any, Any]
    dispatcher: PublishingDispatcher
    engine: ProcessEngine
    inbox_actors: dict[str, dramatiq.Actor[Any, Any]]

    def close(self) -> None:
        self.broker.close()
        self.engine.dispose()


def event_source(settings: Settings) -> str:
    """The CloudEvents ``source`` of this pipeline's events."""
    return f"/pipeline/{settings.schema_name}"


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
    broker = make_broker(settings)
    if set_global_broker:
        dramatiq.set_broker(broker)
    publisher = DramatiqRedisPublisher(broker, event_source(settings))
    actor = declare_publishing_actor(broker, settings, consumers, publisher)
    engine = ProcessEngine(settings)
    inbox_actors = declare_inbox_actors(broker, settings, consumers, engine)
    return Runtime(
        settings=settings,
        registry=consumers,
        broker=broker,
        publisher=publisher,
        publish_actor=actor,
        dispatcher=PublishingDispatcher(settings, broker, actor),
        engine=engine,
        inbox_actors=inbox_actors,
    )
