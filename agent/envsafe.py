"""The environment of the commands tierwatch runs (isolation executables, ``scontrol``),
without tierwatch's secrets.

An isolation command is an operator's script: it needs ``PATH``, ``SLURM_CONF``,
``KUBECONFIG`` and the like, never the agent's bearer token, the peer token, the server's
session secret or the credentials of the persistent tier. :func:`scrubbed_env` drops those.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["is_secret_env", "scrubbed_env"]

# compared upper-cased: pydantic-settings reads TIERWATCH_* case-insensitively
_SECRET_NAMES = frozenset(
    {
        "TIERWATCH_TOKEN",
        "TIERWATCH_PEER_TOKEN",
        "TIERWATCH_SECRET_KEY",
        "TIERWATCH_DATABASE_URL",  # may hold the database password
        "TIERWATCH_PERSISTENT_URL",  # may embed credentials (s3://KEY:SECRET@bucket)
        "TIERWATCH_PERSISTENT_OPTIONS",  # fsspec options may hold key/secret
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
    }
)
_SECRET_PARTS = ("TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")


def is_secret_env(name: str) -> bool:
    """Whether the environment variable ``name`` may hold a tierwatch or storage secret.

    Args:
        name: A variable name (any case).

    Returns:
        True for the names listed above and for every ``TIERWATCH_*`` name that contains
        ``TOKEN`` (``TIERWATCH_TOKEN_FILE``, ``TIERWATCH_PEER_TOKEN_FILE``, …), ``SECRET``,
        ``PASSWORD`` or ``CREDENTIAL``.
    """
    upper = name.upper()
    if upper in _SECRET_NAMES:
        return True
    return upper.startswith("TIERWATCH_") and any(part in upper for part in _SECRET_PARTS)


def scrubbed_env(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``environ`` without the variables :func:`is_secret_env` names.

    Args:
        environ: Usually ``os.environ``; it is not modified.

    Returns:
        The environment to give a child process. Never raises.
    """
    return {name: value for name, value in environ.items() if not is_secret_env(name)}
