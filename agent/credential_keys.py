"""Where an agent gets the server's public keys, to check job credentials offline.

Sources, in order (docs/security.md, "Job credentials"):

1. ``--credential-keys-file`` (``TIERWATCH_CREDENTIAL_KEYS_FILE``): a JWK set written by
   ``GET /api/v1/credentials/public-keys`` (a ConfigMap, say). Used alone when given.
2. The server: ``GET <server>/api/v1/credentials/public-keys`` with the agent token, at start
   and again (at most every :data:`REFRESH_MIN_S` seconds) when a credential names a key the
   agent does not know. The last set fetched is kept in ``<state_dir>/credential-keys.json``
   (the agent's own folder, never the trainer-writable memory folder), so an agent restarted
   during a server outage still checks credentials.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tierwatch.agent.credentials import CredentialError, CredentialVerifier, JobCredential
from tierwatch.agent.urlsafe import redact_url

log = logging.getLogger(__name__)

KEYS_PATH = "/api/v1/credentials/public-keys"
CACHE_FILE = "credential-keys.json"
#: Fewest seconds between two fetches from the server (an unknown ``kid`` asks again).
REFRESH_MIN_S = 10.0
FETCH_TIMEOUT_S = 5.0
#: Most checked credentials remembered (a node runs a few jobs; the cache is then emptied).
CHECKED_KEPT = 1024


class ServerKeys:
    """The server's public keys, kept fresh, and the job credential check that uses them.

    Args:
        server: The server's base URL (None: only ``keys_file``).
        token: The agent token (sent to the server).
        keys_file: A JWK set file; when given, the server is never asked.
        state_dir: The agent's own folder (the fetched set is cached there).
        verify: TLS verification for httpx (as the reporter's).
    """

    def __init__(
        self,
        *,
        server: str | None,
        token: str | None,
        keys_file: Path | None = None,
        state_dir: Path | None = None,
        verify: Any = True,
    ) -> None:
        self.server = server.rstrip("/") if server else None
        self.token = token
        self.keys_file = keys_file
        self.cache = state_dir / CACHE_FILE if state_dir is not None else None
        self.verify = verify
        self.verifier = CredentialVerifier()
        self.error: str | None = None
        self._lock = threading.Lock()
        self._fetched_at: float | None = None
        self._checked: dict[str, JobCredential] = {}  # credential -> checked (until expiry)
        self._manifest_keys: dict[str, bytes] = {}  # job -> manifest key, from credentials

    def load(self) -> None:
        """Load the keys: from ``keys_file``, else from the server, else from the cache.

        Never raises: what went wrong is kept in :attr:`error` (and logged), and a credential
        check then says it.

        Raises:
            CredentialError: ``keys_file`` is given but unusable (a setting to fix).
        """
        if self.keys_file is not None:
            self.verifier = self._read(self.keys_file)
            return
        if not self._fetch() and self.cache is not None and self.cache.is_file():
            try:
                self.verifier = self._read(self.cache)
                log.info("server unreachable; job credentials are checked with %s", self.cache)
            except CredentialError as exc:
                log.warning("cached key set %s unusable: %s", self.cache, exc)

    def _read(self, path: Path) -> CredentialVerifier:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CredentialError(
                f"{path}: cannot read the server's public key set ({exc}); write the answer "
                f"of GET {KEYS_PATH} into it"
            ) from None
        try:
            return CredentialVerifier.from_jwks(doc)
        except CredentialError as exc:
            raise CredentialError(f"{path}: {exc}") from None

    def _fetch(self) -> bool:
        """Fetch the set from the server (rate-limited); True when the keys were replaced."""
        if self.server is None:
            return False
        now = time.monotonic()
        with self._lock:
            if self._fetched_at is not None and now - self._fetched_at < REFRESH_MIN_S:
                return False
            self._fetched_at = now
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            resp = httpx.get(
                self.server + KEYS_PATH,
                headers=headers,
                timeout=FETCH_TIMEOUT_S,
                verify=self.verify,
            )
            resp.raise_for_status()
            doc = resp.json()
            verifier = CredentialVerifier.from_jwks(doc)
        except (httpx.HTTPError, ValueError) as exc:
            self.error = (
                f"cannot fetch the server's public keys from {redact_url(self.server)}"
                f"{KEYS_PATH}: {type(exc).__name__}"
                + (f" {exc.response.status_code}" if isinstance(exc, httpx.HTTPStatusError) else "")
            )
            log.warning("%s; job credentials are checked with the keys held", self.error)
            return False
        self.verifier, self.error = verifier, None
        if self.cache is not None:
            try:
                self.cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.cache.with_suffix(".tmp")
                tmp.write_text(json.dumps(doc))
                os.replace(tmp, self.cache)
            except OSError as exc:
                log.warning("cannot cache the server's public keys in %s: %s", self.cache, exc)
        return True

    def verify_job(self, credential: str) -> JobCredential:
        """Check a job credential; an unknown signing key makes the agent ask the server
        again (at most every :data:`REFRESH_MIN_S` s).

        A credential that checked out is remembered until it expires (ranks send the same one
        with every call, several times a second): only the first call pays for the signature.

        Raises:
            CredentialError: the credential is refused (the message says why).
        """
        hit = self._checked.get(credential)
        if hit is not None and hit.expires_at > time.time():
            if hit.job_id not in self._manifest_keys:
                with self._lock:
                    self._manifest_keys[hit.job_id] = hit.manifest_key
            return hit
        try:
            checked = self.verifier.verify_job(credential)
        except CredentialError:
            if not (self.keys_file is None and self._fetch()):
                if not self.verifier.keys and self.error:
                    raise CredentialError(
                        f"this agent cannot check job credentials yet: {self.error}"
                    ) from None
                raise
            checked = self.verifier.verify_job(credential)
        with self._lock:
            if len(self._checked) >= CHECKED_KEPT:
                self._checked.clear()
            self._checked[credential] = checked
            if len(self._manifest_keys) >= CHECKED_KEPT:
                self._manifest_keys.clear()
            self._manifest_keys[checked.job_id] = checked.manifest_key
        return checked

    def manifest_key(self, job_id: str) -> bytes | None:
        """The manifest key of a job whose credential this agent has checked (None: none yet).

        Lets the tier worker check a step's commit markers and manifests before it acts on
        them (docs/security.md "The memory folder")."""
        with self._lock:
            return self._manifest_keys.get(job_id)
