"""report_ranges in the database: replays racing their originals (PostgreSQL row locks),
and migration 0013 folding receipts into ranges and back."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from sqlalchemy import select, text
from support import PG_URL, make_batch, migrated_database

from tierwatch.server.db import make_engine, make_sessionmaker
from tierwatch.server.fleet import ingest
from tierwatch.server.fleet.models import Node, ReportRange

pg_only = pytest.mark.skipif(PG_URL is None, reason="needs TIERWATCH_TEST_DATABASE_URL")


def _node(session) -> SimpleNamespace:  # type: ignore[no-untyped-def]
    node = Node(name="n1", state="healthy")
    session.add(node)
    session.commit()
    return SimpleNamespace(id=node.id)


def _race(sm, node, first_seqs: list[int], racing_seq: int) -> set:  # type: ignore[no-untyped-def]
    """Store ``first_seqs``, then ``racing_seq`` in two transactions at once: the first holds
    its transaction open while the second tries; returns what the second stored."""
    now = datetime.now(UTC)
    nodes = {"n1": node}
    with sm() as s:
        for seq in first_seqs:
            ingest._store_ranges(s, [make_batch("n1", seq)], nodes, now)
        s.commit()
    first = sm()
    assert ingest._store_ranges(first, [make_batch("n1", racing_seq)], nodes, now)
    got: dict[str, set] = {}

    def second() -> None:
        with sm() as s:
            got["stored"] = ingest._store_ranges(s, [make_batch("n1", racing_seq)], nodes, now)
            s.commit()

    t = threading.Thread(target=second)
    t.start()
    t.join(0.5)
    assert t.is_alive()  # waiting for the first transaction's lock
    first.commit()
    first.close()
    t.join(10)
    assert not t.is_alive()
    return got["stored"]


@pg_only
@pytest.mark.parametrize(
    ("first_seqs", "racing_seq", "spans"),
    [
        ([], 1, [(1, 1)]),
        ([1, 2, 3], 4, [(1, 4)]),
        ([1, 2, 3], 9, [(1, 3), (9, 9)]),
    ],
    ids=["first-of-epoch", "extends-a-range", "new-range"],
)
def test_a_replay_racing_its_original_is_stored_once(
    tmp_path_factory, first_seqs, racing_seq, spans
):
    with migrated_database("postgres", tmp_path_factory) as url:
        engine = make_engine(url)
        sm = make_sessionmaker(engine)
        try:
            with sm() as s:
                node = _node(s)
            assert _race(sm, node, first_seqs, racing_seq) == set()
            with sm() as s:
                got = s.execute(
                    select(ReportRange.first_seq, ReportRange.last_seq).order_by(
                        ReportRange.first_seq
                    )
                ).all()
            assert [tuple(r) for r in got] == spans
        finally:
            engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pg_only)])
def test_0013_folds_receipts_into_ranges_and_back(backend, tmp_path_factory, monkeypatch):
    from alembic import command

    from tierwatch.server import migrate
    from tierwatch.server.migrate import alembic_config, upgrade

    real = migrate.upgrade
    monkeypatch.setattr("support.upgrade", lambda url: real(url, revision="0012"))
    t0 = datetime(2026, 12, 3, 12, tzinfo=UTC)
    receipts = [("run-1", s) for s in (1, 2, 3, 5, 6)] + [("run-2", 1)]
    with migrated_database(backend, tmp_path_factory) as url:
        engine = make_engine(url)
        with engine.begin() as conn:
            node_id = conn.scalar(
                text(
                    "INSERT INTO nodes (name, state, isolated, isolated_by, isolated_reason, "
                    "simulated, collector, agent_version, interval_s, sample_every, epoch, "
                    "last_seq, dropped_batches) VALUES ('n1', 'healthy', false, '', '', "
                    "false, '', '', 5, 1, '', 0, 0) RETURNING id"
                )
            )
            for epoch, seq in receipts:
                conn.execute(
                    text(
                        "INSERT INTO report_receipts (node_id, epoch, seq, sent_at, received_at) "
                        "VALUES (:n, :e, :s, :t, :t)"
                    ),
                    {"n": node_id, "e": epoch, "s": seq, "t": t0 + timedelta(seconds=seq)},
                )
        upgrade(url)
        with make_sessionmaker(engine)() as s:
            rows = s.scalars(
                select(ReportRange).order_by(ReportRange.epoch, ReportRange.first_seq)
            ).all()
            got = [(r.epoch, r.first_seq, r.last_seq, r.last_sent_at) for r in rows]
        assert got == [
            ("run-1", 1, 3, t0 + timedelta(seconds=3)),
            ("run-1", 5, 6, t0 + timedelta(seconds=6)),
            ("run-2", 1, 1, t0 + timedelta(seconds=1)),
        ]
        command.downgrade(alembic_config(url), "0012")
        with engine.begin() as conn:
            back = conn.execute(
                text("SELECT epoch, seq FROM report_receipts ORDER BY epoch, seq")
            ).all()
        assert [tuple(r) for r in back] == receipts
        engine.dispose()
