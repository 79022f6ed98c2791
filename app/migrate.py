"""Run Alembic migrations programmatically (``tierwatch-server migrate``)."""

from __future__ import annotations

from alembic import command
from alembic.config import Config

from tierwatch.server.resources import resource_dir


def alembic_config(database_url: str) -> Config:
    """An Alembic config pointing at the packaged migrations and ``database_url``."""
    cfg = Config()
    cfg.set_main_option("script_location", str(resource_dir("migrations")))
    cfg.attributes["database_url"] = database_url
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    """Upgrade the database at ``database_url`` to ``revision``."""
    command.upgrade(alembic_config(database_url), revision)
