"""Group commit: concurrent reports share transactions, keep per-node order, fail alone."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import func, select, text
from support import make_batch

from tierwatch.server.fleet.models import GpuSampleRow, Node, ReportRange
from tierwatch.server.ingest.writer import (
    RETRY_AFTER_MAX_S,
    IngestBusy,
    IngestUnavailable,
    IngestWriter,
    retry_after_s,
)


def run_writer(app, settings, scenario, **kwargs):
    async def main():
        writer = IngestWriter(app.state.sessionmaker, settings, **kwargs)
        await writer.start()
        try:
            return await scenario(writer), writer
        finally:
            await writer.stop()

    return asyncio.run(main())


def test_concurrent_reports_are_stored_in_few_transactions(app, settings, session):
    async def scenario(writer):
        return await asyncio.gather(
            *(writer.submit(make_batch(f"n{i:02d}", 1, gpus=8)) for i in range(40))
        )

    acks, writer = run_writer(app, settings, scenario, max_delay_s=0.05)
    assert [a.stored for a in acks] == [True] * 40
    assert writer.reports_written == 40
    assert writer.groups_written < 40
    assert session.scalar(select(func.count()).select_from(GpuSampleRow)) == 40 * 8
    assert session.scalar(select(func.count()).select_from(Node)) == 40


def test_two_reports_of_one_node_are_stored_in_order(app, settings, session):
    async def scenario(writer):
        first = make_batch("n1", 1, temperature_c=50.0)
        second = make_batch("n1", 2, offset_s=1, temperature_c=91.0)
        return await asyncio.gather(writer.submit(first), writer.submit(second))

    acks, writer = run_writer(app, settings, scenario, max_delay_s=0.05)
    assert [(a.stored, a.acked_seq) for a in acks] == [(True, 1), (True, 2)]
    assert writer.groups_written == 2  # the second waited for the next group
    node = session.scalar(select(Node).where(Node.name == "n1"))
    assert (node.last_seq, node.state) == (2, "unhealthy")


def test_a_report_the_database_refuses_fails_alone(app, settings, session, db_url):
    """A real database failure (a trigger) for one report: the rest of its group is stored."""
    with app.state.engine.begin() as conn:
        if db_url.startswith("sqlite"):
            conn.execute(
                text(
                    "CREATE TRIGGER poison BEFORE INSERT ON report_ranges "
                    "WHEN NEW.epoch = 'poison' BEGIN SELECT RAISE(ABORT, 'poisoned'); END"
                )
            )
        else:
            conn.execute(
                text(
                    "CREATE FUNCTION poison() RETURNS trigger AS $$ BEGIN "
                    "IF NEW.epoch = 'poison' THEN RAISE EXCEPTION 'poisoned'; END IF; "
                    "RETURN NEW; END $$ LANGUAGE plpgsql"
                )
            )
            conn.execute(
                text(
                    "CREATE TRIGGER poison BEFORE INSERT ON report_ranges "
                    "FOR EACH ROW EXECUTE FUNCTION poison()"
                )
            )
    try:

        async def scenario(writer):
            batches = [make_batch(f"n{i}", 1) for i in range(5)]
            batches[2] = make_batch("n2", 1, epoch="poison")
            return await asyncio.gather(
                *(writer.submit(b) for b in batches), return_exceptions=True
            )

        results, _ = run_writer(app, settings, scenario, max_delay_s=0.05)
        assert isinstance(results[2], IngestUnavailable)
        assert "could not store this report" in str(results[2])
        assert "INSERT" not in str(results[2])  # no SQL leaks to the agent
        assert all(r.stored for i, r in enumerate(results) if i != 2)
        assert session.scalar(select(func.count()).select_from(ReportRange)) == 4
    finally:
        session.rollback()  # release this session's locks before DROP TRIGGER
        with app.state.engine.begin() as conn:
            conn.execute(
                text(
                    "DROP TRIGGER poison"
                    + ("" if db_url.startswith("sqlite") else " ON report_ranges")
                )
            )
            if not db_url.startswith("sqlite"):
                conn.execute(text("DROP FUNCTION poison()"))


def test_submit_after_stop_is_refused(app, settings):
    async def main():
        writer = IngestWriter(app.state.sessionmaker, settings)
        await writer.start()
        await writer.stop()
        with pytest.raises(IngestUnavailable, match="shutting down"):
            await writer.submit(make_batch("n1", 1))

    asyncio.run(main())


def test_a_full_queue_sheds_reports_without_storing_them(app, settings, session):
    """12 reports at once into a writer that holds 5: 5 stored, 7 shed with a wait."""

    async def scenario(writer):
        return await asyncio.gather(
            *(writer.submit(make_batch(f"n{i:02d}", 1)) for i in range(12)),
            return_exceptions=True,
        )

    results, writer = run_writer(app, settings, scenario, max_queue=5)
    stored = [r for r in results if not isinstance(r, BaseException)]
    shed = [r for r in results if isinstance(r, BaseException)]
    assert [a.stored for a in stored] == [True] * 5
    assert len(shed) == 7
    assert all(isinstance(e, IngestBusy) for e in shed)
    assert all(e.retry_after_s >= 1 for e in shed)
    assert "TIERWATCH_INGEST_MAX_QUEUE" in str(shed[0])
    assert writer.shed == 7
    names = set(session.scalars(select(Node.name)))
    assert names == {f"n{i:02d}" for i in range(5)}  # the first five, nothing of the rest


def test_the_queue_takes_reports_again_once_it_drains(app, settings, session):
    async def scenario(writer):
        first = await asyncio.gather(
            *(writer.submit(make_batch(f"a{i}", 1)) for i in range(3)), return_exceptions=True
        )
        later = await writer.submit(make_batch("b0", 1))
        return first, later

    (first, later), writer = run_writer(app, settings, scenario, max_queue=2)
    assert sum(isinstance(r, IngestBusy) for r in first) == 1
    assert later.stored
    assert writer.shed == 1


@pytest.mark.parametrize(
    ("backlog", "per_report_s", "expected"),
    [(0, 0.01, 1), (10, 0.01, 1), (500, 0.01, 5), (501, 0.01, 6), (10**6, 0.01, RETRY_AFTER_MAX_S)],
)
def test_retry_after_is_the_time_the_backlog_needs(backlog, per_report_s, expected):
    assert retry_after_s(backlog, per_report_s) == expected
