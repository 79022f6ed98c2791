"""The sign-in rate limit holds across replicas: its failures are counted in the database, so
two apps on one database share each client address's budget; the window moves, and failures
older than it are deleted. On both backends, as is migration 0008 (the table)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from alembic import command
from fastapi.testclient import TestClient
from sqlalchemy import func, inspect, select
from support import migrated_database, schema_diff
from web_support import csrf_from

from tierwatch.server.db import make_engine, make_sessionmaker
from tierwatch.server.main import create_app
from tierwatch.server.migrate import alembic_config, upgrade
from tierwatch.server.security import LoginFailure, LoginLimiter


def _attempt(browser: TestClient, token: str) -> int:
    page = browser.get("/login")
    r = browser.post(
        "/login", data={"token": token, "next": "/", "csrf_token": csrf_from(page.text)}
    )
    return r.status_code


def test_two_replicas_share_the_sign_in_budget(settings, make_token):
    limited = settings.model_copy(update={"login_attempts": 3, "login_window_s": 60})
    one, two = create_app(limited), create_app(limited)
    good = make_token("viewer")
    # (No lifespan: the sign-in needs neither the ingest writer nor background work.)
    a = TestClient(one, follow_redirects=False)
    b = TestClient(two, follow_redirects=False)
    assert _attempt(a, "tw_wrong-1") == 401
    assert _attempt(b, "tw_wrong-2") == 401
    assert _attempt(a, "tw_wrong-3") == 401
    # Three failures in all, on two replicas: both refuse the address now.
    assert _attempt(b, good) == 429
    assert _attempt(a, good) == 429
    # Another address has its own budget.
    other = TestClient(two, follow_redirects=False, client=("10.0.0.9", 40000))
    assert _attempt(other, good) == 303
    for app in (one, two):
        app.state.writer_engine.dispose()
        app.state.engine.dispose()


def test_the_window_moves_and_old_failures_are_pruned(db_url):
    engine = make_engine(db_url)
    factory = make_sessionmaker(engine)
    now = [datetime(2026, 12, 2, 12, 0, tzinfo=UTC)]

    def clock() -> datetime:
        return now[0]

    def rows() -> int:
        with factory() as s:
            return int(s.scalar(select(func.count()).select_from(LoginFailure)) or 0)

    one = LoginLimiter(factory, 2, 60, clock=clock)
    two = LoginLimiter(factory, 2, 60, clock=clock)  # another replica
    try:
        one.failed("10.0.0.1")
        now[0] += timedelta(seconds=30)
        assert not two.blocked("10.0.0.1")
        two.failed("10.0.0.1")
        assert one.blocked("10.0.0.1")
        assert two.blocked("10.0.0.1")
        assert not one.blocked("10.0.0.2")
        # A moving window: 61 s after the first failure only the second is in it.
        now[0] += timedelta(seconds=31)
        assert not one.blocked("10.0.0.1")
        for n in range(20):  # many addresses that fail once and never come back
            two.failed(f"10.1.0.{n}")
        assert rows() == 21  # the second failure and these: the first fell out and went
        # Any later failure deletes every failure older than the window.
        now[0] += timedelta(seconds=61)
        one.failed("10.0.0.3")
        assert rows() == 1
        assert one.blocked("10.0.0.3") is False
    finally:
        engine.dispose()


def test_0008_matches_the_model_and_downgrades(request, database_url, tmp_path_factory):
    backend = request.node.callspec.params["database_url"]
    with migrated_database(backend, tmp_path_factory) as url:
        engine = make_engine(url)
        try:
            with engine.connect() as conn:
                diff = schema_diff(conn)
            assert [d for d in diff if "login_failures" in repr(d)] == []
            assert "login_failures" in inspect(engine).get_table_names()
            command.downgrade(alembic_config(url), "0007")
            assert "login_failures" not in inspect(engine).get_table_names()
            upgrade(url)
            assert "login_failures" in inspect(engine).get_table_names()
        finally:
            engine.dispose()
