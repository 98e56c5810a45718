"""Dramatiq on Redis: the broker, its consumer, the key layout and the message encoding.

Only this package knows Dramatiq's Redis internals; the rest of the pipeline reaches it
through :class:`pipeline.transport.redis.transport.RedisTransport`.
"""
