"""Where the dashboard's templates/static files and Alembic's migrations live.

Installed from a wheel they sit inside the ``tierwatch.server`` package; in a source checkout
(editable install) they are the repository's top-level folders.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def resource_dir(name: str) -> Path:
    """Path of ``templates``, ``static`` or ``migrations``.

    Raises:
        FileNotFoundError: the folder is in neither place (a broken install).
    """
    for candidate in (_PACKAGE_DIR / name, _PACKAGE_DIR.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"tierwatch resource folder {name!r} not found; reinstall tierwatch")
