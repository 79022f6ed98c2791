"""The dashboard's Jinja2 environment: autoescaped templates, filters and common context.

Every template is rendered with ``autoescape=True``, so node names, reason messages and
event text are HTML-escaped wherever they appear; nothing is marked safe by hand.
``templates`` is a :class:`jinja2_fragments.fastapi.Jinja2Blocks`, so a view can render one
block of a page (``block_name="live"``) as an htmx fragment.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import jinja2
from fastapi import Request
from jinja2_fragments.fastapi import Jinja2Blocks

from tierwatch.server.resources import resource_dir
from tierwatch.server.web.csrf import ensure_csrf_token


def format_ts(value: datetime | None) -> str:
    """``2024-05-01 12:00:03 UTC`` for an aware datetime, ``—`` for None."""
    if value is None:
        return "—"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def format_ago(value: datetime | None, now: datetime | None = None) -> str:
    """How long ago ``value`` was, coarsely: ``4s ago``, ``12m ago``, ``3h ago``, ``2d ago``."""
    if value is None:
        return "never"
    seconds = ((now or datetime.now(UTC)) - value).total_seconds()
    if seconds < 0:
        return "just now"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{int(seconds)}s ago"


def format_num(value: float | int | None, digits: int = 0) -> str:
    """A number with ``digits`` decimals (``—`` for None: not supported or not read)."""
    if value is None:
        return "—"
    return f"{value:.{digits}f}"


def _common_context(request: Request) -> dict[str, Any]:
    return {"csrf_token": ensure_csrf_token(request)}


def _make_env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(resource_dir("templates")),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["ts"] = format_ts
    env.filters["ago"] = format_ago
    env.filters["num"] = format_num
    return env


templates = Jinja2Blocks(env=_make_env(), context_processors=[_common_context])
