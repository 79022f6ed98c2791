"""Fixtures for alert tests: webhook receivers, alert settings (used by the shared ``app``
fixture through ``settings``) and a session factory on the test database."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from alert_support import Receiver
from sqlalchemy.orm import Session, sessionmaker

from tierwatch.server.alerts.service import AlertSettings
from tierwatch.server.config import Settings
from tierwatch.server.db import make_engine, make_sessionmaker


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.start()
    yield r
    r.stop()


@pytest.fixture
def receiver2() -> Iterator[Receiver]:
    r = Receiver()
    r.start()
    yield r
    r.stop()


@pytest.fixture
def sm(db_url: str) -> Iterator[sessionmaker[Session]]:
    """A session factory on the (emptied) test database."""
    engine = make_engine(db_url)
    yield make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture
def alert_settings() -> AlertSettings:
    """No webhooks; tests that deliver make their own settings."""
    return AlertSettings()


@pytest.fixture
def settings(db_url: str, alert_settings: AlertSettings) -> Settings:
    """Dev-mode settings on the test database with ``alert_settings``, pruner off."""
    return Settings(database_url=db_url, dev=True, prune_interval_s=0, alerts=alert_settings)
