"""Dead-letter tools behind ``pipeline dlq``: filters, listing, replay, purge."""
