"""Migration 0003 creates the alert tables as the models declare them and downgrades cleanly."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from tierwatch.server.alerts import models as _alert_models  # noqa: F401
from tierwatch.server.db import Base, make_engine
from tierwatch.server.migrate import alembic_config, upgrade

ALERT_TABLES = {"alerts", "alert_deliveries"}


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _ours(obj, name, type_, reflected, compare_to) -> bool:  # type: ignore[no-untyped-def]  # noqa: ARG001
    table = name if type_ == "table" else getattr(getattr(obj, "table", None), "name", None)
    return table in ALERT_TABLES


def test_alert_tables_match_the_models(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"include_object": _ours})
            diff = compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()
    assert diff == []


def test_the_comparison_sees_a_missing_table(tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url, "0002")
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"include_object": _ours})
            diff = compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()
    assert {d[1].name for d in diff if d[0] == "add_table"} == ALERT_TABLES


def test_0003_downgrades_and_upgrades(tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url)
    assert ALERT_TABLES <= _tables(url)
    command.downgrade(alembic_config(url), "0002")
    assert not ALERT_TABLES & _tables(url)
    assert "jobs" in _tables(url)  # 0002's tables stay
    upgrade(url)
    assert ALERT_TABLES <= _tables(url)
