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


def format_bytes(value: float | int | None) -> str:
    """A size in bytes with a binary unit: ``512 B``, ``4.0 KiB``, ``1.5 GiB`` (``—`` for None)."""
    if value is None:
        return "—"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(size) < 1024 or unit == "PiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} PiB"  # pragma: no cover - the loop always returns


def format_duration(value: float | None) -> str:
    """A duration in seconds, coarsely: ``0.42 s``, ``30.0 s``, ``2.5 min``, ``3.1 h``."""
    if value is None:
        return "—"
    if value < 10:
        return f"{value:.2f} s"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.1f} s"


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
    env.filters["bytes"] = format_bytes
    env.filters["duration"] = format_duration
    return env


templates = Jinja2Blocks(env=_make_env(), context_processors=[_common_context])
