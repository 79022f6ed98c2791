"""Verify a step before any byte of it is deserialised (no torch).

DCP reads ``.metadata`` with pickle and non-tensor values with ``torch.load``; both run code
that the bytes name. So a restore checks, on the rank itself and before DCP opens a file:

1. every rank's manifest of the chosen step carries a ``mac`` that the job's manifest key
   proves (:func:`~tierwatch.agent.checkpoint.format.manifest.mac_problem`): the manifest was
   written by a rank of this job and not changed since;
2. every staged file this rank reads (``.metadata`` first, then its shards) has the size and
   SHA-256 its signed manifest lists, read through one ``O_NOFOLLOW`` descriptor in chunks.

Without a key (a checkpointer built without a job credential: memory tier only, tests) there
is nothing to check a ``mac`` against: nothing is refused for lacking one, and one WARNING
says so; SHA-256 digests that a manifest lists are still checked. With a key, an unsigned or
badly signed manifest, or a file without a digest, fails the step. A step that fails is
skipped by the restore (docs/security.md "Integrity of restored steps").
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierwatch.agent.checkpoint.format.agreement import StepView
from tierwatch.agent.checkpoint.format.manifest import mac_problem, sha256_stream
from tierwatch.agent.fsutil import UnsafePathError, open_regular

log = logging.getLogger(__name__)

#: Most files hashed at once (hashlib releases the GIL on large updates; about 0.85 s per GiB
#: per thread on one core with SHA extensions, docs/security.md).
MAX_HASH_THREADS = 8


class StepVerifier:
    """Checks steps against the job's manifest key.

    Args:
        key: The job's manifest key (``manifest_key_of(credential)``), or None.
        rank: This rank (for the log).

    Attributes:
        seconds: Wall time spent hashing files so far (for the restore report).
    """

    def __init__(self, key: bytes | None, rank: int = 0) -> None:
        self.key = key
        self.rank = rank
        self.seconds = 0.0
        self._warned = False

    def manifests_problem(self, view: StepView) -> str | None:
        """Why the manifests of ``view`` are not this job's (None: every one is signed with
        the key, or there is no key). Names the step, the manifest and "signature"."""
        if self.key is None:
            if not self._warned:
                self._warned = True
                log.warning(
                    "rank %d: no job credential, so restored steps are not checked for a "
                    "signature (only SHA-256 digests a manifest lists are checked)",
                    self.rank,
                )
            return None
        for rank in sorted(view.manifests):
            problem = mac_problem(view.manifests[rank], self.key)
            if problem:
                return problem
        return None

    def files_problem(self, view: StepView, staged_dir: Path, names: Iterable[str]) -> str | None:
        """Why a staged file of ``names`` is not the one its manifest lists (None: every one
        has the listed size and SHA-256). Names the step, the file and "digest"."""
        entries = {f.name: (m, f) for m in view.manifests.values() for f in m.files}
        todo = []
        for name in names:
            where = f"step {view.step}: {name}"
            if name not in entries:
                return f"{where}: listed by no manifest (no digest to check it against)"
            manifest, entry = entries[name]
            if entry.sha256:
                todo.append(name)
            elif self.key is not None:
                return f"{where}: manifest-{manifest.rank}.json lists no SHA-256 digest"

        def check(name: str) -> str | None:
            entry = entries[name][1]
            where = f"step {view.step}: {name}"
            try:
                with open_regular(staged_dir / name) as f:
                    size, digest = sha256_stream(f)
            except (UnsafePathError, OSError) as exc:
                return f"{where}: cannot be read to check its digest ({exc})"
            if size != entry.size or not hmac.compare_digest(digest, entry.sha256):
                return (
                    f"{where}: SHA-256 digest {digest[:16]}… ({size} bytes) does not match "
                    f"the manifest's {entry.sha256[:16]}… ({entry.size} bytes)"
                )
            return None

        t0 = time.monotonic()
        try:
            threads = min(MAX_HASH_THREADS, len(todo), os.cpu_count() or 1)
            if threads <= 1:
                problems = [check(n) for n in todo]
            else:
                with ThreadPoolExecutor(threads, thread_name_prefix="tierwatch-verify") as pool:
                    problems = list(pool.map(check, todo))
        finally:
            self.seconds += time.monotonic() - t0
        return next((p for p in problems if p), None)
