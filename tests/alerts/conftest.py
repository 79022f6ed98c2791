"""Fixtures for alert tests: webhook receivers, alert settings, an app with the alerts routes,
and a session factory on the test database."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from alert_support import AlertingSettings, Receiver
from sqlalchemy.orm import Session, sessionmaker

from tierwatch.server.alerts import api as alerts_api
from tierwatch.server.alerts import views as alerts_views
from tierwatch.server.alerts.service import AlertSettings
from tierwatch.server.config import Settings
from tierwatch.server.db import make_engine, make_sessionmaker
from tierwatch.server.main import create_app


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
    return AlertingSettings(
        database_url=db_url, dev=True, prune_interval_s=0, alerts=alert_settings
    )


@pytest.fixture
def app(settings: Settings):  # type: ignore[no-untyped-def]
    """The control-plane app with the alerts routes (added here until main.py has them)."""
    app = create_app(settings)
    paths = {getattr(r, "path", None) for r in app.routes}
    if "/api/v1/alerts" not in paths:
        app.include_router(alerts_api.router)
    if "/alerts" not in paths:
        app.include_router(alerts_views.router)
    return app
