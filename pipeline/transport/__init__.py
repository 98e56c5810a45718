"""The Dramatiq/Redis transport: the broker and the publisher that enqueues deliveries."""
