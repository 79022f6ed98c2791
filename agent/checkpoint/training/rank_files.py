"""One rank's files in its node's memory tier (no torch).

A rank owns, in ``jobs/<job>/step-<N>/``, its shards (``__<r>_<i>.distcp``), its manifest,
its commit marker, the agent's progress on them (``.tier-<r>.json``) and, for rank 0,
``.metadata``; and ``jobs/<job>/.tmp-step-<N>-<r>/`` while it writes. Other local ranks'
files in the same folders are never touched. Files are removed manifest and commit marker
first, so a half-removed step never looks complete.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

from tierwatch.agent.checkpoint.format.layout import (
    METADATA,
    MemoryLayout,
    commit_name,
    manifest_name,
    tier_progress_name,
)
from tierwatch.agent.checkpoint.format.manifest import Manifest, ManifestError, load_manifest


class RankFiles:
    """Rank ``rank``'s files of job ``job_id`` in one node's memory folder.

    Args:
        layout: The node's memory folder.
        job_id: The job (a checked job id).
        rank: This rank.
    """

    def __init__(self, layout: MemoryLayout, job_id: str, rank: int) -> None:
        self.layout = layout
        self.job_id = job_id
        self.rank = rank
        self.job_dir = layout.job_dir(job_id)

    def clean_torn_writes(self) -> None:
        """Remove this rank's leftover temporary step folders (a crash mid-write)."""
        suffix = f"-{self.rank}"
        for p in self.job_dir.glob(".tmp-step-*"):
            if p.name.endswith(suffix):
                shutil.rmtree(p, ignore_errors=True)

    def names(self, step_dir: Path) -> list[str]:
        """This rank's file names present in ``step_dir``."""
        names = [p.name for p in step_dir.glob(f"__{self.rank}_*.distcp")]
        names += [manifest_name(self.rank), commit_name(self.rank), tier_progress_name(self.rank)]
        if self.rank == 0:
            names.append(METADATA)
        return [n for n in names if (step_dir / n).exists()]

    def remove_stale(self, step_dir: Path) -> None:
        """Remove this rank's files from ``step_dir`` (an earlier run of the same step)."""
        for n in sorted(
            self.names(step_dir), key=lambda n: 0 if n.startswith(("manifest", "commit")) else 1
        ):
            with contextlib.suppress(FileNotFoundError):
                (step_dir / n).unlink()

    def remove(self, step: int) -> bool:
        """Delete this rank's files of ``step`` (manifest first), then the folder if no other
        local rank's files remain.

        Returns:
            Whether any file of this rank existed.
        """
        d = self.layout.step_dir(self.job_id, step)
        if not d.is_dir():
            return False
        names = self.names(d)
        self.remove_stale(d)
        with contextlib.suppress(OSError):
            d.rmdir()
        return bool(names)

    def pending_upload(self, steps: list[int]) -> int | None:
        """The newest step of ``steps`` marked persist in this rank's commit marker whose
        upload this node's agent has not finished (``.tier-<r>.json``), or None."""
        for step in sorted(steps, reverse=True):
            d = self.layout.step_dir(self.job_id, step)
            try:
                marker = json.loads((d / commit_name(self.rank)).read_text())
            except (OSError, ValueError):
                continue
            if not marker.get("persist"):
                continue
            try:
                progress = json.loads((d / tier_progress_name(self.rank)).read_text())
            except (OSError, ValueError):
                progress = {}
            done = (progress.get("persistent") or {}).get("uploaded")
            return None if done else step
        return None

    def manifests(self) -> Iterator[Manifest]:
        """This rank's manifests in the job's memory folder that parse, newest step first
        (read one by one as the caller iterates)."""
        for step in sorted(self.layout.steps(self.job_id), reverse=True):
            path = self.layout.step_dir(self.job_id, step) / manifest_name(self.rank)
            if not path.is_file():
                continue
            try:
                yield load_manifest(path)
            except ManifestError:
                continue
