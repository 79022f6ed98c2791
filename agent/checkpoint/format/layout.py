"""Where checkpoint files live, in every tier (pure path logic, no I/O).

A node's memory tier is one folder (``--memory-dir``, default ``/dev/shm/tierwatch/<node>``)
shared by the node's agent and its training ranks::

    <memory-dir>/agent.json                           the agent's identity (written by the agent)
    <memory-dir>/jobs/<job_id>/job.json               world_size, rank→node layout, signature
    <memory-dir>/jobs/<job_id>/progress-<r>.json      rank r's newest completed step
    <memory-dir>/jobs/<job_id>/step-<N>/              one DCP step (this node's ranks' files)
        .metadata                                     only on the node of rank 0
        __<r>_0.distcp                                rank r's shard (local ranks only)
        manifest-<r>.json                             rank r's files with size and checksum
        commit-<r>.json                               written after every rank's manifest
        .tier-<r>.json                                the agent's progress on rank r's files
    <memory-dir>/jobs/<job_id>/.tmp-step-<N>-<r>/     rank r's write in progress (torn if left)
    <memory-dir>/jobs/<job_id>/timeline.json          rollbacks served (written by the ranks)
    <state-dir>/requests/jobs/<job_id>/restore-requests/   operator restore requests (the agent's
                                                       own folder: same layout, another root)
    <memory-dir>/replicas/<src_node>/<job_id>/step-<N>/   peer replicas held for src_node
    <memory-dir>/restore/<job_id>/step-<N>/           files staged for a restore

The persistent tier (an fsspec URL) holds ``<url>/<job_id>/step-<N>/`` with every rank's
shards and manifests, and ``.metadata`` written last: a plain DCP directory.
"""

from __future__ import annotations

import re
from pathlib import Path

TIERS: tuple[str, ...] = ("memory", "peer", "persistent")
METADATA = ".metadata"
JOB_FILE = "job.json"
TIMELINE_FILE = "timeline.json"
REQUESTS_DIR = "restore-requests"
AGENT_FILE = "agent.json"

JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_JOB_ID_RE = re.compile(JOB_ID_PATTERN)
_STEP_RE = re.compile(r"^step-(\d{1,18})$")
_SHARD_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_MANIFEST_RE = re.compile(r"^manifest-(\d+)\.json$")
_COMMIT_RE = re.compile(r"^commit-(\d+)\.json$")
_TIER_PROGRESS_RE = re.compile(r"^\.tier-(\d+)\.json$")


class LayoutError(ValueError):
    """A job id, step or file name that tierwatch refuses (the message says what is allowed)."""


def check_job_id(job_id: str) -> str:
    """Return ``job_id`` when it is a safe folder name.

    Raises:
        LayoutError: not 1-128 characters of letters, digits, ``.``, ``_``, ``-`` starting with a
            letter or digit (so it can never escape its folder).
    """
    if not isinstance(job_id, str) or not _JOB_ID_RE.fullmatch(job_id):
        raise LayoutError(
            f"job_id {job_id!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return job_id


def check_step(step: int) -> int:
    """Return ``step`` when it is a non-negative integer.

    Raises:
        LayoutError: negative, not an int, or beyond 10^18.
    """
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**18:
        raise LayoutError(f"step must be an integer in 0..10^18, not {step!r}")
    return step


def step_dirname(step: int) -> str:
    """``step-<N>`` (unpadded, as DCP users expect)."""
    return f"step-{check_step(step)}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a ``step-<N>`` folder name; None for any other name."""
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def shard_name(rank: int) -> str:
    """DCP's file name for rank ``rank``'s shard with one file per rank (``__<r>_0.distcp``)."""
    return f"__{rank}_0.distcp"


def manifest_name(rank: int) -> str:
    """``manifest-<r>.json``."""
    return f"manifest-{rank}.json"


def commit_name(rank: int) -> str:
    """``commit-<r>.json``."""
    return f"commit-{rank}.json"


def progress_name(rank: int) -> str:
    """``progress-<r>.json``: rank r's newest completed step, in the job folder (written by
    the rank; restore reads it for "steps lost")."""
    return f"progress-{rank}.json"


def tier_progress_name(rank: int) -> str:
    """``.tier-<r>.json``: the agent's progress on rank r's files of one step (peer targets
    done, persistent upload done), in the step folder."""
    return f".tier-{rank}.json"


def parse_tier_progress_name(name: str) -> int | None:
    """The rank of a ``.tier-<r>.json`` file name; None otherwise."""
    m = _TIER_PROGRESS_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def parse_manifest_name(name: str) -> int | None:
    """The rank of a ``manifest-<r>.json`` file name; None otherwise."""
    m = _MANIFEST_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def parse_commit_name(name: str) -> int | None:
    """The rank of a ``commit-<r>.json`` file name; None otherwise."""
    m = _COMMIT_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def rank_of_file(name: str) -> int | None:
    """The rank whose file ``name`` is: shards ``__<r>_<i>.distcp``, ``manifest-<r>.json``,
    ``commit-<r>.json``; ``.metadata`` is rank 0's (its coordinator writes it); None for
    other names."""
    if name == METADATA:
        return 0
    for pattern in (_SHARD_RE, _MANIFEST_RE, _COMMIT_RE):
        m = pattern.fullmatch(name)
        if m:
            return int(m.group(1))
    return None


def check_file_name(name: str) -> str:
    """Return ``name`` when it is a file a step may hold.

    Allowed: ``.metadata``, ``__<r>_<i>.distcp``, ``manifest-<r>.json``, ``commit-<r>.json``.

    Raises:
        LayoutError: any other name (in particular anything with a path separator).
    """
    if (
        name == METADATA
        or _SHARD_RE.fullmatch(name)
        or _MANIFEST_RE.fullmatch(name)
        or _COMMIT_RE.fullmatch(name)
    ):
        return name
    raise LayoutError(
        f"file name {name!r} is not part of a checkpoint step (.metadata, __<r>_<i>.distcp, "
        "manifest-<r>.json or commit-<r>.json)"
    )


def check_node_name(node: str) -> str:
    """Return ``node`` when it is a safe folder name (same rule as a job id).

    Raises:
        LayoutError: otherwise.
    """
    if not isinstance(node, str) or not _JOB_ID_RE.fullmatch(node):
        raise LayoutError(f"node name {node!r} is not a valid node name")
    return node


class MemoryLayout:
    """Paths inside one node's memory-tier folder.

    Args:
        root: The node's memory folder (``--memory-dir``).
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    @property
    def agent_file(self) -> Path:
        return self.root / AGENT_FILE

    @property
    def jobs_dir(self) -> Path:
        return self.root / "jobs"

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_dir / check_job_id(job_id)

    def job_file(self, job_id: str) -> Path:
        return self.job_dir(job_id) / JOB_FILE

    def timeline_file(self, job_id: str) -> Path:
        """``jobs/<job>/timeline.json``: the rollbacks the job's ranks served."""
        return self.job_dir(job_id) / TIMELINE_FILE

    def progress_file(self, job_id: str, rank: int) -> Path:
        """``jobs/<job>/progress-<r>.json``: rank r's newest completed step."""
        return self.job_dir(job_id) / progress_name(rank)

    def requests_dir(self, job_id: str) -> Path:
        """``jobs/<job>/restore-requests/``: restore requests the agent keeps for the ranks."""
        return self.job_dir(job_id) / REQUESTS_DIR

    def step_dir(self, job_id: str, step: int) -> Path:
        return self.job_dir(job_id) / step_dirname(step)

    def tmp_step_dir(self, job_id: str, step: int, rank: int) -> Path:
        return self.job_dir(job_id) / f".tmp-step-{check_step(step)}-{rank}"

    @property
    def replicas_dir(self) -> Path:
        return self.root / "replicas"

    def replica_job_dir(self, src_node: str, job_id: str) -> Path:
        return self.replicas_dir / check_node_name(src_node) / check_job_id(job_id)

    def replica_step_dir(self, src_node: str, job_id: str, step: int) -> Path:
        return self.replica_job_dir(src_node, job_id) / step_dirname(step)

    def restore_dir(self, job_id: str, step: int) -> Path:
        return self.root / "restore" / check_job_id(job_id) / step_dirname(step)

    def steps(self, job_id: str) -> list[int]:
        """Steps with a folder in this node's memory tier for ``job_id``, ascending."""
        d = self.job_dir(job_id)
        if not d.is_dir():
            return []
        return sorted(s for p in d.iterdir() if (s := parse_step_dirname(p.name)) is not None)

    def jobs(self) -> list[str]:
        """Job ids with a folder in this node's memory tier, sorted."""
        if not self.jobs_dir.is_dir():
            return []
        return sorted(
            p.name for p in self.jobs_dir.iterdir() if p.is_dir() and _JOB_ID_RE.fullmatch(p.name)
        )


def persistent_step_path(base_url: str, job_id: str, step: int) -> str:
    """``<base_url>/<job_id>/step-<N>`` (no trailing slash)."""
    return f"{base_url.rstrip('/')}/{check_job_id(job_id)}/{step_dirname(step)}"
