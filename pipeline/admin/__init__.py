"""Operator tools: lineage (trace), status and dead-letter handling."""
