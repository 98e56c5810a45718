"""The inbox: consumers whose handlers take effect once per event."""

from pipeline.inbox.consumer import ConsumerDefinition, consumer
from pipeline.inbox.context import HandlerContext
from pipeline.inbox.upcasting import upcaster

__all__ = ["ConsumerDefinition", "HandlerContext", "consumer", "upcaster"]
