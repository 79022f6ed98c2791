"""Which step a restore can load, and where each file comes from (pure logic, no torch).

Input: what every rank's agent said it can supply (``GET /v1/ckpt/jobs/{job}/available``),
gathered from all ranks. Every rank runs the same functions on the same gathered data, so all
ranks reach the same answer without another round trip.

A step is *restorable* when it is complete across all sources
(:func:`~tierwatch.agent.checkpoint.format.completeness.step_problem`, the rule
``tierwatch-agent ckpt`` applies too): a manifest for every rank ``0..world_size-1``, exactly
one of them listing ``.metadata``, all agreeing on the world size, the state signature and
the timeline. Files are verified later, while they are staged; a step whose staging fails on
any rank is excluded and the ranks choose again.

Rollbacks (:mod:`.rollback`): after request ``X`` rolled the job back to step ``S``, the steps
above ``S`` saved before the rollback are a diverged future. Every manifest saved after it
lists the fence ``(X, S)`` (its *timeline* is ``X``), and a manifest of timeline ``t`` with
step ``N`` is **dead** when some known fence ``(X, S)`` has ``X > t`` and ``N > S``: it is
ignored as if it did not exist. Two copies of one (step, rank) that differ are a conflict
only within one timeline; across timelines the newer copy wins. A step whose ranks'
manifests come from different timelines is not restorable, so old and new files of a step
saved again after a rollback are never mixed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tierwatch.agent.checkpoint.format.completeness import step_problem
from tierwatch.agent.checkpoint.format.layout import METADATA
from tierwatch.agent.checkpoint.format.manifest import Manifest, ManifestError, read_manifest


@dataclass(frozen=True)
class Source:
    """One place a rank's files of one step can be read from.

    Attributes:
        tier: memory | peer | persistent.
        holder: the node that holds the copy ("persistent" for the persistent tier).
        url: the holder agent's URL (or the persistent step's fsspec URL).
        src: the node whose rank wrote the files.
    """

    tier: str
    holder: str
    url: str
    src: str

    def as_dict(self) -> dict[str, str]:
        return {"tier": self.tier, "holder": self.holder, "url": self.url, "src": self.src}


@dataclass
class StepView:
    """Everything known about one step: manifests per rank and their sources."""

    step: int
    manifests: dict[int, Manifest] = field(default_factory=dict)
    sources: dict[int, list[Source]] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)


Fence = tuple[int, int]


def is_dead(manifest: Manifest, fences: Iterable[Fence]) -> bool:
    """Whether ``manifest``'s step was rolled away: a fence ``(request_id, step)`` newer than
    the manifest's timeline rolled the job back to a step below it."""
    return any(rid > manifest.timeline and manifest.step > step for rid, step in fences)


def merge_available(
    answers: Iterable[Mapping[str, Any] | None],
    *,
    tier: str | None = None,
    fences: Iterable[Fence] = (),
) -> dict[int, StepView]:
    """Merge the ``available`` answers of all ranks' agents into one view per step.

    Args:
        answers: The agents' answers (None: an agent that could not be asked, skipped).
        tier: Keep only the entries of this tier (memory | peer | persistent); None: all.
        fences: Rollback fences known besides those the manifests list (the ranks'
            ``timeline.json``).

    Entries whose manifest does not parse are ignored, and so are dead ones (see the module
    notes; the fences are those given plus every fence any parsed manifest lists, of any
    tier). Two manifests of the same (step, rank) with different file checksums are a
    conflict, so the step is not restorable, unless they come from different timelines: the
    newer one is kept.
    """
    parsed: list[tuple[Mapping[str, Any], Manifest]] = []
    known_fences: set[Fence] = {(int(r), int(s)) for r, s in fences}
    for answer in answers:
        if not answer:
            continue
        for entry in answer.get("entries", []):
            try:
                manifest = (
                    entry["manifest"]
                    if isinstance(entry["manifest"], Manifest)
                    else read_manifest(_json(entry["manifest"]))
                )
            except (KeyError, ManifestError, TypeError, ValueError):
                continue
            known_fences.update(manifest.fences)
            parsed.append((entry, manifest))
    steps: dict[int, StepView] = {}
    for entry, manifest in parsed:
        if tier is not None and entry.get("tier") != tier:
            continue
        if is_dead(manifest, known_fences):
            continue
        view = steps.setdefault(manifest.step, StepView(manifest.step))
        rank = manifest.rank
        known = view.manifests.get(rank)
        if known is None:
            view.manifests[rank] = manifest
        elif _files(known) != _files(manifest) or known.world_size != manifest.world_size:
            if manifest.timeline > known.timeline:  # re-saved after a rollback: newer wins
                view.manifests[rank] = manifest
                view.sources[rank] = []
            elif manifest.timeline < known.timeline:
                continue
            else:
                view.conflicts.append(
                    f"rank {rank}: copies on {entry.get('holder')} and elsewhere differ"
                )
                continue
        source = Source(
            tier=str(entry.get("tier")),
            holder=str(entry.get("holder")),
            url=str(entry.get("url", "")),
            src=manifest.node,
        )
        if source not in view.sources.setdefault(rank, []):
            view.sources[rank].append(source)
    return steps


def _json(value: Any) -> str | bytes:
    if isinstance(value, str | bytes):
        return value
    import json

    return json.dumps(value)


def _files(m: Manifest) -> list[tuple[str, int, str]]:
    return sorted((f.name, f.size, f.xxh3) for f in m.files)


def restorable(view: StepView, world_size: int) -> str | None:
    """None when ``view`` is restorable at ``world_size``, else the reason it is not
    (:func:`~tierwatch.agent.checkpoint.format.completeness.step_problem` over every source's
    manifests)."""
    return step_problem(view.manifests, world_size, conflicts=view.conflicts)


def choose_step(
    views: Mapping[int, StepView],
    world_size: int,
    *,
    excluded: Iterable[int] = (),
    wanted: int | None = None,
) -> tuple[int | None, dict[int, str]]:
    """The newest restorable step (or ``wanted`` if it is restorable).

    Returns:
        ``(step or None, {step: why not restorable})`` for the steps that were not chosen.
    """
    skip = set(excluded)
    reasons: dict[int, str] = {}
    for step in sorted(views, reverse=True):
        if step in skip:
            reasons[step] = "excluded after a failed restore attempt"
            continue
        if wanted is not None and step != wanted:
            continue
        why = restorable(views[step], world_size)
        if why is None:
            return step, reasons
        reasons[step] = why
    return None, reasons


def restorable_steps(views: Mapping[int, StepView], world_size: int) -> list[int]:
    """All restorable steps, ascending."""
    return sorted(s for s, v in views.items() if restorable(v, world_size) is None)


def file_owner(view: StepView) -> dict[str, int]:
    """File name → the rank whose manifest lists it."""
    return {f.name: rank for rank, m in view.manifests.items() for f in m.files}


def ordered_sources(sources: Iterable[Source], *, node: str) -> list[Source]:
    """Sources ordered by cost for a reader on ``node``: own node's memory, own node's
    replicas, other nodes' memory, other nodes' replicas, persistent."""

    def cost(s: Source) -> tuple[int, str]:
        if s.tier == "persistent":
            return (4, s.holder)
        return ((0 if s.holder == node else 2) + (0 if s.tier == "memory" else 1), s.holder)

    return sorted(sources, key=cost)


def stage_request(view: StepView, names: Iterable[str], *, node: str) -> list[dict[str, Any]]:
    """The ``files`` list of a ``stage`` request for ``names`` of one step.

    Raises:
        KeyError: a name that no manifest of the step lists.
    """
    owner = file_owner(view)
    out = []
    for name in names:
        rank = owner[name]
        entry = next(f for f in view.manifests[rank].files if f.name == name)
        out.append(
            {
                "name": name,
                "size": entry.size,
                "xxh3": entry.xxh3,
                "sources": [
                    s.as_dict() for s in ordered_sources(view.sources.get(rank, []), node=node)
                ],
            }
        )
    return out


def all_file_names(view: StepView) -> list[str]:
    """Every data file of the step plus ``.metadata`` (manifests excluded)."""
    names = sorted(file_owner(view))
    return [METADATA, *[n for n in names if n != METADATA]] if METADATA in names else names
