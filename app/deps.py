"""Shared FastAPI dependencies: settings and a database session per request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from tierwatch.server.config import Settings


def get_settings_dep(request: Request) -> Settings:
    """The settings the app was created with."""
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    """A session for one request: committed on success, rolled back on error."""
    session: Session = request.app.state.sessionmaker()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
SessionDep = Annotated[Session, Depends(get_session)]
