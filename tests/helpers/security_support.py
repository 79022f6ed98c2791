"""Helpers shared by the security tests: roles, the seeded cluster, dashboard sessions."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient
from support import auth, make_batch, post_batch, register_job

from tierwatch.agent.protocol import CheckpointEvent, JobProgress, ReportBatch, utcnow

# Who calls: no token, the three people's roles, an agent bound to n1 (the node the
# requests are about) and an agent bound to another node.
ROLES = ("none", "viewer", "operator", "admin", "agent_n1", "agent_other")
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})

JOB = "job-1"
LAYOUT = ["n1", "n2"]
CSRF_RE = re.compile(r'name="csrf_token" value="([^"]+)"')


def committed(step: int, tier: str, rank: int | None) -> CheckpointEvent:
    """A committed checkpoint event of :data:`JOB`."""
    return CheckpointEvent(
        job_id=JOB,
        step=step,
        tier=tier,
        kind="committed",
        rank=rank,
        world_size=None if rank is None else 2,
        ts=utcnow(),
        bytes=100,
        seconds=0.5,
    )


def seed_cluster(client: TestClient, tokens: dict[str, str | None]) -> None:
    """n1 and n2 report (2 GPUs each) and run the 2-rank job :data:`JOB` at step 25 with
    steps 10 and 20 committed in memory on both ranks (and 10 persistent).

    The job is registered on n1 and n2 first, as its launcher would: through the API with
    ``tokens["operator"]`` (or ``"admin"``), else, for a ``TestClient``, through its app.
    """
    registrar = tokens.get("operator") or tokens.get("admin")
    if registrar:
        r = client.post(
            f"/api/v1/jobs/{JOB}/credential",
            json={"nodes": LAYOUT, "world_size": 2, "layout": LAYOUT},
            headers=auth(registrar),
        )
        assert r.status_code == 200, r.text
    else:
        register_job(client, JOB, LAYOUT, world_size=2, layout=LAYOUT)
    for seq, node, token in ((1, "n1", tokens["agent_n1"]), (1, "n2", tokens["agent_n2"])):
        r = post_batch(client, token, make_batch(node, seq))
        assert r.status_code == 200, r.text
    batches = [
        (
            "n1",
            tokens["agent_n1"],
            ReportBatch(
                node="n1",
                epoch="epoch-1",
                seq=2,
                sent_at=utcnow(),
                progress=[
                    JobProgress(
                        job_id=JOB, rank=0, world_size=2, step=25, ts=utcnow(), layout=LAYOUT
                    )
                ],
                checkpoint_events=[
                    committed(10, "memory", 0),
                    committed(20, "memory", 0),
                    committed(10, "persistent", None),
                ],
            ),
        ),
        (
            "n2",
            tokens["agent_n2"],
            ReportBatch(
                node="n2",
                epoch="epoch-1",
                seq=2,
                sent_at=utcnow(),
                progress=[JobProgress(job_id=JOB, rank=1, world_size=2, step=25, ts=utcnow())],
                checkpoint_events=[committed(10, "memory", 1), committed(20, "memory", 1)],
            ),
        ),
    ]
    for _, token, batch in batches:
        r = post_batch(client, token, batch)
        assert r.status_code == 200, r.text
    r = client.get(f"/api/v1/jobs/{JOB}", headers=auth(tokens["viewer"]))
    assert r.status_code == 200, r.text


def csrf_from(html: str) -> str:
    """The CSRF token rendered into a page's forms."""
    match = CSRF_RE.search(html)
    assert match, "page has no csrf_token field"
    return match.group(1)


def anonymous_csrf(client: TestClient) -> str:
    """A CSRF token of a session that is not signed in (from the sign-in form)."""
    page = client.get("/login")
    assert page.status_code == 200, page.text
    return csrf_from(page.text)


def sign_in(client: TestClient, token: str) -> str:
    """Sign ``client`` in through the form; returns the signed-in session's CSRF token."""
    r = client.post(
        "/login",
        data={"token": token, "csrf_token": anonymous_csrf(client), "next": "/"},
        follow_redirects=False,
    )
    assert r.status_code == 303, r.text
    page = client.get("/")
    assert page.status_code == 200, page.text
    return csrf_from(page.text)


def is_login_redirect(response) -> bool:  # type: ignore[no-untyped-def]
    """A redirect to the sign-in form (303 for a browser, 401 + HX-Redirect for htmx)."""
    location = response.headers.get("location") or response.headers.get("hx-redirect") or ""
    return response.status_code in (302, 303, 307, 401) and location.startswith("/login")
