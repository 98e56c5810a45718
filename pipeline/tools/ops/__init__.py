"""Operator tools: status, state gauges, lineage (trace) and dead-letter handling."""
