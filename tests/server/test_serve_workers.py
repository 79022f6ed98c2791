"""``tierwatch-server serve --workers N``: N processes share one port (PostgreSQL only)."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from procs import BIN, Proc, Server, base_env, wait_for
from sqlalchemy import create_engine, func, select
from support import make_batch

from tierwatch.agent.netutil import free_port
from tierwatch.server.db import make_sessionmaker
from tierwatch.server.fleet.models import Node
from tierwatch.server.tokens import create_token


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


@pytest.mark.e2e
@pytest.mark.one_backend
def test_two_workers_serve_one_port_and_store_every_report(tmp_path: Path, db_url: str) -> None:
    if db_url.startswith("sqlite"):
        pytest.skip("--workers needs PostgreSQL (TIERWATCH_TEST_DATABASE_URL; .ci/run sets it)")
    port = free_port()
    proc = Proc(
        "server",
        [
            str(BIN / "tierwatch-server"),
            *("serve", "--host", "127.0.0.1", "--port", str(port), "--workers", "2"),
        ],
        base_env(
            TIERWATCH_DATABASE_URL=db_url,
            TIERWATCH_SECRET_KEY="e2e-" + "k" * 40,
            TIERWATCH_PRUNE_INTERVAL_S="0",
        ),
        tmp_path / "server.log",
    )
    srv = Server(f"http://127.0.0.1:{port}", db_url, proc, port, tmp_path)
    srv.start()
    try:
        # uvicorn's supervisor plus two spawned workers, each running the app factory
        wait_for(lambda: len(_children(proc.popen.pid)) >= 2, timeout=30, what="2 workers")
        workers = [c for c in _children(proc.popen.pid) if "spawn_main" in _cmdline(c)]
        assert len(workers) == 2, [_cmdline(c) for c in _children(proc.popen.pid)]
        wait_for(
            lambda: (
                "Application startup complete" in proc.log_tail(20000)
                and proc.log_tail(20000).count("Application startup complete") == 2
            ),
            timeout=30,
            what=f"both workers started\n{proc.log_tail()}",
        )
        tokens = {f"w{i:02d}": "" for i in range(12)}
        engine = create_engine(db_url)
        with make_sessionmaker(engine)() as s:
            for node in tokens:
                tokens[node], _ = create_token(s, role="agent", node=node)
            s.commit()

        def send(node: str) -> list[int]:
            codes = []
            for seq in (1, 2, 3):  # a fresh connection each: the kernel deals them out
                with httpx.Client(base_url=srv.url, timeout=30) as c:
                    codes.append(
                        c.post(
                            "/api/v1/ingest/report",
                            content=make_batch(node, seq, offset_s=seq).model_dump_json(),
                            headers={
                                "Authorization": f"Bearer {tokens[node]}",
                                "Content-Type": "application/json",
                            },
                        ).status_code
                    )
            return codes

        with ThreadPoolExecutor(6) as pool:
            codes = [c for cs in pool.map(send, tokens) for c in cs]
        assert codes == [200] * 36
        try:
            with engine.connect() as conn:
                assert conn.scalar(select(func.count()).select_from(Node)) == 12
                assert set(conn.scalars(select(Node.last_seq))) == {3}
        finally:
            engine.dispose()
    finally:
        assert srv.stop() == 0, proc.log_tail()
    assert not any(Path(f"/proc/{w}").exists() for w in workers), "a worker outlived serve"


def test_workers_on_sqlite_are_refused_before_the_port_opens(tmp_path: Path) -> None:
    out = subprocess.run(
        [str(BIN / "tierwatch-server"), "serve", "--port", str(free_port()), "--workers", "2"],
        env=base_env(TIERWATCH_DATABASE_URL=f"sqlite:///{tmp_path}/t.db", TIERWATCH_DEV="1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "--workers 2 needs PostgreSQL" in out.stderr
    assert not (tmp_path / "t.db").exists()  # nothing migrated, nothing written


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--log-level", "loud"], {}, "--log-level 'loud': use debug, info"),
        ([], {"TIERWATCH_LOG_LEVEL": "loud"}, "TIERWATCH_LOG_LEVEL"),
    ],
)
def test_a_bad_log_level_says_what_to_use(tmp_path: Path, args, env, expected) -> None:
    out = subprocess.run(
        [str(BIN / "tierwatch-server"), "serve", "--port", str(free_port()), *args],
        env=base_env(TIERWATCH_DATABASE_URL=f"sqlite:///{tmp_path}/t.db", TIERWATCH_DEV="1", **env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert expected in out.stderr
    assert not (tmp_path / "t.db").exists()
