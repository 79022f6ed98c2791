"""The cluster page: counts, tiles coloured by state, filters, the htmx fragment."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from sqlalchemy import event, select, update
from support import make_batch, post_batch

from tierwatch.agent.protocol import utcnow
from tierwatch.server.fleet import cluster_live
from tierwatch.server.fleet.models import Node, ReasonRow
from tierwatch.server.web import delta
from tierwatch.server.web.templating import format_ts

TILE_RE = re.compile(r'data-node="([^"]+)" data-state="([^"]+)"')
ATTENTION_RE = re.compile(r'data-attention="([^"]+)" data-state="([^"]+)"')
FLEET = ("ok-1", "hot-1", "xid-1", "gone-1")


def tiles(html: str) -> dict[str, str]:
    """``node -> state`` of the tiles on a page."""
    return dict(TILE_RE.findall(html))


def count(html: str, state: str) -> int:
    match = re.search(rf'data-count="{state}">(\d+)<', html)
    assert match, f"no count for {state}"
    return int(match.group(1))


@pytest.fixture
def settings(settings):  # type: ignore[no-untyped-def]
    """No background loop: the page's queries are counted on the app's engine, and the
    leader's passes (command expiry, policy, alerts) would add theirs at random moments."""
    return settings.model_copy(update={"background_tick_s": 0})


@pytest.fixture
def tokens(agent_token):  # type: ignore[no-untyped-def]
    """The agent tokens of the ``fleet`` nodes, by node."""
    return {node: agent_token(node) for node in FLEET}


@pytest.fixture
def fleet(viewer, tokens, session):  # type: ignore[no-untyped-def]
    """Four nodes, one per state: ok-1 healthy, hot-1 degraded, xid-1 unhealthy, gone-1
    unreachable (its last report an hour ago)."""
    for node, extra in (
        ("ok-1", {}),
        ("hot-1", {"temperature_c": 87.0}),
        ("xid-1", {"xids": [(1, 79)]}),
        ("gone-1", {}),
    ):
        r = post_batch(viewer, tokens[node], make_batch(node, 1, **extra))
        assert r.status_code == 200, r.text
    session.execute(
        update(Node).where(Node.name == "gone-1").values(last_seen=utcnow() - timedelta(hours=1))
    )
    session.commit()
    return viewer


def test_cluster_page_lists_nodes_with_states_and_counts(fleet):
    r = fleet.get("/")
    assert r.status_code == 200
    assert tiles(r.text) == {
        "gone-1": "unreachable",
        "hot-1": "degraded",
        "ok-1": "healthy",
        "xid-1": "unhealthy",
    }
    for state in ("healthy", "degraded", "unhealthy", "unreachable"):
        assert count(r.text, state) == 1
    assert count(r.text, "all") == 4


def tile_html(html: str, node: str) -> str:
    """The markup of one node's tile on a page."""
    tile = html[html.index(f'<a id="n-{node}"') :]
    return tile[: tile.index("</a>") + 4]


def test_tile_shows_worst_reason_action_and_badges(fleet, session):
    session.execute(update(Node).where(Node.name == "xid-1").values(isolated=True))
    session.commit()
    tile = tile_html(fleet.get("/?name=xid-1").text, "xid-1")
    assert "XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS on GPU 1" in tile
    assert "<code>RESTART_BM</code>" in tile
    assert ">sim<" in tile
    assert ">isolated<" in tile
    assert 'class="tile iso"' in tile
    # the tooltip says it all for the compact grid, where only the square shows
    assert 'title="xid-1: unhealthy, isolated · XID 79 ROBUST_CHANNEL' in tile


def test_tile_holds_only_slow_facts(fleet, tokens):
    """A new report that moves temperatures and last_seen leaves the tile as it was."""
    before = tile_html(fleet.get("/").text, "ok-1")
    post_batch(fleet, tokens["ok-1"], make_batch("ok-1", 2, temperature_c=61.0, power_w=512.0))
    assert tile_html(fleet.get("/").text, "ok-1") == before
    assert "°C" not in before


def test_unreachable_tile_says_when_it_was_last_seen(fleet, session):
    last = session.scalar(select(Node.last_seen).where(Node.name == "gone-1"))
    html = fleet.get("/?state=unreachable").text
    assert f"no report since {format_ts(last)}" in tile_html(html, "gone-1")


def test_needs_attention_lists_the_worst_first(fleet, session):
    session.execute(update(Node).where(Node.name == "ok-1").values(isolated=True))
    session.commit()
    html = fleet.get("/").text
    assert ATTENTION_RE.findall(html) == [
        ("xid-1", "unhealthy"),
        ("gone-1", "unreachable"),
        ("hot-1", "degraded"),
        ("ok-1", "healthy"),  # isolated: out of service until released
    ]
    assert 'Needs attention <span class="muted">(4)</span>' in html


@pytest.mark.one_backend
def test_needs_attention_is_capped(fleet, monkeypatch):
    monkeypatch.setattr(cluster_live, "ATTENTION_LIMIT", 2)
    html = fleet.get("/").text
    assert [n for n, _ in ATTENTION_RE.findall(html)] == ["xid-1", "gone-1"]
    assert "and 1 more" in html


@pytest.mark.one_backend
def test_grid_is_compact_from_many_nodes(fleet, monkeypatch):
    assert 'class="grid"' in fleet.get("/").text
    monkeypatch.setattr(cluster_live, "COMPACT_FROM", 4)
    html = fleet.get("/").text
    assert 'class="grid compact"' in html
    assert 'class="grid compact"' not in fleet.get("/?state=healthy").text  # one tile shown
    assert len(tiles(html)) == 4


def test_filter_by_state(fleet):
    r = fleet.get("/?state=unhealthy")
    assert tiles(r.text) == {"xid-1": "unhealthy"}
    assert count(r.text, "all") == 4  # counts ignore the state filter
    assert 'hx-get="/?state=unhealthy"' in r.text


def test_filter_by_name(fleet):
    r = fleet.get("/?name=HOT")
    assert tiles(r.text) == {"hot-1": "degraded"}
    assert count(r.text, "all") == 1
    assert count(r.text, "degraded") == 1


def test_filters_combine_and_stay_in_the_polling_url(fleet):
    r = fleet.get("/?state=healthy&name=-1")
    assert tiles(r.text) == {"ok-1": "healthy"}
    assert 'hx-get="/?state=healthy&amp;name=-1"' in r.text
    assert "every 1.5s [document.visibilityState==='visible']" in r.text
    # the state links keep the name filter
    assert 'href="/?state=degraded&amp;name=-1"' in r.text


def test_name_filter_matches_like_wildcards_literally(fleet):
    assert tiles(fleet.get("/?name=%25").text) == {}
    assert tiles(fleet.get("/?name=_").text) == {}


def test_unknown_state_filter_is_ignored(fleet):
    r = fleet.get("/?state=bogus")
    assert r.status_code == 200
    assert len(tiles(r.text)) == 4


def test_empty_cluster_says_how_to_add_nodes(viewer):
    r = viewer.get("/")
    assert "tierwatch-agent run" in r.text
    assert count(r.text, "all") == 0


def test_htmx_request_gets_fragment_with_vary(fleet):
    page = fleet.get("/?state=degraded")
    assert "HX-Request" in page.headers["vary"]
    assert "<html" in page.text
    frag = fleet.get("/?state=degraded", headers={"HX-Request": "true"})
    assert frag.status_code == 200
    assert "HX-Request" in frag.headers["vary"]
    assert "<html" not in frag.text
    assert frag.text.lstrip().startswith('<div id="live"')
    assert tiles(frag.text) == {"hot-1": "degraded"}
    # the poll swaps nothing itself: a whole live part says where it goes
    assert frag.headers["hx-retarget"] == "#live"
    assert frag.headers["hx-reswap"] == "outerHTML"


def test_boosted_and_history_requests_get_the_whole_page(fleet):
    for header in ("HX-Boosted", "HX-History-Restore-Request"):
        r = fleet.get("/", headers={"HX-Request": "true", header: "true"})
        assert "<html" in r.text, header


def test_hostile_reason_message_is_escaped(fleet, session):
    version = fleet.get("/").headers["x-cluster-version"]
    node_id = session.scalar(select(Node.id).where(Node.name == "xid-1"))
    session.execute(
        update(ReasonRow)
        .where(ReasonRow.node_id == node_id)
        .values(message='<script>alert("x")</script>', action="<b>RESTART_BM</b>")
    )
    session.commit()
    patch = poll(fleet, version)  # the out-of-band tile and attention list
    assert oob_ids(patch.text) == ["cluster-version", "cluster-attention", "n-xid-1"]
    for html in (fleet.get("/").text, fleet.get("/nodes/xid-1").text, patch.text):
        assert "<script>alert" not in html
        assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in html
        assert "<b>RESTART_BM</b>" not in html
        assert "&lt;b&gt;RESTART_BM&lt;/b&gt;" in html


def test_cluster_fragment_query_count_does_not_grow_with_nodes(viewer, agent_token, app):
    """No N+1: the cluster page reads the latest-value tables in a fixed number of queries."""
    statements: list[str] = []

    def record(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        statements.append(statement)

    def queries_for_page() -> int:
        statements.clear()
        event.listen(app.state.engine, "before_cursor_execute", record)
        try:
            assert viewer.get("/", headers={"HX-Request": "true"}).status_code == 200
        finally:
            event.remove(app.state.engine, "before_cursor_execute", record)
        return len(statements)

    for i in range(3):
        post_batch(viewer, agent_token(f"a-{i}"), make_batch(f"a-{i}", 1, xids=[(0, 79)]))
    queries_for_page()  # warms the token cache, so both counts below exclude the lookup
    few = queries_for_page()
    for i in range(3, 20):
        post_batch(viewer, agent_token(f"a-{i}"), make_batch(f"a-{i}", 1, xids=[(0, 79)]))
    assert queries_for_page() == few


# --- the poll: only what changed ---------------------------------------------------------
# (one_backend: the poll's logic; the state changes behind it run on both backends)

VERSION_RE = re.compile(r'id="cluster-version" name="since" value="([0-9a-f]+)"')
OOB_RE = re.compile(r'<\w+[^>]* id="([^"]+)"[^>]* hx-swap-oob="true"')


def poll(client, since: str, **params: str):  # type: ignore[no-untyped-def]
    """The page's htmx poll: the filters in the URL, the version it shows as ``since``."""
    return client.get("/", params={**params, "since": since}, headers={"HX-Request": "true"})


def oob_ids(html: str) -> list[str]:
    """The ids of the elements an answer swaps out of band, in order."""
    return OOB_RE.findall(html)


@pytest.mark.one_backend
def test_page_carries_its_version(fleet):
    r = fleet.get("/")
    (version,) = VERSION_RE.findall(r.text)
    assert r.headers["x-cluster-version"] == version
    assert 'hx-include="#cluster-version" hx-swap="none"' in r.text


@pytest.mark.one_backend
def test_unchanged_poll_gets_204(fleet):
    version = fleet.get("/").headers["x-cluster-version"]
    r = poll(fleet, version)
    assert r.status_code == 204
    assert r.content == b""
    assert r.headers["x-cluster-version"] == version
    assert "HX-Request" in r.headers["vary"]
    assert r.headers["cache-control"] == "no-store"


def test_poll_after_a_state_change_sends_only_that_tile_and_the_counts(fleet, tokens):
    version = fleet.get("/").headers["x-cluster-version"]
    r = post_batch(fleet, tokens["ok-1"], make_batch("ok-1", 2, xids=[(0, 79)]))
    assert r.status_code == 200, r.text
    r = poll(fleet, version)
    assert r.status_code == 200
    assert "HX-Retarget" not in r.headers
    assert tiles(r.text) == {"ok-1": "unhealthy"}
    assert oob_ids(r.text) == ["cluster-version", "cluster-head", "cluster-attention", "n-ok-1"]
    assert count(r.text, "unhealthy") == 2
    assert count(r.text, "healthy") == 0
    assert 'id="live"' not in r.text
    new = r.headers["x-cluster-version"]
    assert new != version
    assert VERSION_RE.findall(r.text) == [new]
    assert poll(fleet, new).status_code == 204  # the patched page is current


def test_a_report_that_changes_no_state_leaves_the_page_unchanged(fleet, tokens):
    version = fleet.get("/").headers["x-cluster-version"]
    post_batch(fleet, tokens["ok-1"], make_batch("ok-1", 2, temperature_c=63.0))
    assert poll(fleet, version).status_code == 204


@pytest.mark.one_backend
def test_unknown_version_gets_the_whole_live_part(fleet):
    r = poll(fleet, "0123456789abcdef")
    assert r.status_code == 200
    assert r.text.lstrip().startswith('<div id="live"')
    assert r.headers["hx-retarget"] == "#live"
    assert r.headers["hx-reswap"] == "outerHTML"
    assert len(tiles(r.text)) == 4


@pytest.mark.one_backend
def test_version_forgotten_by_this_process(fleet, tokens, monkeypatch):
    """Another worker's or an evicted version: still current means 204, else the whole part."""
    version = fleet.get("/").headers["x-cluster-version"]
    monkeypatch.setattr(cluster_live, "CACHE", delta.SnapshotCache(cluster_live.CACHE_ENTRIES))
    assert poll(fleet, version).status_code == 204  # equal content, equal version
    monkeypatch.setattr(cluster_live, "CACHE", delta.SnapshotCache(cluster_live.CACHE_ENTRIES))
    post_batch(fleet, tokens["ok-1"], make_batch("ok-1", 2, xids=[(0, 79)]))
    r = poll(fleet, version)
    assert r.headers["hx-reswap"] == "outerHTML"
    assert len(tiles(r.text)) == 4


@pytest.mark.one_backend
def test_other_filters_get_the_whole_live_part(fleet):
    version = fleet.get("/", params={"state": "unhealthy"}).headers["x-cluster-version"]
    assert poll(fleet, version, state="unhealthy").status_code == 204
    r = poll(fleet, version)
    assert r.headers["hx-reswap"] == "outerHTML"
    assert len(tiles(r.text)) == 4


def test_a_node_leaving_the_filtered_grid_sends_the_whole_live_part(fleet, tokens):
    version = fleet.get("/", params={"state": "healthy"}).headers["x-cluster-version"]
    post_batch(fleet, tokens["ok-1"], make_batch("ok-1", 2, xids=[(0, 79)]))
    r = poll(fleet, version, state="healthy")
    assert r.headers["hx-reswap"] == "outerHTML"
    assert tiles(r.text) == {}
    assert "No nodes match state “healthy”" in r.text


@pytest.mark.one_backend
def test_a_new_node_sends_the_whole_live_part(fleet, agent_token):
    version = fleet.get("/").headers["x-cluster-version"]
    post_batch(fleet, agent_token("new-1"), make_batch("new-1", 1))
    r = poll(fleet, version)
    assert r.headers["hx-reswap"] == "outerHTML"
    assert len(tiles(r.text)) == 5


@pytest.mark.one_backend
def test_full_page_ignores_since(fleet):
    version = fleet.get("/").headers["x-cluster-version"]
    r = fleet.get("/", params={"since": version})
    assert r.status_code == 200
    assert "<html" in r.text


@pytest.mark.one_backend
def test_over_long_since_is_refused_with_what_to_fix(fleet):
    r = poll(fleet, "a" * (cluster_live.SINCE_MAX + 1))
    assert r.status_code == 422
    assert "since" in r.text
    assert f"at most {cluster_live.SINCE_MAX} characters" in r.text


@pytest.mark.one_backend
def test_poll_needs_a_viewer(client, agent_token, make_token):
    """Like the page: no one signed in is sent to sign in, an agent token is refused."""
    r = client.get("/", params={"since": "0123456789abcdef"}, headers={"HX-Request": "true"})
    assert r.status_code == 401
    assert r.headers["hx-redirect"].startswith("/login")
    assert "HX-Reswap" not in r.headers
    r = client.get(
        "/",
        params={"since": "0123456789abcdef"},
        headers={"HX-Request": "true", "Authorization": f"Bearer {agent_token('ok-1')}"},
    )
    assert r.status_code == 403
    assert "x-cluster-version" not in r.headers
    viewer = {"HX-Request": "true", "Authorization": f"Bearer {make_token('viewer')}"}
    assert client.get("/", params={"since": "0" * 16}, headers=viewer).status_code == 200
