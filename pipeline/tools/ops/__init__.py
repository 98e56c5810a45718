"""Operator actions and reads behind the ``pipeline`` commands: status, doctor, prune,
trace (lineage), the schema, state gauges and dead-letter handling.

They return results and print nothing, so code other than the CLI can call them; the
CLI (:mod:`pipeline.tools.cli`) parses options, calls them and renders what they return.
"""
