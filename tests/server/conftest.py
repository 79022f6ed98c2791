"""Fixtures for the replica tests (migration lock, leader lock, pools, rate limit): the real
PostgreSQL, and fresh schemas on it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from executables import REQUIRE_ENV
from sqlalchemy import text
from sqlalchemy.engine import make_url
from support import PG_URL

from tierwatch.server.db import make_engine


@pytest.fixture(scope="session")
def pg_url() -> str:
    """``TIERWATCH_TEST_DATABASE_URL``: skips without it, fails without it under CI
    (``TIERWATCH_REQUIRE_SERVERS=1``, which ``.ci/run`` sets)."""
    if PG_URL:
        return PG_URL
    message = "TIERWATCH_TEST_DATABASE_URL is not set (.ci/run sets it)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{message}; {REQUIRE_ENV}=1 requires PostgreSQL", pytrace=False)
    pytest.skip(message)


def schema_url(base: str, schema: str) -> str:
    """``base`` with its search_path set to ``schema``."""
    return (
        make_url(base)
        .update_query_dict({"options": f"-csearch_path={schema}"})
        .render_as_string(hide_password=False)
    )


@pytest.fixture
def fresh_schema(pg_url: str) -> Iterator[str]:
    """The URL of an empty PostgreSQL schema of this test's own, dropped afterwards."""
    schema = f"tw_ha_{uuid.uuid4().hex[:10]}"
    admin = make_engine(pg_url, pool_size=1, max_overflow=0)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield schema_url(pg_url, schema)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
