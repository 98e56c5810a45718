"""Storage behind typed methods: the only code that runs the engine's named SQL.

Each store wraps the queries of one part of the schema and returns typed rows; the
relay, the inbox, the producer and the tools call its methods and never a query by
name. A store is built for one pipeline schema (cheap: the queries are rendered once
per schema and cached) and takes the connection each call runs on, so transactions
stay the caller's:

- :mod:`.outbox` — the producer's insert, the relay's claim and settlement, backlog;
- :mod:`.ledger` — the delivery ledger's sweep;
- :mod:`.inbox` — a consumer's claims, failures and dead letters;
- :mod:`.dead_letters` — the dead-letter tools' reads, replays and purges;
- :mod:`.audit` — the operator audit log;
- :mod:`.heartbeats` — the relays' and worker processes' heartbeats;
- :mod:`.state` — the stored state the relay exports as gauges (backlog, owed, sizes);
- :mod:`.lineage` — one event's record, for ``pipeline trace``;
- :mod:`.diagnostics` — catalog and health reads for ``pipeline doctor`` and ``status``;
- :mod:`.retention` — the prune passes' lock and batches.

The SQL stays in ``pipeline/db/*.sql`` (:mod:`pipeline.db.queries` loads it).
"""
