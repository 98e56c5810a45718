"""Migrations from empty rebuild exactly the declared schema, and upgrades are safe to repeat."""

from __future__ import annotations

import threading

import psycopg
import pytest
from sqlalchemy import create_engine, text

from pipeline.db.migrate import available_migrations, functions_sql, upgrade
from pipeline.db.tables import metadata

CATALOG_QUERIES = {
    "columns": """
        SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), a.attidentity
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE n.nspname = %(s)s AND c.relkind = 'r' AND a.attnum > 0 AND NOT a.attisdropped
          AND c.relname <> 'schema_migrations'
    """,
    "constraints": """
        SELECT c.relname, k.conname, pg_get_constraintdef(k.oid)
        FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(s)s AND c.relname <> 'schema_migrations'
    """,
    "indexes": """
        SELECT indexname, indexdef FROM pg_indexes
        WHERE schemaname = %(s)s AND tablename <> 'schema_migrations'
    """,
    "triggers": """
        SELECT t.tgname, pg_get_triggerdef(t.oid) FROM pg_trigger t
        JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(s)s AND NOT t.tgisinternal
    """,
    "functions": """
        SELECT p.proname, pg_get_functiondef(p.oid) FROM pg_proc p
        JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %(s)s
    """,
}


def catalog(url: str, schema: str = "pipeline") -> dict[str, list[tuple[object, ...]]]:
    with psycopg.connect(url) as conn:
        return {
            name: sorted(conn.execute(query, {"s": schema}).fetchall(), key=repr)
            for name, query in CATALOG_QUERIES.items()
        }


def sa_engine(url: str):
    return create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(url))


def test_migrations_rebuild_the_declared_schema(postgres_server_url, empty_database_url):
    from tests.conftest import create_database, drop_database

    migrated = sa_engine(empty_database_url)
    with migrated.begin() as conn:
        result = upgrade(conn, "pipeline")
    migrated.dispose()
    assert result.applied == [m.version for m in available_migrations()]

    name, declared_url = create_database(postgres_server_url)
    try:
        declared = sa_engine(declared_url)
        with declared.begin() as conn:
            conn.exec_driver_sql("CREATE SCHEMA pipeline")
            metadata.create_all(conn)
            conn.exec_driver_sql("SET LOCAL search_path TO pipeline")
            conn.exec_driver_sql(functions_sql("pipeline"))
        declared.dispose()
        want, got = catalog(declared_url), catalog(empty_database_url)
        for part in CATALOG_QUERIES:
            assert got[part] == want[part], part
        assert len(got["columns"]) > 50 and len(got["indexes"]) >= 10
    finally:
        drop_database(postgres_server_url, name)


def test_upgrade_twice_is_a_no_op(empty_database_url):
    engine = sa_engine(empty_database_url)
    with engine.begin() as conn:
        first = upgrade(conn, "pipeline")
    before = catalog(empty_database_url)
    with engine.begin() as conn:
        second = upgrade(conn, "pipeline")
        versions = conn.execute(text("SELECT count(*) FROM pipeline.schema_migrations")).scalar()
    engine.dispose()
    assert first.changed and not second.changed
    assert versions == len(available_migrations()) + 1  # + the functions checksum row
    assert catalog(empty_database_url) == before


def test_concurrent_upgrades_both_succeed(empty_database_url):
    results, errors = [], []
    barrier = threading.Barrier(2)

    def run() -> None:
        engine = sa_engine(empty_database_url)
        try:
            barrier.wait()
            with engine.begin() as conn:
                results.append(upgrade(conn, "pipeline"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            engine.dispose()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert sorted(r.changed for r in results) == [False, True]


def test_custom_schema_name_and_invalid_one(empty_database_url):
    from pipeline.errors import ConfigurationError

    engine = sa_engine(empty_database_url)
    with engine.begin() as conn:
        upgrade(conn, "orders_pipeline")
        assert conn.execute(text("SELECT to_regclass('orders_pipeline.outbox')")).scalar()
    with pytest.raises(ConfigurationError, match="invalid schema name 'bad-name; drop'"):
        with engine.begin() as conn:
            upgrade(conn, "bad-name; drop")
    engine.dispose()
