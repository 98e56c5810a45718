"""Throwaway Postgres and Redis servers for tests, benchmarks and the demo."""
