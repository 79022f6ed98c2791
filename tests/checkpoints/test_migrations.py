"""The migrated schema matches the SQLAlchemy models, and 0002 downgrades cleanly."""

from __future__ import annotations

from sqlalchemy import inspect
from support import schema_diff

from tierwatch.server.checkpoints import models as _checkpoint_models  # noqa: F401
from tierwatch.server.db import make_engine
from tierwatch.server.fleet import models as _fleet_models  # noqa: F401
from tierwatch.server.migrate import alembic_config, upgrade

CHECKPOINT_TABLES = {
    "jobs",
    "checkpoint_ledger",
    "checkpoint_rank_commits",
    "checkpoint_events",
    "job_progress",
    "job_restores",
}


def test_migrations_match_the_models(database_url):
    engine = make_engine(database_url)
    with engine.connect() as conn:
        diff = schema_diff(conn)
    engine.dispose()
    assert diff == []


def test_0002_downgrades_and_upgrades(tmp_path):
    from alembic import command

    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url)
    engine = make_engine(url)
    assert CHECKPOINT_TABLES <= set(inspect(engine).get_table_names())
    command.downgrade(alembic_config(url), "0001")
    engine.dispose()
    engine = make_engine(url)
    assert not CHECKPOINT_TABLES & set(inspect(engine).get_table_names())
    engine.dispose()
    upgrade(url)
    engine = make_engine(url)
    assert CHECKPOINT_TABLES <= set(inspect(engine).get_table_names())
    engine.dispose()
