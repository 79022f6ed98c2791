"""The cluster page: counts, tiles coloured by state, filters, the htmx fragment."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from sqlalchemy import event, select, update
from support import make_batch, post_batch

from tierwatch.agent.protocol import utcnow
from tierwatch.server.fleet.models import Node, ReasonRow

TILE_RE = re.compile(r'data-node="([^"]+)" data-state="([^"]+)"')


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
def fleet(viewer, agent_token, session):  # type: ignore[no-untyped-def]
    """Four nodes, one per state: ok-1 healthy, hot-1 degraded, xid-1 unhealthy, gone-1
    unreachable (its last report an hour ago)."""
    for node, extra in (
        ("ok-1", {}),
        ("hot-1", {"temperature_c": 87.0}),
        ("xid-1", {"xids": [(1, 79)]}),
        ("gone-1", {}),
    ):
        r = post_batch(viewer, agent_token(node), make_batch(node, 1, **extra))
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


def test_tile_shows_worst_reason_action_gpus_and_badges(fleet, session):
    session.execute(update(Node).where(Node.name == "xid-1").values(isolated=True))
    session.commit()
    html = fleet.get("/?name=xid-1").text
    tile = html[html.index('data-node="xid-1"') :]
    tile = tile[: tile.index("</a>")]
    assert "XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS on GPU 1" in tile
    assert "<code>RESTART_BM</code>" in tile
    assert "2 GPU" in tile
    assert "max 55 °C" in tile
    assert ">sim<" in tile
    assert ">isolated<" in tile


def test_unreachable_tile_says_when_it_was_last_seen(fleet):
    html = fleet.get("/?state=unreachable").text
    assert "no report, last seen 1h ago" in html


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


def test_boosted_and_history_requests_get_the_whole_page(fleet):
    for header in ("HX-Boosted", "HX-History-Restore-Request"):
        r = fleet.get("/", headers={"HX-Request": "true", header: "true"})
        assert "<html" in r.text, header


def test_hostile_reason_message_is_escaped(fleet, session):
    node_id = session.scalar(select(Node.id).where(Node.name == "xid-1"))
    session.execute(
        update(ReasonRow)
        .where(ReasonRow.node_id == node_id)
        .values(message='<script>alert("x")</script>', action="<b>RESTART_BM</b>")
    )
    session.commit()
    for html in (fleet.get("/").text, fleet.get("/nodes/xid-1").text):
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
