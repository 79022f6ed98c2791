"""The job page and the cluster page's job list: tier table, work at risk, events and
restores (hostile text escaped), htmx fragment, 404 page, sign-in."""

from __future__ import annotations

from datetime import timedelta

from support import post_batch, register_job

from tierwatch.agent.protocol import (
    CheckpointEvent,
    JobProgress,
    ReportBatch,
    RestoreReport,
    utcnow,
)

JOB = "gpt-2.small_run-1"
HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def report(client, token, seq, **content):
    batch = ReportBatch(node="n1", epoch="e1", seq=seq, sent_at=utcnow(), **content)
    r = post_batch(client, token, batch)
    assert r.status_code == 200, r.text


def scripted_job(client, token):
    register_job(client, JOB, ["n1"])
    t0 = utcnow() - timedelta(minutes=3)
    report(
        client,
        token,
        1,
        progress=[
            JobProgress(
                job_id=JOB,
                rank=r,
                world_size=2,
                step=40,
                step_time_s=0.5,
                ts=t0,
                layout=["n1", "n1"] if r == 0 else None,
            )
            for r in (0, 1)
        ],
        checkpoint_events=[
            *(
                CheckpointEvent(
                    job_id=JOB,
                    step=40,
                    tier="memory",
                    kind=k,
                    rank=r,
                    world_size=2,
                    ts=t0,
                    bytes=3 * 1024**2,
                    seconds=0.25,
                    blocking_s=0.05,
                )
                for r in (0, 1)
                for k in ("staged", "committed")
            ),
            CheckpointEvent(
                job_id=JOB,
                step=40,
                tier="persistent",
                kind="failed",
                rank=1,
                world_size=2,
                ts=t0 + timedelta(seconds=1),
                message=HOSTILE,
            ),
        ],
        restores=[
            RestoreReport(
                job_id=JOB, rank=0, world_size=2, ts=t0, seconds=2.0, ok=False, message=HOSTILE
            )
        ],
    )
    report(
        client,
        token,
        2,
        progress=[
            JobProgress(
                job_id=JOB,
                rank=0,
                world_size=2,
                step=52,
                step_time_s=0.5,
                ts=t0 + timedelta(seconds=6),
            )
        ],
    )


def cells(html: str, row: str) -> str:
    start = html.index(f'<tr data-row="{row}">')
    return html[start : html.index("</tr>", start)]


def test_job_page_shows_tiers_side_by_side(viewer, agent_token):
    scripted_job(viewer, agent_token("n1"))
    r = viewer.get(f"/jobs/{JOB}")
    assert r.status_code == 200
    html = r.text
    assert f"<h1>{JOB}</h1>" in html
    assert 'data-fact="step">52<' in html
    assert 'data-fact="world_size">2<' in html
    header = html[html.index('<table class="tiers">') :]
    header = header[: header.index("</thead>")]
    assert (
        header.index('data-tier="memory"')
        < header.index('data-tier="peer"')
        < header.index('data-tier="persistent"')
    )
    newest = cells(html, "newest_step")
    assert '<td data-tier="memory" class="">40</td>' in newest
    assert '<td data-tier="peer" class="bad">none</td>' in newest
    lag = cells(html, "lag_steps")
    assert '<td data-tier="memory">12</td>' in lag  # 52 - 40
    assert '<td data-tier="persistent">53</td>' in lag  # nothing committed: 52 + 1
    assert '<td data-tier="memory">6.00 s</td>' in cells(html, "lag_s")  # trained 6 s apart
    assert '<td data-tier="memory">6.0 MiB</td>' in cells(html, "bytes")
    assert '<td data-tier="memory">24.0 MiB/s</td>' in cells(html, "throughput")
    assert '<td data-tier="memory">0.05 s</td>' in cells(html, "blocking")
    assert "steps" in cells(html, "advice")  # interval in seconds and steps
    assert "not measured yet" not in cells(html, "advice").split('data-tier="memory"')[1][:80]
    assert "√(2δM)" in html
    assert '<tr data-failure="rack">' in html
    assert "nothing: restart from scratch" in html
    # the chart's container and its data URL
    assert f'data-history-url="/api/v1/jobs/{JOB}/history"' in html
    assert '<figure class="chart" id="step-chart">' in html
    assert "/static/js/job-charts.js" in html


def test_job_page_escapes_event_and_restore_messages(viewer, agent_token):
    scripted_job(viewer, agent_token("n1"))
    html = viewer.get(f"/jobs/{JOB}").text
    assert "<script>alert" not in html
    assert "<img src=x" not in html
    escaped = "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;"
    # the failed event (in the failed-ranks table and the events table) and the failed restore
    assert html.count(escaped) == 3
    assert html.count('<tr data-step="40" data-tier="persistent" data-kind="failed"') == 2
    assert '<tr data-ok="false">' in html


def test_job_page_fragment_for_htmx(viewer, agent_token):
    scripted_job(viewer, agent_token("n1"))
    r = viewer.get(f"/jobs/{JOB}", headers={"HX-Request": "true"})
    assert r.status_code == 200
    assert "HX-Request" in r.headers["vary"]
    assert r.text.lstrip().startswith('<div id="job-live"')
    assert 'id="job-events" class="events" hx-swap-oob="true"' in r.text
    assert "<html" not in r.text


def test_cluster_page_lists_jobs_with_worst_lag(viewer, agent_token):
    scripted_job(viewer, agent_token("n1"))
    html = viewer.get("/").text
    row = html[html.index(f'<tr data-job="{JOB}">') :]
    row = row[: row.index("</tr>")]
    assert f'<a href="/jobs/{JOB}">{JOB}</a>' in row
    assert "persistent: 53 steps (26.5 s)" in row  # 53 steps x 0.5 s
    assert "<td>52</td>" in row


def test_unknown_job_is_a_404_page(viewer):
    r = viewer.get("/jobs/nope")
    assert r.status_code == 404
    assert "no job &#39;nope&#39;" in r.text
    r = viewer.get("/jobs/%3Cb%3E")
    assert r.status_code == 404
    assert "<b>" not in r.text


def test_job_page_needs_sign_in(client):
    r = client.get(f"/jobs/{JOB}", follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == f"/login?next=%2Fjobs%2F{JOB}"
