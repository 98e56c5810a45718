"""Dramatiq on RabbitMQ: quorum queues, publisher confirms, the management API's few calls.

Only this package knows Dramatiq's RabbitMQ internals and pika's; the rest of the pipeline
reaches it through :class:`pipeline.transport.amqp.transport.AmqpTransport`.
"""
