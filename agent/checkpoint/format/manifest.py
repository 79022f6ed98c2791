"""Per-rank manifests, commit markers and checksums (no torch).

A manifest (``manifest-<r>.json``) lists every file rank ``r`` wrote for one step, with its
size (bytes) and xxh3-64 checksum; rank 0's manifest also lists ``.metadata``. A commit marker
(``commit-<r>.json``) records what rank 0 decided once every rank's manifest was written: that
the step is committed, whether it goes to the persistent tier, and which steps each tier keeps.

A step *exists* for restore only when manifests of all ``world_size`` ranks are present, all
carry one save id, and every file they list has the listed size and checksum
(:func:`missing_ranks`, :func:`verify_file`).

Save identity: every ``save()`` call is one *save*, named by the id rank 0 makes
(:func:`new_save_id`) and hands to every rank; each rank's manifest and commit marker carry
it (``save_id``). A step number saved twice (a restart from an older step, a rollback) is two
saves, and their files never make one step. A manifest or marker written before save ids
existed has ``save_id`` ``""``: all of them count as one legacy save (:data:`LEGACY_SAVE_ID`),
so a step written wholly by an older version stays complete, and one that mixes legacy and
new manifests does not (docs/checkpointing.md "Save identity").

Integrity (docs/security.md "Integrity of restored steps"): every file entry also carries the
file's SHA-256 (``sha256``, computed in the same read as its xxh3-64; xxh3 finds torn copies,
it does not resist a forger), and a manifest written with the job's manifest key
(:func:`tierwatch.agent.credentials.manifest_key_of`) carries ``mac``: HMAC-SHA256 over its
canonical JSON without ``mac`` (:func:`canonical_bytes`). A restore checks both before any
byte of the step is unpickled (:mod:`tierwatch.agent.checkpoint.training.verify`). Both
fields are ``""`` in a manifest written before them, or (``mac``) without a key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, BinaryIO

import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tierwatch.agent.checkpoint.format.layout import METADATA, check_file_name
from tierwatch.agent.fsutil import UnsafePathError, open_regular

CHUNK = 4 * 1024 * 1024
CHECKSUM_ALGO = "xxh3_64"
LEGACY_SAVE_ID = ""
SAVE_ID_PATTERN = r"^([0-9a-f]{32})?$"
SHA256_PATTERN = r"^([0-9a-f]{64})?$"
MAC_ALGO = "hmac-sha256"
COMMIT_MAC_PREFIX = b"tierwatch commit marker\n"
COMMIT_PREFIX = "commit-"


def new_save_id(now_ms: int | None = None) -> str:
    """A new save id: 32 lowercase hex digits (128 bits), time-ordered.

    The first 12 digits are rank 0's clock in milliseconds since the Unix epoch (48 bits),
    the other 20 are random (80 bits, ``os.urandom``), in the manner of UUIDv7 (RFC 9562
    §5.7): ids of one job sort by when rank 0 made them, and two saves never share one.

    Args:
        now_ms: The time to encode (ms since the epoch); default: ``time.time_ns()``.
    """
    ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    return f"{ms & (2**48 - 1):012x}{os.urandom(10).hex()}"


class ManifestError(ValueError):
    """A manifest or commit marker that cannot be read or does not match its step."""


class FileEntry(BaseModel):
    """One file of a step: name, size in bytes, xxh3-64 hex digest, SHA-256 hex digest
    (``""``: written before digests)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    size: Annotated[int, Field(ge=0)]
    xxh3: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
    sha256: Annotated[str, Field(pattern=SHA256_PATTERN)] = ""


class Manifest(BaseModel):
    """What one rank wrote for one step.

    Attributes:
        job_id, step, rank, world_size: the checkpoint identity.
        node: the node whose memory tier the rank wrote to.
        files: the rank's files (rank 0's include ``.metadata``).
        signature: digest of the saved state's keys and shapes (see ``TieredCheckpointer``).
        created_at: UTC ISO time.
        fences: the rollbacks in this step's history, ``[[request_id, step], ...]``: request
            ``request_id`` rolled the job back to ``step`` (see :mod:`.rollback`); empty for a
            job never rolled back.
        save_id: the save this manifest belongs to (:func:`new_save_id`, the same on every
            rank of one ``save()``); ``""`` for a manifest written before save ids (one
            legacy save).
        mac: HMAC-SHA256 (hex) with the job's manifest key over :func:`canonical_bytes`;
            ``""``: unsigned (written without a key, or before signing existed).
    """

    model_config = ConfigDict(extra="forbid")

    version: int = 1
    job_id: str
    step: Annotated[int, Field(ge=0)]
    rank: Annotated[int, Field(ge=0)]
    world_size: Annotated[int, Field(ge=1)]
    node: str
    files: list[FileEntry]
    signature: str = ""
    checksum: str = CHECKSUM_ALGO
    created_at: str = ""
    fences: list[tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=0)]]] = []
    save_id: Annotated[str, Field(pattern=SAVE_ID_PATTERN)] = LEGACY_SAVE_ID
    mac: Annotated[str, Field(pattern=SHA256_PATTERN)] = ""

    @property
    def save_key(self) -> tuple[int, str]:
        """``(timeline, save_id)``: orders two saves of one step number, the later one
        greater (a newer timeline first, then rank 0's clock in the id; legacy lowest)."""
        return (self.timeline, self.save_id)

    @property
    def timeline(self) -> int:
        """The newest rollback request in this step's history (0: never rolled back)."""
        return max((rid for rid, _ in self.fences), default=0)

    def total_bytes(self) -> int:
        """Sum of the listed file sizes (bytes)."""
        return sum(f.size for f in self.files)

    def has_metadata(self) -> bool:
        """Whether this manifest lists the step's ``.metadata``."""
        return any(f.name == METADATA for f in self.files)


class CommitMarker(BaseModel):
    """Rank 0's decision for one step, written by every rank once all manifests exist.

    Attributes:
        step, rank, world_size: identity.
        persist: whether this step goes to the persistent tier.
        retain: steps each tier keeps after this commit (``{"memory": [...], "peer": [...],
            "persistent": [...]}``), decided by rank 0 so tiers never hold mismatched steps.
        layout: node of every rank (index = rank).
        peer_urls: agent URL of every node in ``layout``.
        save_id: the save decided on (the same as the rank's manifest; ``""``: legacy).
        mac: HMAC-SHA256 (hex) with the job's manifest key over :func:`canonical_bytes`
            (``""``: unsigned). The agent replicates, persists and applies ``retain`` only
            for a marker whose ``mac`` it can check (docs/security.md "The memory folder").
    """

    model_config = ConfigDict(extra="forbid")

    version: int = 1
    job_id: str
    step: Annotated[int, Field(ge=0)]
    rank: Annotated[int, Field(ge=0)]
    world_size: Annotated[int, Field(ge=1)]
    persist: bool
    retain: dict[str, list[int]]
    layout: list[str]
    peer_urls: dict[str, str] = {}
    created_at: str = ""
    save_id: Annotated[str, Field(pattern=SAVE_ID_PATTERN)] = LEGACY_SAVE_ID
    mac: Annotated[str, Field(pattern=SHA256_PATTERN)] = ""


def xxh3_file(path: Path | str | BinaryIO) -> tuple[int, str]:
    """Size (bytes) and xxh3-64 hex digest of a file.

    Args:
        path: The file's path, or a binary file open for reading (read from where it
            stands to its end; the caller seeks and closes it).

    Raises:
        OSError: the file cannot be read.
    """
    h = xxhash.xxh3_64()
    size = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    if not isinstance(path, (str, Path)):
        while n := path.readinto(buf):  # type: ignore[attr-defined]
            h.update(view[:n])
            size += n
        return size, h.hexdigest()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


class FileDigest:
    """A file's manifest digests, fed its bytes in order: size, xxh3-64 and SHA-256."""

    def __init__(self) -> None:
        self.size = 0
        self._x = xxhash.xxh3_64()
        self._h = hashlib.sha256()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._x.update(data)
        self._h.update(data)
        self.size += len(data)

    def result(self) -> tuple[int, str, str]:
        """(size in bytes, xxh3-64 hex, SHA-256 hex) of the bytes so far."""
        return self.size, self._x.hexdigest(), self._h.hexdigest()


def digest_file(path: Path | str) -> tuple[int, str, str]:
    """Size (bytes), xxh3-64 and SHA-256 hex digests of a file, in one read.

    Raises:
        OSError: the file cannot be read.
    """
    d = FileDigest()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            d.update(view[:n])
    return d.result()


def sha256_stream(stream: BinaryIO) -> tuple[int, str]:
    """Size and SHA-256 hex digest of what remains in a binary stream (read in chunks)."""
    h = hashlib.sha256()
    size = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while n := stream.readinto(buf):  # type: ignore[attr-defined]
        h.update(view[:n])
        size += n
    return size, h.hexdigest()


def canonical_bytes(document: Manifest | CommitMarker) -> bytes:
    """What a manifest's or commit marker's ``mac`` covers: its JSON (every field, defaults
    included) without ``mac``, keys sorted, no whitespace (``json.dumps(sort_keys=True,
    separators=(",", ":"))``), UTF-8; a commit marker's is prefixed with ``COMMIT_MAC_PREFIX``
    so that neither can pass for the other."""
    body = document.model_dump(mode="json", exclude={"mac"})
    data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return COMMIT_MAC_PREFIX + data if isinstance(document, CommitMarker) else data


def manifest_mac(document: Manifest | CommitMarker, key: bytes) -> str:
    """HMAC-SHA256 (hex) of :func:`canonical_bytes` with the job's manifest ``key``."""
    return hmac.new(key, canonical_bytes(document), hashlib.sha256).hexdigest()


def sign_manifest(manifest: Manifest, key: bytes) -> Manifest:
    """``manifest`` with its ``mac`` set for ``key``."""
    return manifest.model_copy(update={"mac": manifest_mac(manifest, key)})


def sign_commit(marker: CommitMarker, key: bytes) -> CommitMarker:
    """``marker`` with its ``mac`` set for ``key`` (the job's manifest key)."""
    return marker.model_copy(update={"mac": manifest_mac(marker, key)})


def mac_problem(document: Manifest | CommitMarker, key: bytes) -> str | None:
    """Why a manifest's or commit marker's ``mac`` does not prove it was written with ``key``
    (None: it does).

    The message names the file and step and says "signature".
    """
    if isinstance(document, CommitMarker):
        where = f"step {document.step}: {COMMIT_PREFIX}{document.rank}.json"
    else:
        where = f"step {document.step}: manifest-{document.rank}.json"
    if not document.mac:
        return f"{where} is unsigned (no signature with the job's manifest key)"
    if not hmac.compare_digest(document.mac, manifest_mac(document, key)):
        return (
            f"{where}: signature does not match the job's manifest key (written by another "
            "job or a local user without the job's credential, or changed after it was "
            "written)"
        )
    return None


def xxh3_stream(stream: BinaryIO) -> tuple[int, str]:
    """Size and xxh3-64 hex digest of what remains in a binary stream."""
    h = xxhash.xxh3_64()
    size = 0
    while chunk := stream.read(CHUNK):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def verify_file(path: Path | str, entry: FileEntry) -> str | None:
    """Check one file against its manifest entry.

    Returns:
        None when it matches; otherwise what is wrong (missing, size, checksum), naming the
        file.
    """
    try:
        size, digest = xxh3_file(path)
    except FileNotFoundError:
        return f"{entry.name}: missing"
    except OSError as exc:
        return f"{entry.name}: unreadable ({exc})"
    if size != entry.size:
        return f"{entry.name}: size {size} bytes, manifest says {entry.size}"
    if digest != entry.xxh3:
        return f"{entry.name}: checksum {digest} does not match the manifest's {entry.xxh3}"
    return None


def read_manifest(data: bytes | str, *, where: str = "manifest") -> Manifest:
    """Parse a manifest and check its file names.

    Raises:
        ManifestError: not JSON, not a manifest, or a file name outside a step's names.
    """
    try:
        manifest = Manifest.model_validate_json(data)
        for f in manifest.files:
            check_file_name(f.name)
    except (ValidationError, ValueError) as exc:
        raise ManifestError(f"{where}: not a valid manifest ({exc})") from None
    return manifest


def read_commit(data: bytes | str, *, where: str = "commit marker") -> CommitMarker:
    """Parse a commit marker.

    Raises:
        ManifestError: not JSON or not a commit marker.
    """
    try:
        return CommitMarker.model_validate_json(data)
    except ValidationError as exc:
        raise ManifestError(f"{where}: not a valid commit marker ({exc})") from None


def _read_regular(path: Path) -> bytes:
    """The bytes of ``path``, a regular file opened without following a symbolic link (so a
    link planted in a step folder never makes another file's content part of an error
    message or event).

    Raises:
        ManifestError: a link, not a regular file, or unreadable (names the path).
    """
    try:
        with open_regular(path) as f:
            return f.read()
    except UnsafePathError as exc:
        raise ManifestError(str(exc)) from None
    except OSError as exc:
        raise ManifestError(f"{path}: unreadable ({exc})") from None


def load_manifest(path: Path) -> Manifest:
    """Read and parse ``path`` (a regular file, never through a link).

    Raises:
        ManifestError: unreadable, a link or invalid (the message names the path).
    """
    return read_manifest(_read_regular(path), where=str(path))


def load_commit(path: Path) -> CommitMarker:
    """Read and parse a commit marker (a regular file, never through a link).

    Raises:
        ManifestError: unreadable, a link or invalid.
    """
    return read_commit(_read_regular(path), where=str(path))


def missing_ranks(manifests: Iterable[Manifest], world_size: int) -> list[int]:
    """Ranks in ``0..world_size-1`` without a manifest among ``manifests``."""
    have = {m.rank for m in manifests if m.world_size == world_size}
    return [r for r in range(world_size) if r not in have]


def make_manifest(
    *,
    job_id: str,
    step: int,
    rank: int,
    world_size: int,
    node: str,
    directory: Path,
    names: Iterable[str],
    signature: str,
    created_at: str,
    fences: Iterable[tuple[int, int]] = (),
    save_id: str = LEGACY_SAVE_ID,
    key: bytes | None = None,
    known: Mapping[str, tuple[int, str, str]] | None = None,
) -> Manifest:
    """Build rank ``rank``'s manifest from its files in ``directory``.

    ``known``: name -> (size, xxh3-64, SHA-256) computed while the file was written
    (:class:`~tierwatch.agent.checkpoint.training.digesting_writer.DigestingWriter`); a file
    not in it, or whose size on disk differs, is read back once for both digests.
    ``save_id`` is the save's id (rank 0's :func:`new_save_id`); ``""`` writes a legacy
    manifest. ``key``: the job's manifest key, which signs it (None: unsigned).

    Raises:
        OSError: a file cannot be read.
    """
    files = []
    for name in sorted(names):
        have = (known or {}).get(name)
        if have is not None and (directory / name).stat().st_size == have[0]:
            size, digest, sha = have
        else:
            size, digest, sha = digest_file(directory / name)
        files.append(FileEntry(name=name, size=size, xxh3=digest, sha256=sha))
    manifest = Manifest(
        job_id=job_id,
        step=step,
        rank=rank,
        world_size=world_size,
        node=node,
        files=files,
        signature=signature,
        created_at=created_at,
        fences=sorted(fences),
        save_id=save_id,
    )
    return manifest if key is None else sign_manifest(manifest, key)
