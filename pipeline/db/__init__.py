"""Database layer: declared tables, versioned migrations and named SQL queries."""
