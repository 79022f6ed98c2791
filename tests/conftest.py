"""Shared fixtures: migrated databases (SQLite always, PostgreSQL when configured), apps,
clients and tokens.

PostgreSQL tests run when ``TIERWATCH_TEST_DATABASE_URL`` is set (``.ci/run`` sets it); each
test session migrates into its own schema, dropped at the end.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Connection, Engine, event
from sqlalchemy.orm import Session
from support import PG_URL, migrated_database
from web_support import sign_in

from tierwatch.server.config import Settings
from tierwatch.server.db import Base, make_engine, make_sessionmaker
from tierwatch.server.main import create_app
from tierwatch.server.tokens import create_token

# The process fixtures (server, start_agent, browser) for e2e, security and browser tests,
# and the loopback S3 server (s3_server, s3_bucket, throttled_proxy) for the persistent tier;
# shared helper modules live in tests/helpers/ (on pytest's pythonpath).
pytest_plugins = ["process_fixtures", "s3_server"]

REPO_ROOT = Path(__file__).resolve().parent.parent

#: Every PostgreSQL engine that opened a connection in this worker (weakly held).
_PG_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


@event.listens_for(Engine, "engine_connect")
def _track_engine(conn: Connection) -> None:
    if conn.engine.dialect.name == "postgresql":
        _PG_ENGINES.add(conn.engine)


@pytest.fixture(autouse=True)
def _close_idle_connections() -> Iterator[None]:
    """Close the idle pooled connections of every PostgreSQL engine after each test.

    A test's app whose lifespan never ran (or an engine a test made) keeps its pool until
    garbage collection, which app reference cycles delay: three workers once held 80+ idle
    connections and the suite hit PostgreSQL's ``max_connections`` (100). Connections in
    use (a leader lock, a session-scoped server) are not touched; a disposed engine opens
    new ones when it is used again.
    """
    yield
    for engine in list(_PG_ENGINES):
        engine.dispose()


BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param(
        "postgres",
        id="postgres",
        marks=[
            pytest.mark.postgres,
            pytest.mark.skipif(
                not PG_URL, reason="TIERWATCH_TEST_DATABASE_URL is not set (.ci/run sets it)"
            ),
        ],
    ),
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked ``one_backend`` runs on PostgreSQL when it is configured (what a cluster
    runs), else on SQLite: its other backend's copy is deselected, not skipped. For tests
    whose subject is not the SQL: multi-process tests outside tests/e2e, and request checks
    (roles, CSRF, validation) whose SQL other tests cover on both backends."""
    keep = "postgres" if PG_URL else "sqlite"
    chosen, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        backend = callspec.params.get("database_url") if callspec is not None else None
        if item.get_closest_marker("one_backend") and backend not in (None, keep):
            dropped.append(item)
        else:
            chosen.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = chosen
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        items[:] = spread_heavy_tests(items, workers)


def spread_heavy_tests(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """The collection reordered so each xdist worker starts with its share of the heavy
    (``e2e``/``slow``) tests.

    ``--dist worksteal`` first hands worker i the i-th contiguous chunk of the collection
    (``remaining // (workers - i)`` items) and later steals from the tail of a worker's queue.
    In collection order, the multi-process tests all sit in one chunk (tests/e2e), so one
    worker ran them back to back while the others ran out of work and stole its light tail.
    Here the heavy tests are dealt round-robin into the chunks and lead each one; the light
    tests fill the chunks up to xdist's sizes, so a steal takes light tests. Every worker
    computes the same order (it must: xdist checks that the collections agree).
    """
    heavy = [i for i in items if i.get_closest_marker("e2e") or i.get_closest_marker("slow")]
    heavy_ids = {id(i) for i in heavy}
    light = [i for i in items if id(i) not in heavy_ids]
    sizes, remaining = [], len(items)
    for w in range(workers):
        sizes.append(remaining // (workers - w))
        remaining -= sizes[-1]
    chunks: list[list[pytest.Item]] = [[] for _ in range(workers)]
    for n, item in enumerate(heavy):
        chunks[n % workers].append(item)
    rest = iter(light)
    for chunk, size in zip(chunks, sizes, strict=True):
        while len(chunk) < size:
            item = next(rest, None)
            if item is None:  # a selection of mostly heavy tests: the light ones ran out
                break
            chunk.append(item)
    ordered = [i for chunk in chunks for i in chunk]
    ordered += list(rest)  # (only when the heavy tests outnumber a chunk)
    return ordered


@pytest.fixture(scope="session", params=BACKENDS)
def database_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A freshly migrated database URL for the whole test session, per backend.

    tests/e2e overrides it with one backend: those tests are about processes, not SQL.
    """
    with migrated_database(request.param, tmp_path_factory) as url:
        yield url


@pytest.fixture
def db_url(database_url: str) -> str:
    """The session database, emptied before each test."""
    engine = make_engine(database_url)
    with engine.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(table.delete())
    engine.dispose()
    return database_url


@pytest.fixture
def settings(db_url: str) -> Settings:
    """Dev-mode settings on the test database, pruner off, /metrics rendered every scrape
    (tests scrape right after a change; tests/server/test_metrics.py covers the cache)."""
    return Settings(database_url=db_url, dev=True, prune_interval_s=0, metrics_cache_s=0)


@pytest.fixture
def app(settings: Settings):  # type: ignore[no-untyped-def]
    """The control-plane app on the test database."""
    return create_app(settings)


@pytest.fixture
def client(app) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    """A client talking to the app in-process (lifespan run)."""
    with TestClient(app) as c:
        yield c


@pytest.fixture
def session(app) -> Iterator[Session]:  # type: ignore[no-untyped-def]
    """A session on the app's database."""
    with app.state.sessionmaker() as s:
        yield s


@pytest.fixture
def make_token(app):  # type: ignore[no-untyped-def]
    """Create a token: ``make_token("agent", "node-a") -> plaintext``."""

    def _make(role: str, node: str | None = None) -> str:
        with make_sessionmaker(app.state.engine)() as s:
            plaintext, _ = create_token(s, role=role, node=node)
            s.commit()
        return plaintext

    return _make


@pytest.fixture
def viewer(client: TestClient, make_token) -> TestClient:  # type: ignore[no-untyped-def]
    """The test client, signed in to the dashboard with a viewer token."""
    r = sign_in(client, make_token("viewer"))
    assert r.status_code == 303, r.text
    return client


@pytest.fixture
def agent_token(make_token):  # type: ignore[no-untyped-def]
    """``agent_token("n1") -> plaintext`` of an agent token bound to that node."""
    return lambda node: make_token("agent", node)
