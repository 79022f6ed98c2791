"""URLs made safe to log and to return: credentials replaced by ``***``.

The persistent URL may embed credentials (``s3://KEY:SECRET@bucket/prefix``,
``https://user:pass@host/x``, a presigned ``?X-Amz-Signature=…`` or an Azure SAS ``?sig=…``),
and so may the server URL. :func:`redact_url` is for display only: the agent always connects
with the URL as configured.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

__all__ = ["REDACTED", "is_sensitive_param", "redact_url"]

REDACTED = "***"

# query parameter names whose value is a credential (compared lower-cased); AWS SigV4
# presigned URLs, Azure SAS, GCS signed URLs and the usual token parameters
_SENSITIVE_NAMES = frozenset(
    {
        "sig",
        "signature",
        "x-amz-signature",
        "x-amz-credential",
        "x-amz-security-token",
        "x-goog-signature",
        "x-goog-credential",
        "awsaccesskeyid",
        "key",
        "apikey",
        "api_key",
        "api-key",
        "access_token",
        "token",
        "password",
        "passwd",
        "pwd",
        "secret",
        "client_secret",
        "auth",
    }
)
_SENSITIVE_PARTS = ("signature", "token", "secret", "password", "credential")
_PORT_THEN_PATH = re.compile(r"\d*/.*", re.DOTALL)  # "host:8080/a@b" has no userinfo


def is_sensitive_param(name: str) -> bool:
    """Whether a query parameter named ``name`` carries a credential.

    Args:
        name: The parameter's name as it appears in the URL (percent-encoding allowed).

    Returns:
        True for the names in the list above (case-insensitive) and for names that contain
        ``signature``, ``token``, ``secret``, ``password`` or ``credential``.
    """
    lowered = unquote(name).strip().lower()
    return lowered in _SENSITIVE_NAMES or any(part in lowered for part in _SENSITIVE_PARTS)


def _redact_query(query: str) -> str:
    parts = []
    for item in query.split("&"):
        name, sep, value = item.partition("=")
        parts.append(f"{name}={REDACTED}" if sep and value and is_sensitive_param(name) else item)
    return "&".join(parts)


def redact_url(url: str) -> str:
    """``url`` with its credentials replaced by ``***``, for logs, events and API answers.

    - the password of the userinfo: ``s3://KEY:SECRET@bucket/p`` → ``s3://KEY:***@bucket/p``
      (a secret that contains ``/``, as AWS secret keys may, is redacted up to the ``@``);
    - the value of each sensitive query parameter (:func:`is_sensitive_param`):
      ``…?X-Amz-Signature=ab&x=1`` → ``…?X-Amz-Signature=***&x=1``.

    Everything else is kept byte for byte (a user name without a password, ports, paths, the
    fragment); a string that is not a URL comes back unchanged. Never raises.

    Args:
        url: Any URL or path.

    Returns:
        The redacted URL.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest, hash_sep, fragment = rest.partition("#")
    rest, query_sep, query = rest.partition("?")
    at = rest.find("@")
    if at > 0:
        user, colon, password = rest[:at].partition(":")
        if colon and password and "/" not in user and not _PORT_THEN_PATH.fullmatch(password):
            rest = f"{user}:{REDACTED}{rest[at:]}"
    if query_sep:
        rest = f"{rest}?{_redact_query(query)}"
    return f"{scheme}://{rest}{hash_sep}{fragment}"
