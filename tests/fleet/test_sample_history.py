"""Raw sample history: hourly partitions on PostgreSQL (retention by drop), the 5-minute
rollups, and the long-range chart query that reads them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, insert, select, text
from support import PG_URL, migrated_database

from tierwatch.server.db import make_engine, make_sessionmaker
from tierwatch.server.fleet import partitions, rollups, service
from tierwatch.server.fleet.models import (
    METRIC_FIELDS,
    GpuSampleRollup,
    GpuSampleRow,
    Node,
)

T0 = datetime(2026, 12, 3, 14, 0, tzinfo=UTC)

# --- pure planning ------------------------------------------------------------------------


def test_partition_names_round_trip_and_other_tables_are_not_partitions():
    start = partitions.partition_start(datetime(2026, 12, 3, 14, 59, 59, 999, tzinfo=UTC))
    assert start == T0
    assert partitions.partition_name(start) == "gpu_samples_p20261203t14"
    assert partitions.parse_partition_name("gpu_samples_p20261203t14") == T0
    for other in ("gpu_samples", "gpu_samples_p20261203t25", "gpu_samples_p2026120314", None):
        assert not partitions.is_partition_table(other)
    assert partitions.is_partition_table("gpu_samples_default")
    with pytest.raises(ValueError, match="aware"):
        partitions.partition_start(datetime(2026, 12, 3, 14))


def test_missing_and_expired_partitions():
    have = [T0, T0 + timedelta(hours=2)]
    assert partitions.missing_starts(
        have, since=T0 + timedelta(minutes=30), until=T0 + timedelta(hours=3, minutes=1)
    ) == [T0 + timedelta(hours=1), T0 + timedelta(hours=3)]
    # an hour is expired only when it ends at or before the cut
    assert partitions.expired_starts(have, cut=T0 + timedelta(minutes=59)) == []
    assert partitions.expired_starts(have, cut=T0 + timedelta(hours=1)) == [T0]


def test_due_buckets_wait_for_the_lag_and_are_bounded():
    now = T0 + timedelta(minutes=10, seconds=rollups.ROLLUP_LAG_S - 1)
    # [14:00, 14:05) is closed at 14:05 + lag; [14:05, 14:10) is not yet
    assert rollups.due_buckets(rolled_up_to=T0 - timedelta(minutes=5), now=now) == [T0]
    assert rollups.due_buckets(rolled_up_to=T0, now=now) == []
    first = rollups.due_buckets(rolled_up_to=None, now=now)
    assert len(first) == rollups.MAX_BUCKETS_PER_PASS
    assert first[-1] == T0
    late = rollups.due_buckets(rolled_up_to=T0 - timedelta(days=2), now=now)
    assert len(late) == rollups.MAX_BUCKETS_PER_PASS
    assert late[0] == T0 - timedelta(days=2) + timedelta(seconds=rollups.ROLLUP_S)


# --- rollups and the chart query (both backends) -----------------------------------------


def _sample(node_id: int, gpu: int, ts: datetime, temp: float, sbe: int) -> dict:
    row: dict = dict.fromkeys(METRIC_FIELDS)
    row |= {"node_id": node_id, "gpu_index": gpu, "ts": ts, "temperature_c": temp}
    row |= {"ecc_sbe_aggregate": sbe, "row_remap_pending": temp > 70}
    return row


@pytest.fixture
def node(session) -> Node:  # type: ignore[no-untyped-def]
    n = Node(name="n1", state="healthy")
    session.add(n)
    session.commit()
    return n


def test_rollup_means_gauges_and_keeps_counter_maxima(session, node):
    rows = [
        _sample(node.id, 0, T0 + timedelta(seconds=s), temp, sbe)
        for s, temp, sbe in ((0, 50.0, 1), (60, 60.0, 2), (299, 70.0, 3), (300, 80.0, 4))
    ]
    rows.append(_sample(node.id, 1, T0 + timedelta(seconds=30), 40.0, 0))
    session.execute(insert(GpuSampleRow), rows)
    session.commit()
    now = T0 + timedelta(seconds=2 * rollups.ROLLUP_S + rollups.ROLLUP_LAG_S)
    done = rollups.roll_up(session, now=now, after=T0 - timedelta(seconds=rollups.ROLLUP_S))
    assert done == T0 + timedelta(seconds=rollups.ROLLUP_S)
    got = {(r.gpu_index, r.bucket): r for r in session.scalars(select(GpuSampleRollup)).all()}
    assert set(got) == {(0, T0), (1, T0), (0, T0 + timedelta(seconds=300))}
    first = got[(0, T0)]
    assert (first.samples, first.temperature_c, first.ecc_sbe_aggregate) == (3, 60.0, 3)
    assert first.row_remap_pending is False
    assert first.power_w is None
    assert got[(0, T0 + timedelta(seconds=300))].row_remap_pending is True
    # a second pass over the same buckets (leadership moved) adds nothing
    again = rollups.roll_up(session, now=now, after=T0 - timedelta(seconds=rollups.ROLLUP_S))
    assert again == done
    assert session.scalar(select(func.count()).select_from(GpuSampleRollup)) == 3


def test_long_ranges_read_rollups_then_raw_rows_after_them(session, node):
    # raw rows over 20 minutes, one a minute; rollups of the first 10 minutes only
    raw = [_sample(node.id, 0, T0 + timedelta(minutes=m), 50.0 + m, m) for m in range(20)]
    session.execute(insert(GpuSampleRow), raw)
    session.commit()
    now = T0 + timedelta(minutes=5, seconds=rollups.ROLLUP_S + rollups.ROLLUP_LAG_S)
    rollups.roll_up(session, now=now, after=T0 - timedelta(seconds=rollups.ROLLUP_S))
    assert session.scalar(select(func.max(GpuSampleRollup.bucket))) == T0 + timedelta(minutes=5)
    # the raw rows of the rolled-up buckets are gone (as after retention): the long range
    # still has them, from the rollups
    session.execute(
        GpuSampleRow.__table__.delete().where(GpuSampleRow.ts < T0 + timedelta(minutes=10))
    )
    session.commit()
    kwargs = {"gpu": None, "metric": None, "since": T0, "limit": 1000}
    kwargs["until"] = T0 + timedelta(minutes=20)
    rows = service.query_samples(
        session, node, step_s=600, raw_since=T0 + timedelta(minutes=15), **kwargs
    )
    assert [r["ts"] for r in rows] == [T0, T0 + timedelta(minutes=10)]
    assert rows[0]["temperature_c"] == pytest.approx(54.5)  # mean of 50..59
    assert rows[0]["ecc_sbe_aggregate"] == 9.0  # the bucket's maximum, not its mean
    assert rows[1]["temperature_c"] == pytest.approx(64.5)  # raw rows 60..69
    # inside the raw retention the raw rows alone answer (the deleted ones are missing)
    inside = service.query_samples(session, node, step_s=600, raw_since=T0, **kwargs)
    assert [r["ts"] for r in inside] == [T0 + timedelta(minutes=10)]


def test_a_bucket_straddling_the_newest_rollup_merges_both_sources(session, node):
    raw = [_sample(node.id, 0, T0 + timedelta(minutes=m), 10.0 * m, m) for m in range(10)]
    session.execute(insert(GpuSampleRow), raw)
    session.commit()
    now = T0 + timedelta(seconds=rollups.ROLLUP_S + rollups.ROLLUP_LAG_S)
    rollups.roll_up(session, now=now, after=T0 - timedelta(seconds=rollups.ROLLUP_S))
    rows = service.query_samples(
        session,
        node,
        gpu=0,
        metric="temperature_c",
        since=T0,
        until=T0 + timedelta(minutes=9),
        limit=100,
        step_s=600,
        raw_since=T0 + timedelta(hours=1),
    )
    # minutes 0-4 from the rollup (weight 5), 5-9 raw: one bucket, the mean of all ten
    assert len(rows) == 1
    assert rows[0]["temperature_c"] == pytest.approx(45.0)


# --- partitions (PostgreSQL) --------------------------------------------------------------

pg_only = pytest.mark.skipif(PG_URL is None, reason="needs TIERWATCH_TEST_DATABASE_URL")


@pytest.fixture
def pg_engine(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A schema of its own: these tests move time and drop partitions."""
    with migrated_database("postgres", tmp_path_factory) as url:
        engine = make_engine(url)
        yield engine
        engine.dispose()


def _where(conn, ts: datetime) -> str:  # type: ignore[no-untyped-def]
    return conn.scalar(
        text("SELECT tableoid::regclass::text FROM gpu_samples WHERE ts = :ts"), {"ts": ts}
    )


def _add_node(conn) -> int:  # type: ignore[no-untyped-def]
    return conn.scalar(
        text(
            "INSERT INTO nodes (name, state, isolated, isolated_by, "
            "isolated_reason, simulated, collector, agent_version, interval_s, "
            "sample_every, epoch, last_seq, dropped_batches) VALUES "
            "('n1', 'healthy', false, '', '', false, '', '', 5, 1, '', 0, 0) "
            "RETURNING id"
        )
    )


@pg_only
def test_migration_partitions_by_hour_and_the_default_catches_the_rest(pg_engine):
    now = datetime.now(UTC)
    with pg_engine.begin() as conn:
        have = partitions.existing_partitions(conn)
        hour = partitions.partition_start(now)
        assert {hour - partitions.WIDTH, hour, hour + partitions.WIDTH} <= set(have)
        node_id = _add_node(conn)
        for ts in (now, now - timedelta(days=10)):
            conn.execute(insert(GpuSampleRow), [_sample(node_id, 0, ts, 50.0, 0)])
        assert _where(conn, now) == partitions.partition_name(hour)
        assert _where(conn, now - timedelta(days=10)) == partitions.DEFAULT_PARTITION


@pg_only
def test_maintenance_creates_ahead_moves_default_rows_and_drops_whole_hours(pg_engine):
    now = datetime.now(UTC)
    hour = partitions.partition_start(now)
    later = hour + timedelta(hours=10, minutes=5)  # beyond the partitions made at migration
    with pg_engine.begin() as conn:
        node_id = _add_node(conn)
        rows = [_sample(node_id, g, ts, 50.0, 0) for g in range(2) for ts in (now, later)]
        rows.append(_sample(node_id, 0, now - timedelta(days=3), 50.0, 0))
        conn.execute(insert(GpuSampleRow), rows)
        assert _where(conn, later) == partitions.DEFAULT_PARTITION
    with pg_engine.connect() as conn:
        # eight hours on: the partitions through later + 3 h exist, the row moved into its own
        result = partitions.maintain(conn, now=hour + timedelta(hours=8), cut=None)
        assert partitions.partition_name(partitions.partition_start(later)) in result.created
        assert result.moved_from_default == 2
        assert _where(conn, later) == partitions.partition_name(partitions.partition_start(later))
        conn.commit()
        # a cut just after this hour drops it (and everything older) whole, and the default
        # partition's rows older than the cut
        cut = hour + partitions.WIDTH
        result = partitions.maintain(conn, now=hour + timedelta(hours=8), cut=cut)
        assert partitions.partition_name(hour) in result.dropped
        assert result.rows_dropped == 3
        assert result.skipped == []
        left = partitions.existing_partitions(conn)
        assert min(left) == hour + partitions.WIDTH
        assert conn.scalar(text("SELECT count(*) FROM gpu_samples")) == 2


@pg_only
def test_a_drop_that_cannot_get_its_lock_gives_up_and_ingest_goes_on(pg_engine, monkeypatch):
    monkeypatch.setattr(partitions, "LOCK_TIMEOUT_MS", 200)
    now = datetime.now(UTC)
    hour = partitions.partition_start(now)
    with pg_engine.begin() as conn:
        node_id = _add_node(conn)
    holder = pg_engine.connect()
    holder.execute(text("SELECT count(*) FROM gpu_samples"))  # holds ACCESS SHARE: a reader
    try:
        with pg_engine.connect() as conn:
            result = partitions.maintain(conn, now=now, cut=hour)
            assert result.dropped == []
            assert len(result.skipped) >= 1
            assert "lock timeout" in result.skipped[0]
        # while the reader still holds the table, ingest's inserts go in
        with pg_engine.begin() as conn:
            conn.execute(insert(GpuSampleRow), [_sample(node_id, 0, now, 50.0, 0)])
    finally:
        holder.rollback()
        holder.close()
    with pg_engine.connect() as conn:
        result = partitions.maintain(conn, now=now, cut=hour)
        assert result.skipped == []
        assert result.dropped


@pg_only
def test_prune_on_postgresql_drops_partitions_and_counts_rows(pg_engine):
    sm = make_sessionmaker(pg_engine)
    now = datetime.now(UTC)
    with sm() as s:
        node = Node(name="n1", state="healthy")
        s.add(node)
        s.commit()
        s.execute(
            insert(GpuSampleRow),
            [_sample(node.id, 0, now - timedelta(hours=h), 50.0, 0) for h in (0, 2, 50)],
        )
        s.commit()
        deleted = service.prune(s, now=now, sample_retention_s=3600, event_retention_s=86400)
        # the row 2 h old sits in an hour that ended more than 1 h ago; 50 h: default partition
        assert deleted["gpu_samples"] == 2
        assert s.scalar(select(func.count()).select_from(GpuSampleRow)) == 1


# --- migration 0012 keeps the history (both backends) -------------------------------------


def _fresh_url(backend: str, tmp_path_factory, revision: str):  # type: ignore[no-untyped-def]
    """A new database at ``revision`` (a context manager yielding its URL)."""
    from contextlib import contextmanager

    from tierwatch.server import migrate

    @contextmanager
    def _cm():  # type: ignore[no-untyped-def]
        real = migrate.upgrade
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("support.upgrade", lambda url: real(url, revision=revision))
            with migrated_database(backend, tmp_path_factory) as url:
                yield url

    return _cm()


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pg_only)])
def test_0012_moves_the_history_across_and_back(backend, tmp_path_factory):
    from alembic import command

    from tierwatch.server.migrate import alembic_config, upgrade

    now = datetime.now(UTC).replace(microsecond=0)
    with _fresh_url(backend, tmp_path_factory, "0011") as url:
        engine = make_engine(url)
        with engine.begin() as conn:
            node_id = _add_node(conn)
            conn.execute(
                text(
                    "INSERT INTO gpu_samples (node_id, gpu_index, ts, temperature_c) "
                    "VALUES (:n, 0, :a, 50), (:n, 1, :b, 60)"
                ),
                {"n": node_id, "a": now, "b": now - timedelta(hours=5)},
            )
        upgrade(url)
        with engine.begin() as conn:
            got = conn.execute(
                text("SELECT gpu_index, temperature_c FROM gpu_samples ORDER BY gpu_index")
            ).all()
            assert [tuple(r) for r in got] == [(0, 50.0), (1, 60.0)]
            if backend == "postgres":
                assert _where(conn, now) == partitions.partition_name(
                    partitions.partition_start(now)
                )
                options = conn.scalar(
                    text("SELECT reloptions FROM pg_class WHERE oid = 'gpus'::regclass")
                )
                assert "fillfactor=50" in options
        command.downgrade(alembic_config(url), "0011")
        with engine.begin() as conn:
            got = conn.execute(
                text("SELECT id, temperature_c FROM gpu_samples ORDER BY temperature_c")
            ).all()
            assert [r[1] for r in got] == [50.0, 60.0]
            assert all(r[0] is not None for r in got)
        engine.dispose()


def test_the_samples_api_charts_ranges_older_than_the_raw_history_from_rollups(
    client, make_token, session
):
    from support import auth, make_batch, post_batch

    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    post_batch(client, agent, make_batch("n1", 1, temperature_c=61.0))
    node = session.scalar(select(Node).where(Node.name == "n1"))
    # two days ago, only in the rollups (the raw rows are past the 24 h retention)
    old = rollups.bucket_start(datetime.now(UTC) - timedelta(days=2))
    session.execute(
        insert(GpuSampleRollup),
        [
            dict.fromkeys(METRIC_FIELDS)
            | {"node_id": node.id, "gpu_index": 0, "bucket": old, "samples": 5}
            | {"temperature_c": 48.0, "ecc_sbe_aggregate": 7}
        ],
    )
    session.commit()
    params = {"since": (old - timedelta(hours=1)).isoformat(), "step": 3600, "gpu": 0}
    r = client.get("/api/v1/nodes/n1/samples", params=params, headers=auth(viewer))
    assert r.status_code == 200, r.text
    rows = r.json()["samples"]
    assert rows[0]["temperature_c"] == 48.0
    assert rows[0]["ecc_sbe_aggregate"] == 7
    assert rows[-1]["temperature_c"] == 61.0  # and the raw row of now


def test_raw_rows_answer_every_part_of_a_range_they_still_cover(session, node):
    # rollups began late (only the 15-minute bucket), raw rows cover all 20 minutes: a range
    # that starts just before the raw retention reads the raw rows, not only the rollups
    raw = [_sample(node.id, 0, T0 + timedelta(minutes=m), 50.0 + m, m) for m in range(20)]
    session.execute(insert(GpuSampleRow), raw)
    late = dict.fromkeys(METRIC_FIELDS) | {"node_id": node.id, "gpu_index": 0, "samples": 5}
    session.execute(insert(GpuSampleRollup), [late | {"bucket": T0 + timedelta(minutes=15)}])
    session.commit()
    rows = service.query_samples(
        session,
        node,
        gpu=0,
        metric="temperature_c",
        since=T0 - timedelta(hours=1),
        until=T0 + timedelta(minutes=19),
        limit=100,
        step_s=300,
        raw_since=T0 + timedelta(minutes=1),
    )
    assert [r["ts"] for r in rows] == [T0 + timedelta(minutes=m) for m in (0, 5, 10, 15)]
    assert [r["temperature_c"] for r in rows] == [52.0, 57.0, 62.0, 67.0]


def test_samples_outside_1970_to_9999_are_a_clear_422(client, make_token):
    from support import auth, make_batch, post_batch

    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    post_batch(client, agent, make_batch("n1", 1))
    for params in (
        {"since": "0001-01-01T00:00:00+14:00"},
        {"until": "9999-12-31T23:59:59-14:00", "metric": "temperature_c"},
    ):
        r = client.get("/api/v1/nodes/n1/samples", params=params, headers=auth(viewer))
        assert r.status_code == 422, r.text
        assert "between 1970-01-01 and 9999-01-01" in r.text


@pg_only
def test_another_process_creating_the_same_hour_does_not_stop_the_pass(pg_engine):
    now = datetime.now(UTC)
    ahead = partitions.partition_start(now) + timedelta(hours=10)
    # the other creator made hour +10 as a plain table first (as create_partition does)
    with pg_engine.begin() as conn:
        conn.execute(text(f'CREATE TABLE "{partitions.partition_name(ahead)}" (LIKE gpu_samples)'))
    with pg_engine.connect() as conn:
        result = partitions.maintain(conn, now=ahead - timedelta(hours=1), cut=None)
    assert any(partitions.partition_name(ahead) in s for s in result.skipped)
    # the hours after it were still created in the same pass
    assert partitions.partition_name(ahead + partitions.WIDTH) in result.created
