"""What an HTTP error response says, for messages and events (no torch)."""

from __future__ import annotations

from typing import Any

import httpx

DEFAULT_LIMIT = 1000


def error_detail(resp: httpx.Response, *, limit: int = DEFAULT_LIMIT) -> str:
    """The reason an error response gives, as text of at most ``limit`` characters.

    - a JSON body with ``detail`` (FastAPI's ``HTTPException``): the detail; FastAPI's
      validation errors (a list) become ``field: message; …`` (``body`` for the whole body);
    - any other JSON body: its text;
    - a body that is not JSON: the body, or the reason phrase (``Not Found``) when empty.

    Args:
        resp: The response (any status).
        limit: Most characters returned (the rest is cut).

    Returns:
        The detail; never raises.
    """
    try:
        data: Any = resp.json()
    except ValueError:
        return (resp.text or resp.reason_phrase)[:limit]
    detail = data.get("detail", data) if isinstance(data, dict) else data
    if isinstance(detail, list):
        fields = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', [])[1:]) or 'body'}: {e.get('msg')}"
            for e in detail
            if isinstance(e, dict)
        )
        return (fields or str(detail))[:limit]
    return str(detail)[:limit]
