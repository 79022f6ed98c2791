"""Helpers for dashboard tests: sign in through the login form, read the CSRF token."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

CSRF_RE = re.compile(r'name="csrf_token" value="([^"]+)"')


def csrf_from(html: str) -> str:
    """The CSRF token rendered into a page's forms."""
    match = CSRF_RE.search(html)
    assert match, "page has no csrf_token field"
    return match.group(1)


def sign_in(client: TestClient, token: str, next_url: str = "/"):  # type: ignore[no-untyped-def]
    """Submit the login form as a browser would; returns the POST response."""
    page = client.get("/login")
    return client.post(
        "/login",
        data={"token": token, "csrf_token": csrf_from(page.text), "next": next_url},
        follow_redirects=False,
    )
