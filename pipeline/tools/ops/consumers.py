"""The consumers of a deployment as the operator tools see them.

They are registered by importing ``PIPELINE_APP_MODULES`` (plus a command's ``--app``);
status needs their queues, replay their handlers, prune and doctor their policies.
"""

from __future__ import annotations

from pipeline.config import Settings
from pipeline.policy import ConsumerPolicy
from pipeline.registry import Registry


def load_registry(settings: Settings) -> Registry:
    """The registry after importing the app modules: consumers, queues and handlers."""
    from pipeline.registry import registry
    from pipeline.runtime import import_app_modules

    import_app_modules(settings.app_module_names())
    return registry


def consumer_policies(settings: Settings) -> list[ConsumerPolicy]:
    """Every registered consumer's policy, the canary's included."""
    from pipeline.inbox.canary import register_canary

    registry = load_registry(settings)
    register_canary(registry)
    return registry.policies(settings)
