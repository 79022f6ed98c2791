"""Migration 0006 (dashboard sessions, token expiry) on both backends: the migrated schema
matches the models for its tables, and it downgrades to 0005 and upgrades again."""

from __future__ import annotations

from alembic import command
from sqlalchemy import inspect
from support import migrated_database, schema_diff

from tierwatch.server.db import make_engine
from tierwatch.server.migrate import alembic_config, upgrade

TABLES = {"web_sessions", "api_tokens"}


def _table(entry) -> str:  # type: ignore[no-untyped-def]
    """The table an autogenerate diff entry is about (``modify_*`` entries come in lists)."""
    kind, *args = entry[0] if isinstance(entry, list) else entry
    if kind in ("add_table", "remove_table"):
        return args[0].name
    if kind in ("add_column", "remove_column") or kind.startswith("modify_"):
        return args[1]
    return args[0].table.name  # indexes and constraints know their table


def _diff_of_our_tables(url: str) -> list:
    """The differences between the migrated schema and the models, for :data:`TABLES`."""
    engine = make_engine(url)
    with engine.connect() as conn:
        diff = schema_diff(conn)
    engine.dispose()
    return [d for d in diff if _table(d) in TABLES]


def _schema(url: str) -> tuple[set[str], set[str]]:
    engine = make_engine(url)
    insp = inspect(engine)
    tables = set(insp.get_table_names())
    columns = {c["name"] for c in insp.get_columns("api_tokens")}
    engine.dispose()
    return tables, columns


def test_0006_matches_the_models_and_downgrades(request, database_url, tmp_path_factory):
    backend = request.node.callspec.params["database_url"]
    with migrated_database(backend, tmp_path_factory) as url:
        assert _diff_of_our_tables(url) == []
        tables, columns = _schema(url)
        assert "web_sessions" in tables
        assert "expires_at" in columns
        command.downgrade(alembic_config(url), "0005")
        tables, columns = _schema(url)
        assert "web_sessions" not in tables
        assert "expires_at" not in columns
        assert _diff_of_our_tables(url) != []  # (the comparison sees these tables)
        upgrade(url)
        assert _diff_of_our_tables(url) == []
