"""One replica's PostgreSQL connections, counted from the engines the real app creates: three
replicas fit the test server's ``max_connections`` less its reserved connections, with room
left for admin tools (docs/operations.md, "Running several replicas")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, text

from tierwatch.server import db
from tierwatch.server.config import Settings
from tierwatch.server.db import DEFAULT_MAX_OVERFLOW, DEFAULT_POOL_SIZE, make_engine, pool_capacity
from tierwatch.server.main import connection_budget, create_app
from tierwatch.server.migrate import upgrade

pytestmark = pytest.mark.postgres

REPLICAS = 3
#: Connections left for psql, pg_dump, a metrics exporter, the tierwatch-server CLI …
ADMIN_HEADROOM = 10
#: The budget docs/operations.md states for the default settings.
DOCUMENTED_PER_REPLICA = 29


@pytest.fixture
def engines_created(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Engine]]:
    """Every engine created through tierwatch.server.db (all of the app's are)."""
    created: list[Engine] = []
    real = db.create_engine

    def _recording(*args: Any, **kwargs: Any) -> Engine:
        engine = real(*args, **kwargs)
        created.append(engine)
        return engine

    monkeypatch.setattr(db, "create_engine", _recording)
    yield created
    for engine in created:
        engine.dispose()


def _server_limits(url: str) -> tuple[int, int]:
    """``max_connections`` and the connections reserved from it (superuser_reserved_connections,
    and reserved_connections from PostgreSQL 16 on)."""
    engine = make_engine(url, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as conn:
            max_connections = int(conn.execute(text("SHOW max_connections")).scalar_one())
            reserved = int(conn.execute(text("SHOW superuser_reserved_connections")).scalar_one())
            has_reserved = conn.execute(
                text("SELECT count(*) FROM pg_settings WHERE name = 'reserved_connections'")
            ).scalar_one()
            if has_reserved:
                reserved += int(conn.execute(text("SHOW reserved_connections")).scalar_one())
    finally:
        engine.dispose()
    return max_connections, reserved


def test_three_replicas_fit_max_connections(pg_url, fresh_schema, engines_created):
    app = create_app(Settings(database_url=pg_url, dev=True, prune_interval_s=0))
    budget = connection_budget(app)
    per_replica = sum(budget.values())
    # Every engine the app made is in the budget, and nothing else.
    assert {id(e) for e in engines_created} == {
        id(app.state.engine),
        id(app.state.writer_engine),
        id(app.state.background.lock.engine),
    }
    assert sum(pool_capacity(e) for e in engines_created) == per_replica
    assert budget == {
        "requests": DEFAULT_POOL_SIZE + DEFAULT_MAX_OVERFLOW,
        "ingest writer": 2,
        "leader lock": 2,
    }
    assert per_replica == DOCUMENTED_PER_REPLICA
    # `serve` migrates first, on one connection closed before the app's open.
    engines_created.clear()
    upgrade(fresh_schema)
    assert [pool_capacity(e) for e in engines_created] == [1]

    max_connections, reserved = _server_limits(pg_url)
    usable = max_connections - reserved
    assert REPLICAS * per_replica + ADMIN_HEADROOM <= usable, (
        f"{REPLICAS} replicas × {per_replica} + {ADMIN_HEADROOM} > {max_connections} - {reserved}"
    )


def test_the_request_pool_follows_the_settings(pg_url, engines_created):
    settings = Settings(database_url=pg_url, dev=True, db_pool_size=3, db_max_overflow=2)
    app = create_app(settings)
    assert connection_budget(app)["requests"] == 5
    assert app.state.engine.pool.size() == 3
