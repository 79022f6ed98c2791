"""A migrator process for test_migration_lock.py: one upgrade, paused inside its transaction
right after it created ``alembic_version`` until the test lets it go.

    python gated_migrator.py URL GATE_CLASS GATE_OBJECT locked|unlocked

The pause: the migration's own session asks for the shared advisory lock (GATE_CLASS,
GATE_OBJECT) that the test holds exclusively, so the test sees it wait in ``pg_locks``.
``locked`` runs :func:`tierwatch.server.migrate.upgrade` (under the migration lock);
``unlocked`` runs Alembic's ``command.upgrade`` directly, as ``upgrade`` did before it took a
lock. Exits 0 when the upgrade succeeded, 1 with the error on stderr.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

from alembic import command
from sqlalchemy import Engine, event

from tierwatch.server.migrate import alembic_config, upgrade


def main(argv: list[str]) -> int:
    url, gate_class, gate_object, mode = argv

    def _pause(conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if not statement.lstrip().upper().startswith("CREATE TABLE ALEMBIC_VERSION"):
            return
        # Another cursor of the same session: the DDL's own cursor keeps its (empty) result.
        cur = conn.connection.dbapi_connection.cursor()
        gate = (int(gate_class), int(gate_object))
        cur.execute("SELECT pg_advisory_lock_shared(%s, %s)", gate)
        cur.execute("SELECT pg_advisory_unlock_shared(%s, %s)", gate)
        cur.close()

    event.listen(Engine, "after_cursor_execute", _pause)
    try:
        if mode == "locked":
            upgrade(url)
        else:
            command.upgrade(alembic_config(url), "head")
    except Exception:  # noqa: BLE001 - the test reads the error
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
