"""The cluster page's answer: the whole page, or for a poll only what changed since it.

The live part is keyed parts (:mod:`tierwatch.server.web.delta`): three sections (``head``:
the counts and the policy line; ``attention``: the nodes that need someone; ``jobs``),
digested as rendered, and one part per tile (``n:<node>``), digested from its
:class:`~tierwatch.server.fleet.service.Tile` fields, which are all a tile shows. One
more key names the grid's layout (compact or labelled, or which empty message), so a change
of layout, like a node added or gone, changes the keys and sends the whole live part.

A poll (htmx, ``since=<token>``) is answered with:

- 204 and no body when nothing changed;
- 200 with the new version and the changed sections and tiles as out-of-band swaps;
- 200 with the whole live part (``HX-Retarget: #live``, ``HX-Reswap: outerHTML``) when the
  token is unknown to this process or the parts cannot be patched in place.

Every answer names its version in :data:`VERSION_HEADER`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import Request, Response
from markupsafe import Markup

from tierwatch.server.fleet import service
from tierwatch.server.fleet.service import Tile
from tierwatch.server.web import delta
from tierwatch.server.web.deps import PAGE_HEADERS, is_htmx, render_page
from tierwatch.server.web.templating import templates

PARTS_TEMPLATE = "partials/cluster_parts.html"
#: From this many tiles shown, the grid is compact: small squares, details in the tooltip.
COMPACT_FROM = 100
#: Rows of the "needs attention" list; the state counts filter the grid for the rest.
ATTENTION_LIMIT = 50
#: Snapshots this process remembers (each ~8 bytes per node plus its keys, often shared).
CACHE_ENTRIES = 32
#: Response header with the version the answer brings the page to (the next ``since``).
VERSION_HEADER = "X-Cluster-Version"
#: Longest ``since`` accepted; a token is :data:`delta.TOKEN_LENGTH` characters.
SINCE_MAX = 64

CACHE = delta.SnapshotCache(CACHE_ENTRIES)

SECTIONS = ("head", "attention", "jobs")


def tile_key(name: str) -> str:
    """The part key of a node's tile."""
    return "n:" + name


def _parts() -> Any:
    return templates.env.get_template(PARTS_TEMPLATE).module


def _layout_key(tiles: Sequence[Tile], total: int, name: str | None) -> str:
    if tiles:
        return "grid:compact" if len(tiles) >= COMPACT_FROM else "grid:labelled"
    return "grid:empty-start" if not total and not name else "grid:empty"


def cluster_response(
    request: Request,
    *,
    since: str | None,
    state: str | None,
    name: str | None,
    counts: dict[str, int],
    tiles: list[Tile],
    context: dict[str, Any],
) -> Response:
    """The page, its whole live part, the changed parts, or 204 (see the module docstring).

    Args:
        request: The request (an htmx one gets a fragment or a patch).
        since: The version the polling page shows (``#cluster-version``), or None.
        state, name: The filters (the scope of a version).
        counts: Nodes per state (:func:`service.cluster_tiles`); tiles: the tiles shown.
        context: The rest of the page's context: ``now``, ``jobs``, ``policy``, ``states``,
            ``name_query``, and what the page template needs beyond the parts.
    """
    parts = _parts()
    total = sum(counts.values())
    shown, more = service.needs_attention(tiles, ATTENTION_LIMIT)
    sections: dict[str, Callable[[bool], Markup]] = {
        "head": lambda swap: parts.head(
            counts,
            total,
            state,
            context["states"],
            context["name_query"],
            context["policy"],
            swap=swap,
        ),
        "attention": lambda swap: parts.attention(shown, more, swap=swap),
        "jobs": lambda swap: parts.jobs_table(context["jobs"], context["now"], swap=swap),
    }
    rendered = {key: render(False) for key, render in sections.items()}
    snapshot = delta.Snapshot.of(
        f"cluster\0{state or ''}\0{name or ''}",
        [
            *((key, delta.digest(str(html))) for key, html in rendered.items()),
            (_layout_key(tiles, total, name), b"\0" * delta.DIGEST_SIZE),
            *((tile_key(t.name), delta.digest(repr(t))) for t in tiles),
        ],
    )
    headers = {**PAGE_HEADERS, VERSION_HEADER: snapshot.token}
    htmx = is_htmx(request)
    changed = delta.plan(since if htmx else None, snapshot, CACHE)
    if changed == []:
        return Response(status_code=204, headers=headers)
    if changed is not None:
        by_key = {tile_key(t.name): t for t in tiles}
        body = [parts.version(snapshot.token, swap=True)]
        for key in changed:
            render = sections.get(key)
            body.append(render(True) if render else parts.tile(by_key[key], swap=True))
        return Response("\n".join(body), media_type="text/html", headers=headers)
    response = render_page(
        request,
        "pages/cluster.html",
        {
            **context,
            **rendered,
            "counts": counts,
            "total": total,
            "tiles": tiles,
            "state": state,
            "name": name or "",
            "version": snapshot.token,
            "compact": len(tiles) >= COMPACT_FROM,
        },
    )
    response.headers.update(headers)
    if htmx:  # the poll swaps nothing itself; a whole live part replaces #live
        response.headers["HX-Retarget"] = "#live"
        response.headers["HX-Reswap"] = "outerHTML"
    return response
