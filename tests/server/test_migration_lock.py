"""Migrations run under a lock: two migrators started at once on one fresh schema both
succeed, the second waiting for the first; without the lock the second fails.

The overlap is forced, not hoped for: the first migrator (a process of its own) pauses inside
its migration transaction right after it created ``alembic_version`` (tests/server/
gated_migrator.py), the second starts then, and the test lets the first go only once
PostgreSQL shows the second waiting behind it (``pg_locks`` / ``pg_blocking_pids``).
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from procs import wait_for
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import IntegrityError, ProgrammingError
from support import schema_diff

from tierwatch.server.db import make_engine
from tierwatch.server.migrate import (
    MIGRATION_LOCK_CLASS,
    alembic_config,
    migration_lock,
    sqlite_lock_path,
    upgrade,
)

MIGRATOR = Path(__file__).with_name("gated_migrator.py")
GATE_CLASS = int.from_bytes(b"tg", "big")
TIMEOUT_S = 60.0


class Gate:
    """An exclusive advisory lock the test holds; a gated migrator waits for it."""

    def __init__(self, engine: Engine) -> None:
        self.object = random.randrange(1, 2**31)
        self.conn = engine.connect()
        self.conn.execute(
            text("SELECT pg_advisory_lock(:c, :o)"), {"c": GATE_CLASS, "o": self.object}
        )
        self.conn.commit()
        self.open = False

    def release(self) -> None:
        if not self.open:
            self.open = True
            self.conn.execute(
                text("SELECT pg_advisory_unlock(:c, :o)"), {"c": GATE_CLASS, "o": self.object}
            )
            self.conn.commit()


class InThread:
    """Run ``fn`` in a thread; keep its exception."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc

    def join(self) -> None:
        self.thread.join(TIMEOUT_S)
        assert not self.thread.is_alive(), "the second migrator did not finish"


@contextmanager
def _paused_migrator(
    url: str, admin: Engine, mode: str
) -> Iterator[tuple[Gate, subprocess.Popen[str], int]]:
    """A migrator process paused inside its transaction; yields the gate, the process and
    its PostgreSQL session's pid."""
    gate = Gate(admin)
    proc = subprocess.Popen(
        [sys.executable, str(MIGRATOR), url, str(GATE_CLASS), str(gate.object), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        with admin.connect() as conn:
            pid = wait_for(
                lambda: (
                    proc.poll() is None
                    and conn.execute(
                        text(
                            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                            "AND classid = :c AND objid = :o AND objsubid = 2"
                        ),
                        {"c": GATE_CLASS, "o": gate.object},
                    ).scalar()
                ),
                timeout=TIMEOUT_S,
                interval=0.02,
                what="the first migrator to pause inside its migration",
            )
        yield gate, proc, int(pid)
    finally:
        gate.release()
        try:
            proc.wait(TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            gate.conn.close()


def _waits_for(admin: Engine, pid: int) -> set[str]:
    """What the sessions waiting for session ``pid`` wait on: ``"migration lock"`` (an
    advisory lock of class :data:`MIGRATION_LOCK_CLASS`) or a ``pg_locks.locktype``."""
    sql = (
        "SELECT CASE WHEN locktype = 'advisory' AND classid = :c AND objsubid = 2 "
        "THEN 'migration lock' ELSE locktype END FROM pg_locks "
        "WHERE NOT granted AND :pid = ANY(pg_blocking_pids(pid))"
    )
    with admin.connect() as conn:
        return set(conn.execute(text(sql), {"pid": pid, "c": MIGRATION_LOCK_CLASS}).scalars())


def _head() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def _assert_at_head_and_matches_the_models(url: str) -> None:
    engine = make_engine(url, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as conn:
            versions = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
            assert versions == [_head()]
            assert schema_diff(conn) == []
    finally:
        engine.dispose()


@pytest.fixture
def admin(pg_url: str) -> Iterator[Engine]:
    engine = make_engine(pg_url, pool_size=2, max_overflow=0)
    yield engine
    engine.dispose()


@pytest.mark.postgres
def test_a_second_migrator_waits_for_the_first_and_both_succeed(fresh_schema, admin):
    with _paused_migrator(fresh_schema, admin, "locked") as (gate, first, first_pid):
        second = InThread(lambda: upgrade(fresh_schema))
        waits = wait_for(
            lambda: _waits_for(admin, first_pid) or not second.thread.is_alive(),
            timeout=TIMEOUT_S,
            interval=0.02,
            what="the second migrator to wait for the migration lock",
        )
        assert second.thread.is_alive(), repr(second.error)
        assert waits == {"migration lock"}  # not on the first's catalog rows: it never began
        gate.release()
        second.join()
        assert first.wait(TIMEOUT_S) == 0, first.stdout.read() if first.stdout else ""
    assert second.error is None, repr(second.error)
    _assert_at_head_and_matches_the_models(fresh_schema)


@pytest.mark.postgres
def test_without_the_lock_two_migrators_race_and_one_fails(fresh_schema, admin):
    """What the lock prevents: Alembic alone, twice at once on a fresh schema."""
    with _paused_migrator(fresh_schema, admin, "unlocked") as (gate, first, first_pid):
        second = InThread(lambda: command.upgrade(alembic_config(fresh_schema), "head"))
        # It saw no alembic_version (the first has not committed) and waits on its own
        # CREATE TABLE for the first's transaction: the race is on.
        waits = wait_for(
            lambda: _waits_for(admin, first_pid) or not second.thread.is_alive(),
            timeout=TIMEOUT_S,
            interval=0.02,
            what="the second migrator to block on the first's transaction",
        )
        assert second.thread.is_alive(), repr(second.error)
        assert "migration lock" not in waits
        gate.release()
        second.join()
        assert first.wait(TIMEOUT_S) == 0, first.stdout.read() if first.stdout else ""
    assert isinstance(second.error, IntegrityError | ProgrammingError), repr(second.error)
    assert "alembic_version" in str(second.error)


def _flock_waiters(path: Path) -> int:
    """How many ``flock`` waiters /proc/locks lists for ``path`` (lines with ``->``)."""
    inode = path.stat().st_ino
    waiting = 0
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and "FLOCK" in fields and f":{inode}" in line:
            waiting += any(f.endswith(f":{inode}") for f in fields)
    return waiting


def test_sqlite_migrators_take_turns_on_a_lock_file(tmp_path):
    if not Path("/proc/locks").exists():
        pytest.fail("/proc/locks is needed to see a waiting migrator (Linux)")
    url = f"sqlite:///{tmp_path / 'tierwatch.db'}"
    holder = make_engine(url)
    path = sqlite_lock_path(holder)
    assert path is not None
    try:
        with migration_lock(holder):
            second = InThread(lambda: upgrade(url))
            wait_for(
                lambda: _flock_waiters(path) or not second.thread.is_alive(),
                timeout=TIMEOUT_S,
                interval=0.02,
                what="the migrator to wait for the lock file",
            )
            assert second.thread.is_alive(), repr(second.error)
            assert "alembic_version" not in inspect(holder).get_table_names()
        second.join()
        assert second.error is None, repr(second.error)
        _assert_at_head_and_matches_the_models(url)
    finally:
        holder.dispose()
