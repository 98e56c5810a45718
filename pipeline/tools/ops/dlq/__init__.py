"""Dead-letter tools behind ``pipeline dlq``: filters, reads (``access``), replay (``replay``
per dead letter, ``replay_run`` for a whole request), the sandbox, purge."""
