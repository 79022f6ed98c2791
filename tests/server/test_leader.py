"""The leader lock: on PostgreSQL exactly one holder per database schema (a deployment), taken
over when the holder goes; on SQLite every process leads (one server per file)."""

from __future__ import annotations

import uuid

from sqlalchemy import text
from sqlalchemy.engine import make_url

from tierwatch.server.db import make_engine
from tierwatch.server.leader import LeaderLock


def _other_schema(db_url: str, schema: str) -> str:
    return (
        make_url(db_url)
        .update_query_dict({"options": f"-csearch_path={schema}"})
        .render_as_string(hide_password=False)
    )


def test_one_leader_per_schema_and_takeover(db_url):
    if make_url(db_url).get_backend_name() == "postgresql":
        # A schema of its own: a server or app of an earlier test in this session may still
        # lead the session's schema, and this test is about who gets the lock first.
        own = f"tw_leader_{uuid.uuid4().hex[:8]}"
        admin = make_engine(db_url)
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{own}"'))
        try:
            _one_leader_and_takeover(_other_schema(db_url, own))
        finally:
            with admin.begin() as conn:
                conn.execute(text(f'DROP SCHEMA "{own}" CASCADE'))
            admin.dispose()
    else:
        _one_leader_and_takeover(db_url)


def _one_leader_and_takeover(db_url: str) -> None:
    first, second = make_engine(db_url), make_engine(db_url)
    a, b = LeaderLock(first), LeaderLock(second)
    try:
        if not a.is_postgres:
            assert a.check()
            assert b.check()
            return
        assert a.check()
        assert not b.check()
        assert a.check()  # kept
        a.release()
        assert b.check()
        assert not a.check()
        # Another deployment (another schema of the same database) has its own lock.
        schema = f"tw_other_{uuid.uuid4().hex[:8]}"
        with first.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        other = make_engine(_other_schema(db_url, schema))
        third = LeaderLock(other)
        try:
            assert third.check()
        finally:
            third.release()
            other.dispose()
            with first.begin() as conn:
                conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    finally:
        a.release()
        b.release()
        first.dispose()
        second.dispose()


def test_a_check_in_flight_at_shutdown_leaves_the_lock_free(db_url):
    """The server stops while its background loop is still connecting to take the lock (a
    short-lived app): the lock must not be taken after ``release``, or no replica on that
    schema could ever lead again (the connection that holds it is never closed)."""
    import threading

    from sqlalchemy import event

    if make_url(db_url).get_backend_name() != "postgresql":
        lock = LeaderLock(make_engine(db_url))
        lock.release()
        assert lock.check()  # SQLite: one server per file, always the leader
        return
    own = f"tw_leader_{uuid.uuid4().hex[:8]}"
    admin = make_engine(db_url)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{own}"'))
    url = _other_schema(db_url, own)
    slow, other = make_engine(url), make_engine(url)
    connecting, releasing = threading.Event(), threading.Event()

    def _slow_connect(*_: object) -> None:
        connecting.set()
        releasing.wait(10)  # the connect finishes only once shutdown has begun

    lock, successor = LeaderLock(slow), LeaderLock(other)
    assert lock.engine is not None  # the lock connects through an engine of its own
    event.listen(lock.engine, "connect", _slow_connect)
    try:
        checking = threading.Thread(target=lock.check)
        checking.start()
        assert connecting.wait(10)
        releasing.set()
        lock.release()  # shutdown, while the check is still connecting
        checking.join(10)
        assert not lock.check()  # released for good
        assert successor.check()  # and nobody holds it
    finally:
        successor.release()
        lock.release()
        slow.dispose()
        other.dispose()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{own}" CASCADE'))
        admin.dispose()
