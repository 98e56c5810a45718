"""Database layer: declared tables, versioned migrations, named SQL and the typed stores
that run it (:mod:`pipeline.db.stores`)."""
