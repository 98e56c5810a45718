"""The demo: a realistic order workflow on an embedded pipeline (``pipeline demo``)."""
