"""Routes for relay tests: two consumers that receive every event type (no handlers)."""

from pipeline.registry import registry

registry.subscribe("audit", ["*"])
registry.subscribe("billing", ["order.placed", "order.paid"])
