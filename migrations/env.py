"""Alembic environment: migrates the database named by the caller (see app/migrate.py)."""

from __future__ import annotations

from alembic import context

from tierwatch.server import security as _security  # noqa: F401  (login_failures)
from tierwatch.server import tokens as _tokens  # noqa: F401
from tierwatch.server.actions import models as _action_models  # noqa: F401
from tierwatch.server.alerts import models as _alert_models  # noqa: F401
from tierwatch.server.checkpoints import models as _checkpoint_models  # noqa: F401
from tierwatch.server.config import get_settings
from tierwatch.server.credentials import models as _credential_models  # noqa: F401
from tierwatch.server.db import Base, make_engine
from tierwatch.server.fleet import models as _fleet_models  # noqa: F401  (registers tables)
from tierwatch.server.fleet import partitions

config = context.config
url = config.attributes.get("database_url") or get_settings().database_url
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        _run(connectable)
        return
    engine = make_engine(url)
    with engine.connect() as connection:
        _run(connection)
    engine.dispose()


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        include_object=partitions.include_in_autogenerate,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
