"""Real servers the tests start (Slurm, Alertmanager, PgBouncer, Prometheus): find their
executables, skip when one is absent on a developer machine, and fail under CI.

``.ci/run`` installs the Debian packages and sets ``TIERWATCH_REQUIRE_SERVERS=1``; there a
missing executable is a failed test, never a skipped one.
"""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRE_ENV = "TIERWATCH_REQUIRE_SERVERS"


def require_executable(name: str, package: str) -> str:
    """The path of ``name`` on ``PATH`` (or ``/usr/sbin``).

    Skips the calling test when it is missing, or fails it when ``TIERWATCH_REQUIRE_SERVERS=1``.

    Args:
        name: the executable, e.g. ``slurmctld``.
        package: the Debian package that ships it (for the message).
    """
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if found:
        return found
    message = f"{name} not found: install Debian's {package} (.ci/run does)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{message}; {REQUIRE_ENV}=1 requires it", pytrace=False)
    pytest.skip(message)
