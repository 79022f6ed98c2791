"""A 1,000-rank job's checkpoint events per (step, tier, kind) and rank by rank
(app/checkpoints/step_events.py): the job page's aggregated event list, its per-rank
drill-down (page and API), their bounds and parameter checks, on both backends.

The job (world_size 1,000) is seeded with one bulk insert of about 5,400 events:

- step 120, in progress: memory staged by all ranks and committed by all but 512; peer
  committed by 0-899; persistent committed by the even ranks only (500 ranges: more than
  a group's ranges read, so that set is partial);
- step 110: memory committed by all; persistent committed by all but 512, 700 and 701,
  which failed (rank 700's message is hostile markup); rank 7 is the slowest upload;
- step 100: persistent committed by one whole-step event;
- steps 0-8: one staged event each (so that the page has older steps to page to).

Durations: ``seconds = 1 + rank / 1000`` (so medians are known), rank 3's staging blocked
2 s (the others 0.1 s).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import insert
from support import auth, register_job

from tierwatch.server.checkpoints import step_events
from tierwatch.server.checkpoints.models import CheckpointEventRow, Job, LedgerRow
from tierwatch.server.fleet.service import NotFoundError

JOB = "llm-1k"
W = 1000
T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
HOSTILE = '<script>alert("x")</script>'
FAILED = (512, 700, 701)


def _event(
    step, tier, kind, rank, *, job_pk, seconds=None, blocking_s=None, message="", world_size=W
):
    return {
        "job_pk": job_pk,
        "node_id": None,
        "step": step,
        "tier": tier,
        "kind": kind,
        "rank": rank,
        "world_size": world_size if rank is not None else None,
        "ts": T0 + timedelta(seconds=step, milliseconds=rank or 0),
        "received_at": T0 + timedelta(seconds=step + 2),
        "bytes": 1000 if kind in ("staged", "committed") else None,
        "seconds": seconds,
        "blocking_s": blocking_s,
        "message": message,
    }


def seed_events(session, job_pk: int) -> int:
    """The events described in the module docstring, in one bulk insert; their count."""
    rows = []

    def add(step, tier, kind, ranks, **kw):
        for r in ranks:
            secs = kw.get("seconds", 1 + r / 1000 if r is not None else None)
            rows.append(_event(step, tier, kind, r, job_pk=job_pk, **{**kw, "seconds": secs}))

    everyone = range(W)
    # step 120, in progress
    for r in everyone:
        rows.append(
            _event(
                120,
                "memory",
                "staged",
                r,
                job_pk=job_pk,
                seconds=0.5,
                blocking_s=2.0 if r == 3 else 0.1,
            )
        )
    add(120, "memory", "committed", [r for r in everyone if r != 512])
    add(120, "peer", "committed", range(900))
    add(120, "persistent", "committed", range(0, W, 2))
    # step 110: three persistent uploads failed
    add(110, "memory", "committed", everyone)
    add(110, "persistent", "committed", [r for r in everyone if r not in FAILED and r != 7])
    add(110, "persistent", "committed", [7], seconds=30.0)
    for r in FAILED:
        msg = HOSTILE if r == 700 else f"upload of __{r}_0.distcp failed: 503 Slow Down"
        rows.append(_event(110, "persistent", "failed", r, job_pk=job_pk, message=msg))
    # step 100: persistent committed as a whole step
    add(100, "persistent", "committed", [None], seconds=42.0)
    for step in range(9):
        add(step, "memory", "staged", [0])
    session.execute(insert(CheckpointEventRow), rows)
    now = T0 + timedelta(minutes=5)
    session.add_all(
        [
            LedgerRow(job_pk=job_pk, step=110, tier="memory", world_size=W, complete=True,
                      ranks_committed=W, updated_at=now),
            LedgerRow(job_pk=job_pk, step=110, tier="persistent", world_size=W, complete=False,
                      ranks_committed=W - 3, failures=3, updated_at=now),
        ]
    )  # fmt: skip
    session.commit()
    return len(rows)


@pytest.fixture
def big_job(app, session) -> Job:
    """The seeded 1,000-rank job (see the module docstring)."""
    register_job(app, JOB, ["n1", "n2"], world_size=W)
    job = session.query(Job).filter_by(job_id=JOB).one()
    seed_events(session, job.id)
    return job


def row(rows, step, tier, kind):
    [r] = [r for r in rows if (r["step"], r["tier"], r["kind"]) == (step, tier, kind)]
    return r


# --- service (both backends: the SQL is the subject) ---------------------------------------


def test_one_row_per_step_tier_and_kind(session, big_job):
    out = step_events.step_summaries(session, big_job)
    rows = out["rows"]
    assert out["steps"] == [120, 110, 100, 8, 7, 6, 5, 4, 3, 2]
    assert len(rows) == 4 + 3 + 1 + 7  # 5,400 events -> 15 rows
    # ordered by step (newest first), tier (memory, peer, persistent), kind (lifecycle)
    assert [(r["step"], r["tier"], r["kind"]) for r in rows[:8]] == [
        (120, "memory", "staged"),
        (120, "memory", "committed"),
        (120, "peer", "committed"),
        (120, "persistent", "committed"),
        (110, "memory", "committed"),
        (110, "persistent", "committed"),
        (110, "persistent", "failed"),
        (100, "persistent", "committed"),
    ]

    staged = row(rows, 120, "memory", "staged")
    assert (staged["ranks"], staged["world_size"], staged["events"]) == (W, W, W)
    assert staged["missing"]["text"] == "none"
    assert staged["blocking_s"] == {"median": pytest.approx(0.1), "max": pytest.approx(2.0)}
    assert staged["bytes"] == W * 1000

    mem = row(rows, 120, "memory", "committed")
    assert mem["ranks"] == W - 1
    assert mem["reported"]["text"] == "0-511, 513-999"
    assert mem["missing"] == {"count": 1, "ranges": [[512, 512]], "partial": False, "text": "512"}
    # 999 values 1.000 … 1.999 without 1.512: the middle (500th) one is rank 499's
    assert mem["seconds"] == {
        "min": pytest.approx(1.0),
        "median": pytest.approx(1.499),
        "max": pytest.approx(1.999),
    }
    assert mem["slowest_rank"] == 999
    assert mem["first_ts"] == T0 + timedelta(seconds=120)
    assert mem["last_ts"] == T0 + timedelta(seconds=120, milliseconds=999)
    assert mem["complete"] is None  # no ledger row

    peer = row(rows, 120, "peer", "committed")
    assert peer["missing"]["text"] == "900-999"
    assert peer["missing"]["count"] == 100

    # failed ranks are listed, and flag their step and tier's other rows
    failed = row(rows, 110, "persistent", "failed")
    assert failed["reported"]["text"] == "512, 700-701"
    assert failed["missing"] is None
    assert failed["message"] == HOSTILE  # the least message ("<" sorts first)
    assert failed["messages_differ"] is True
    committed = row(rows, 110, "persistent", "committed")
    assert committed["failed_ranks"] == 3
    assert committed["missing"]["text"] == "512, 700-701"
    assert committed["complete"] is False
    assert committed["slowest_rank"] == 7
    assert committed["seconds"]["max"] == pytest.approx(30.0)
    # 997 values, rank 7's at the top: the middle (499th) is rank 499's
    assert committed["seconds"]["median"] == pytest.approx(1.499)
    assert row(rows, 110, "memory", "committed")["complete"] is True
    assert row(rows, 110, "memory", "committed")["failed_ranks"] == 0
    # the same failed rows, whatever steps come later
    failures = step_events.failure_summaries(session, big_job)
    assert [(r["step"], r["tier"], r["kind"]) for r in failures] == [(110, "persistent", "failed")]
    assert failures[0]["reported"] == failed["reported"]

    # the whole step committed at once: nobody is missing
    whole = row(rows, 100, "persistent", "committed")
    assert (whole["whole_step"], whole["ranks"], whole["missing"]) == (True, 0, None)
    assert whole["slowest_rank"] is None
    assert whole["seconds"]["max"] == pytest.approx(42.0)
    # the even ranks: 500 ranges, only the first RANGES_READ read; counts stay exact
    even = row(rows, 120, "persistent", "committed")
    assert even["ranks"] == 500
    assert even["reported"]["partial"] is True
    assert len(even["reported"]["ranges"]) == step_events.RANGES_READ
    assert even["missing"]["count"] == 500
    assert even["missing"]["text"] == "1, 3, 5, 7, 9, 11, 13, 15 (+492 more)"


def test_steps_are_bounded_with_older_pages(session, big_job):
    first = step_events.step_summaries(session, big_job, limit=3)
    assert first["steps"] == [120, 110, 100]
    assert {r["step"] for r in first["rows"]} == {120, 110, 100}
    assert first["older_before_step"] == 100
    second = step_events.step_summaries(session, big_job, before_step=100, limit=8)
    assert second["steps"] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert second["older_before_step"] == 1
    last = step_events.step_summaries(session, big_job, before_step=1)
    assert last["steps"] == [0]
    assert last["older_before_step"] is None
    assert step_events.step_summaries(session, big_job, before_step=0)["rows"] == []
    with pytest.raises(ValueError, match="limit must be 1 to 100 steps"):
        step_events.step_summaries(session, big_job, limit=0)


def ranks_of(page) -> list[int]:
    return [r["rank"] for r in page["ranks"]]


def test_rank_by_rank_pages_and_filters(session, big_job):
    page = step_events.rank_events(session, big_job, step=110, tier="persistent")
    assert page["world_size"] == W
    assert ranks_of(page) == list(range(step_events.RANKS_PAGE))
    assert page["next_from_rank"] == step_events.RANKS_PAGE
    assert [r["kind"] for r in page["summary"]] == ["committed", "failed"]
    seventh = page["ranks"][7]
    assert seventh["kinds"]["committed"]["seconds"] == pytest.approx(30.0)
    assert seventh["kinds"]["failed"] is None
    assert (seventh["committed"], seventh["failed"]) == (True, False)

    page = step_events.rank_events(session, big_job, step=110, tier="persistent", from_rank=750)
    assert ranks_of(page) == list(range(750, W))
    assert page["next_from_rank"] is None
    page = step_events.rank_events(session, big_job, step=110, tier="persistent", from_rank=500)
    by_rank = {r["rank"]: r for r in page["ranks"]}
    assert (by_rank[512]["committed"], by_rank[512]["failed"]) == (False, True)
    assert by_rank[512]["kinds"]["failed"]["message"].startswith("upload of __512_0.distcp")
    assert by_rank[512]["kinds"]["committed"] is None

    for step, tier, show, ranks in [
        (110, "persistent", "failed", list(FAILED)),
        (110, "persistent", "missing", list(FAILED)),
        (120, "memory", "missing", [512]),
        (120, "peer", "missing", list(range(900, W))),
        (100, "persistent", "missing", []),  # the whole step committed
        (120, "memory", "failed", []),
    ]:
        page = step_events.rank_events(session, big_job, step=step, tier=tier, show=show)
        assert (ranks_of(page), page["next_from_rank"]) == (ranks, None), (step, tier, show)
    whole = step_events.rank_events(session, big_job, step=100, tier="persistent")
    assert [(e["kind"], e["seconds"]) for e in whole["whole_step"]] == [("committed", 42.0)]
    assert all(r["committed"] for r in whole["ranks"])

    # the ranks without a committed event, a page at a time
    page = step_events.rank_events(
        session, big_job, step=120, tier="persistent", show="missing", from_rank=3
    )
    odd = list(range(3, W, 2))
    assert ranks_of(page) == odd[: step_events.RANKS_PAGE]
    assert page["next_from_rank"] == odd[step_events.RANKS_PAGE]

    with pytest.raises(step_events.BadQuery, match="from_rank 1000 is beyond step 110's ranks"):
        step_events.rank_events(session, big_job, step=110, tier="memory", from_rank=W)
    with pytest.raises(step_events.BadQuery, match="show must be one of all, failed, missing"):
        step_events.rank_events(session, big_job, step=110, tier="memory", show="slow")
    with pytest.raises(NotFoundError, match="no persistent checkpoint events for step 5"):
        step_events.rank_events(session, big_job, step=5, tier="persistent")


# --- dashboard and API (one backend: the SQL is tested above on both) ---------------------


@pytest.mark.one_backend
def test_job_page_shows_rows_not_ranks(viewer, big_job):
    r = viewer.get(f"/jobs/{JOB}")
    assert r.status_code == 200, r.text
    html = r.text
    events = html[html.index('id="job-events"') :]
    # 15 rows in the events table and the failed row above it, not 5,400
    assert events.count("<tr data-step=") == 15 + 1
    mem = html[html.index('<tr data-step="120" data-tier="memory" data-kind="committed"') :]
    mem = mem[: mem.index("</tr>")]
    assert "999 of 1000" in mem
    assert "missing 512<" in mem
    assert "1.00 s / 1.50 s / 2.00 s" in mem
    assert f'href="/jobs/{JOB}/steps/120/memory?show=missing"' in mem
    # the failed ranks' row is flagged, and so is its step and tier's committed row
    failed = html[html.index('<tr data-step="110" data-tier="persistent" data-kind="failed"') :]
    assert 'class="bad' in failed[: failed.index(">")]
    assert "512, 700-701" in failed[: failed.index("</tr>")]
    committed = html[html.index('data-step="110" data-tier="persistent" data-kind="committed"') :]
    committed = committed[: committed.index("</tr>")]
    assert "has-failures" in committed
    assert "⚠ 3 failed" in committed
    assert "<script>alert" not in html
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in html
    # bounded: a link to the older steps, which the page then shows
    assert f'href="/jobs/{JOB}?before_step=2#checkpoint-events"' in html
    older = viewer.get(f"/jobs/{JOB}?before_step=2").text
    assert older.count("<tr data-step=") == 2 + 1  # steps 1 and 0, and the failed row
    assert "Checkpoint events before step 2" in older
    assert f'hx-get="/jobs/{JOB}?before_step=2"' in older  # polling keeps to the page
    assert "Older steps" not in older
    # the htmx poll's fragment carries the same rows out of band
    r = viewer.get(f"/jobs/{JOB}", headers={"HX-Request": "true"})
    assert 'id="job-events" class="events" hx-swap-oob="true"' in r.text
    assert r.text.count("<tr data-step=") == 15 + 1


@pytest.mark.one_backend
def test_step_page_lists_ranks(viewer, big_job):
    r = viewer.get(f"/jobs/{JOB}/steps/110/persistent?from_rank=500")
    assert r.status_code == 200, r.text
    html = r.text
    assert "step 110, persistent tier" in html
    assert html.count("<tr data-rank=") == step_events.RANKS_PAGE
    rank = html[html.index('<tr data-rank="512"') :]
    rank = rank[: rank.index("</tr>")]
    assert 'class="bad missing"' in rank
    assert "not committed" in rank
    assert "503 Slow Down" in rank
    assert f'href="/jobs/{JOB}/steps/110/persistent?from_rank=750" rel="next"' in html
    assert f'href="/jobs/{JOB}/steps/110/persistent?show=failed"' in html
    failed = viewer.get(f"/jobs/{JOB}/steps/110/persistent?show=failed").text
    assert [failed.count(f'<tr data-rank="{r}"') for r in FAILED] == [1, 1, 1]
    assert failed.count("<tr data-rank=") == 3
    assert "<script>alert" not in failed
    assert "&lt;script&gt;" in failed


@pytest.mark.one_backend
def test_api_steps_and_ranks(client, make_token, big_job):
    h = auth(make_token("viewer"))
    r = client.get(f"/api/v1/jobs/{JOB}/steps?limit=2", headers=h)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["steps"] == [120, 110]
    assert body["older_before_step"] == 110
    failed = row(body["rows"], 110, "persistent", "failed")
    assert failed["reported"]["ranges"] == [[512, 512], [700, 701]]
    r = client.get(f"/api/v1/jobs/{JOB}/steps/110/persistent?show=failed", headers=h)
    assert r.status_code == 200, r.text
    assert [x["rank"] for x in r.json()["ranks"]] == list(FAILED)
    r = client.get(f"/api/v1/jobs/{JOB}/steps/110/persistent?from_rank=1000", headers=h)
    assert r.status_code == 422
    assert "from_rank 1000 is beyond" in r.json()["detail"]
    assert client.get(f"/api/v1/jobs/{JOB}/steps/5/peer", headers=h).status_code == 404
    assert client.get(f"/api/v1/jobs/{JOB}/steps?limit=101", headers=h).status_code == 422
    assert client.get(f"/api/v1/jobs/{JOB}/steps/1/disk", headers=h).status_code == 422
    assert client.get(f"/api/v1/jobs/{JOB}/steps").status_code == 401


# --- parameter checks and access (a 4-rank job: the refusals do not need 1,000) -----------


@pytest.fixture
def small_job(app, session) -> Job:
    """A 4-rank job with step 110 committed in memory by ranks 0-3."""
    register_job(app, JOB, ["n1"], world_size=4)
    job = session.query(Job).filter_by(job_id=JOB).one()
    session.execute(
        insert(CheckpointEventRow),
        [_event(110, "memory", "committed", r, job_pk=job.id, world_size=4) for r in range(4)],
    )
    session.commit()
    return job


#: (address under /jobs/<JOB>, what the 422 page must name); one app for all (the refusals are
#: answered before, or by, one query).
BAD_PARAMETERS = [
    ("?before_step=abc", "before_step"),
    ("?before_step=-1", "before_step"),
    (f"?before_step={2**63}", "before_step"),
    ("/steps/abc/memory", "step"),
    ("/steps/-1/memory", "step"),
    (f"/steps/{2**62 + 1}/memory", "step"),
    ("/steps/110/disk", "tier"),
    ("/steps/110/memory?show=slowest", "show"),
    ("/steps/110/memory?from_rank=-1", "from_rank"),
    ("/steps/110/memory?from_rank=x", "from_rank"),
    ("/steps/110/memory?from_rank=4", "from_rank 4 is beyond step 110&#39;s ranks 0-3"),
]


@pytest.mark.one_backend
def test_bad_parameters_get_a_422_page_naming_them(viewer, small_job):
    for path, field in BAD_PARAMETERS:
        r = viewer.get(f"/jobs/{JOB}{path}")
        assert r.status_code == 422, (path, r.text)
        assert "Invalid input" in r.text, path
        assert "Fix the address and try again: " in r.text, path
        assert field in r.text, (path, field)


@pytest.mark.one_backend
def test_step_page_404s_and_access(client, make_token, small_job, agent_token):
    path = f"/jobs/{JOB}/steps/110/memory"
    r = client.get(path, follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == f"/login?next=%2Fjobs%2F{JOB}%2Fsteps%2F110%2Fmemory"
    r = client.get(path, headers=auth(agent_token("n1")), follow_redirects=False)
    assert r.status_code == 403
    assert "agent tokens may only report" in r.text
    h = auth(make_token("viewer"))
    assert client.get(path, headers=h).status_code == 200
    r = client.get(f"/jobs/{JOB}/steps/5/persistent", headers=h)
    assert r.status_code == 404
    assert "no persistent checkpoint events for step 5" in r.text
    r = client.get("/jobs/nope/steps/5/persistent", headers=h)
    assert r.status_code == 404
    assert "no job &#39;nope&#39;" in r.text


def test_parameter_bounds_are_the_protocols():
    """The step and rank bounds of the pages and the API are what an event may carry."""
    from pydantic import ValidationError

    from tierwatch.agent.protocol import CheckpointEvent

    def event(**kw):
        base = {"job_id": JOB, "step": 0, "tier": "memory", "kind": "staged", "ts": T0}
        return CheckpointEvent(**{**base, **kw})

    event(step=step_events.MAX_STEP, rank=step_events.MAX_RANK)
    with pytest.raises(ValidationError):
        event(step=step_events.MAX_STEP + 1)
    with pytest.raises(ValidationError):
        event(rank=step_events.MAX_RANK + 1)
    assert step_events.SHOWS == ("all", "failed", "missing")
