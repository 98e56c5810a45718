"""Peers on the end-to-end benchmark's workload: ``python -m benchmarks.peers``.

Each peer has a module here with the same four parts: ``install`` (its tables),
``reset`` (empty them between measurements), ``Producer`` (one event per producer
transaction) and ``commands`` (the consumer processes to start). The handler of every
peer records ``time.time()`` on entry and writes one row, as the pipeline's own
benchmark consumer does, so the same measurement code (``common``) serves them all.
"""
