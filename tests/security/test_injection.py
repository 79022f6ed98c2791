"""Hostile input: node names limited to the protocol's pattern, HTML/JS and template payloads
shown inert (a real server process and headless Chromium), SQL-looking text stored and
returned literally, and actions on unknown nodes and jobs answered with a 404 that names them.
"""

from __future__ import annotations

import httpx
import pytest
from fastapi.routing import iter_route_contexts
from fastapi.testclient import TestClient
from security_support import JOB, committed, seed_cluster, sign_in
from support import auth, make_batch, post_batch

from tierwatch.agent.protocol import AgentEvent, ReportBatch, utcnow
from tierwatch.server.tokens import TokenError, create_token

# Each payload would set window.__pwned (or open a dialog) if the browser ran it.
PAYLOADS = (
    '<script>window.__pwned="script"</script>',
    "<img src=x onerror=\"window.__pwned='img';alert(1)\">",
    '"><svg onload="window.__pwned=\'svg\'">',
    "javascript:window.__pwned='js'",
    "{{7*7}} {% raw %}${7*7}",
    "'; DROP TABLE nodes; --",
    "<a href=\"javascript:window.__pwned='href'\" id=pwn-link>x</a>",
    '<div hx-post="/logout" hx-trigger="load">htmx</div>',
)
COMBINED = " | ".join(PAYLOADS)
SQL = "'; DROP TABLE nodes; --"


# --- node names ----------------------------------------------------------------------------

ALLOWED_NAMES = ["A", "gpu-node_01.rack3", "0node", "n" * 128]
REFUSED_NAMES = [
    "",
    "-lead",
    ".hidden",
    "_x",
    "n1 ",
    " n1",
    "n1\n",
    "n1/x",
    "../etc",
    "n" * 129,
    "<script>",
    "n1;drop",
    "nœud",
    "n1%00",
    "n1\x00",
]


@pytest.mark.parametrize("name", ALLOWED_NAMES, ids=lambda n: n[:20])
def test_node_names_of_the_protocol_pattern_are_accepted(client, make_token, name):
    batch = ReportBatch(node=name, epoch="epoch-1", seq=1, sent_at=utcnow())
    r = post_batch(client, make_token("agent", name), batch)
    assert r.status_code == 200, r.text
    got = client.get(f"/api/v1/nodes/{name}", headers=auth(make_token("viewer")))
    assert got.status_code == 200
    assert got.json()["name"] == name


@pytest.mark.parametrize("name", REFUSED_NAMES, ids=repr)
def test_other_node_names_are_refused_by_the_report_and_the_token(app, client, make_token, name):
    body = make_batch("n1", 1).model_dump(mode="json") | {"node": name}
    r = client.post("/api/v1/ingest/report", json=body, headers=auth(make_token("agent", "n1")))
    assert r.status_code == 422, r.text
    assert "body.node" in r.text
    with app.state.sessionmaker() as s, pytest.raises(TokenError, match="node"):
        create_token(s, role="agent", node=name)


# --- payloads through the API --------------------------------------------------------------


def test_sql_looking_input_is_stored_and_returned_literally(seeded, tokens):
    client = seeded
    op = auth(tokens["operator"])
    r = client.post("/api/v1/nodes/n1/isolate", json={"reason": SQL}, headers=op)
    assert r.status_code == 200, r.text
    assert r.json()["node"]["isolation"]["reason"] == SQL
    r = client.post("/api/v1/nodes/n1/ack", json={"note": SQL}, headers=op)
    assert r.status_code == 200, r.text
    r = client.post(f"/api/v1/jobs/{JOB}/restore", json={"reason": SQL}, headers=op)
    assert r.status_code == 202, r.text
    assert r.json()["reason"] == SQL
    post_batch(
        client,
        tokens["agent_n1"],
        ReportBatch(
            node="n1",
            epoch="epoch-1",
            seq=3,
            sent_at=utcnow(),
            events=[AgentEvent(kind="collector", ts=utcnow(), message=SQL)],
        ),
    )
    viewer = auth(tokens["viewer"])
    assert client.get("/api/v1/nodes/n1", headers=viewer).json()["isolation"]["reason"] == SQL
    reasons = [e["reason"] for e in client.get("/api/v1/audit", headers=viewer).json()]
    assert SQL in reasons
    messages = [
        e["message"]
        for e in client.get("/api/v1/events", params={"kind": "agent"}, headers=viewer).json()
    ]
    assert f"collector: {SQL}" in messages
    # The tables are all still there, and SQL in a filter matches nothing.
    assert [n["name"] for n in client.get("/api/v1/nodes", headers=viewer).json()["nodes"]] == [
        "n1",
        "n2",
    ]
    for path, params in (
        ("/api/v1/nodes", {"name": "' OR '1'='1"}),
        ("/api/v1/audit", {"actor": "' OR 1=1 --"}),
        ("/api/v1/commands", {"node": "x' OR 'a'='a"}),
    ):
        r = client.get(path, params=params, headers=viewer)
        assert r.status_code == 200, (path, r.text)
        body = r.json()
        rows = body["nodes"] if isinstance(body, dict) else body
        assert rows == [], (path, rows)
    # The events filter names a node, and no node has that name.
    r = client.get("/api/v1/events", params={"node": "n1' OR '1'='1"}, headers=viewer)
    assert r.status_code == 404, r.text
    assert r.json()["detail"] == "no node named \"n1' OR '1'='1\""


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/api/v1/nodes/ghost-7/isolate", {"reason": "x"}, "ghost-7"),
        ("/api/v1/nodes/ghost-7/release", {"reason": "x"}, "ghost-7"),
        ("/api/v1/nodes/ghost-7/ack", {}, "ghost-7"),
        ("/api/v1/jobs/ghost-job/restore", {"reason": "x"}, "ghost-job"),
    ],
)
def test_action_on_an_unknown_target_is_404_naming_it(seeded, tokens, path, body, named):
    r = seeded.post(path, json=body, headers=auth(tokens["admin"]))
    assert r.status_code == 404, r.text
    assert named in r.json()["detail"]


def _web_paths(app) -> set[str]:  # type: ignore[no-untyped-def]
    return {r.path for r in iter_route_contexts(app.routes) if "POST" in (r.methods or ())}


def test_dashboard_action_on_an_unknown_node_is_a_404_page_naming_it(app, seeded, tokens):
    browser = TestClient(app, follow_redirects=False)
    csrf = sign_in(browser, tokens["admin"])
    page = browser.get("/nodes/ghost-7")
    assert page.status_code == 404
    assert "ghost-7" in page.text
    hostile = browser.get("/nodes/" + "%3Cscript%3Ealert(1)%3C%2Fscript%3E")
    assert hostile.status_code == 404
    assert "<script>alert(1)" not in hostile.text
    for action, form in (
        ("isolate", {"reason": "x"}),
        ("release", {"reason": "x"}),
        ("ack", {"note": "x"}),
    ):
        if f"/nodes/{{name}}/{action}" not in _web_paths(app):
            continue  # that dashboard action is not there yet
        r = browser.post(f"/nodes/ghost-7/{action}", data={**form, "csrf_token": csrf})
        assert r.status_code == 404, (action, r.status_code, r.text[:300])
        assert "ghost-7" in r.text


# --- payloads in the browser ---------------------------------------------------------------


def _seed_hostile(server_url: str, tokens: dict[str, str | None]) -> None:
    """n1/n2 and job-1, with every payload in what the pages show: the isolation reason
    (node page, alerts, audit), agent event messages, the GPU model name and agent version
    (node page), a restore reason and a failed checkpoint's message (job page)."""
    with httpx.Client(base_url=server_url, timeout=30) as c:
        seed_cluster(c, tokens)  # type: ignore[arg-type]
        batch = make_batch("n1", 3).model_copy(
            update={
                "agent_version": "<svg onload=alert(1)>",
                "events": [AgentEvent(kind="collector", ts=utcnow(), message=p) for p in PAYLOADS],
                "checkpoint_events": [
                    committed(30, "memory", 0).model_copy(
                        update={"kind": "failed", "message": COMBINED[:2000]}
                    )
                ],
            }
        )
        batch.gpus[0] = batch.gpus[0].model_copy(update={"name": PAYLOADS[1][:128]})
        r = post_batch(c, tokens["agent_n1"], batch)  # type: ignore[arg-type]
        assert r.status_code == 200, r.text
        op = auth(tokens["operator"])  # type: ignore[arg-type]
        r = c.post("/api/v1/nodes/n1/isolate", json={"reason": COMBINED}, headers=op)
        assert r.status_code == 200, r.text
        r = c.post(f"/api/v1/jobs/{JOB}/restore", json={"reason": COMBINED}, headers=op)
        assert r.status_code == 202, r.text


def _arm(page) -> list[str]:  # type: ignore[no-untyped-def]
    """Record dialogs and page errors; returns the list they are appended to."""
    seen: list[str] = []
    page.on("dialog", lambda d: (seen.append(f"dialog: {d.message}"), d.dismiss()))
    page.on("pageerror", lambda exc: seen.append(f"pageerror: {exc}"))
    return seen


def _assert_inert(page, url: str, seen: list[str], *, expect_text: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
    from playwright.sync_api import expect

    page.goto(url)
    expect(page.locator("main")).to_be_visible()
    # Wait for one htmx poll to swap the live block in: the fragment path must be inert too.
    live = page.locator(".live").first
    if live.count():
        # The cluster page's poll answers 204 while nothing changed: a version it does not
        # know makes it send the whole live part through htmx.
        page.evaluate(
            "const v = document.getElementById('cluster-version'); if (v) v.value = 'unknown'"
        )
        page.evaluate("document.querySelector('.live').__before_swap = true")
        page.wait_for_function(
            "document.querySelector('.live') && !document.querySelector('.live').__before_swap",
            timeout=15_000,
        )
    page.wait_for_timeout(300)  # let any injected handler (onerror/onload) fire
    assert page.evaluate("window.__pwned") is None, f"{url}: a payload ran"
    assert page.locator("#pwn-link").count() == 0, f"{url}: a payload became markup"
    assert page.locator("main svg[onload], main img[onerror], main script").count() == 0
    assert seen == [], f"{url}: {seen}"
    text = page.locator("main").inner_text()
    for wanted in expect_text:
        assert wanted in text, f"{url}: {wanted!r} not shown literally"


@pytest.mark.e2e
@pytest.mark.browser
@pytest.mark.one_backend  # what the browser does with the pages is not the SQL's business
def test_payloads_are_shown_inert_in_the_browser(browser, server, make_token):
    tokens = {
        "agent_n1": make_token("agent", "n1"),
        "agent_n2": make_token("agent", "n2"),
        "viewer": make_token("viewer"),
        "operator": make_token("operator"),
    }
    _seed_hostile(server.url, tokens)

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(15_000)
    seen = _arm(page)
    page.goto(f"{server.url}/login")
    page.fill("#token", tokens["viewer"])
    page.click("main form button[type=submit]")
    page.wait_for_url(f"{server.url}/")

    _assert_inert(page, f"{server.url}/nodes/n1", seen, expect_text=(*PAYLOADS,))
    _assert_inert(page, f"{server.url}/jobs/{JOB}", seen, expect_text=(*PAYLOADS,))
    _assert_inert(page, f"{server.url}/alerts", seen, expect_text=(PAYLOADS[0], PAYLOADS[2]))
    _assert_inert(page, f"{server.url}/", seen, expect_text=("n1",))
    with httpx.Client(base_url=server.url) as c:
        has_audit_page = c.get("/audit", follow_redirects=False).status_code != 404
    if has_audit_page:
        _assert_inert(page, f"{server.url}/audit", seen, expect_text=(PAYLOADS[0],))
    # Still signed in: the htmx payload did not sign us out.
    page.goto(f"{server.url}/")
    assert page.url == f"{server.url}/"
