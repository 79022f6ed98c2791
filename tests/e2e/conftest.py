"""The e2e tests' database: one backend (see ``database_url``); their process fixtures
come from process_fixtures.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support import PG_URL, migrated_database


@pytest.fixture(scope="session")
def database_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The e2e and browser tests run their processes on one backend: PostgreSQL when
    configured (what a cluster runs), else SQLite. What the SQL itself does on each backend
    is covered by the in-process tests (ingest, services, migrations, leader lock)."""
    with migrated_database("postgres" if PG_URL else "sqlite", tmp_path_factory) as url:
        yield url
