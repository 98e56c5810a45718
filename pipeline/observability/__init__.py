"""Tracing, metrics and logging: the pipeline's observability contract."""
