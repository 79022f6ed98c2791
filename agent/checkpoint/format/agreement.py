"""Which step a restore can load, and where each file comes from (pure logic, no torch).

Input: what every rank's agent said it can supply (``GET /v1/ckpt/jobs/{job}/available``),
gathered from all ranks. Every rank runs the same functions on the same gathered data, so all
ranks reach the same answer without another round trip.

A step is *restorable* when it is complete across all sources
(:func:`~tierwatch.agent.checkpoint.format.completeness.step_problem`, the rule
``tierwatch-agent ckpt`` applies too): a manifest for every rank ``0..world_size-1``, exactly
one of them listing ``.metadata``, all agreeing on the world size, the state signature, the
timeline and the save. Files are verified later, while they are staged; a step whose staging
fails on any rank is excluded and the ranks choose again.

Rollbacks (:mod:`.rollback`): after request ``X`` rolled the job back to step ``S``, the steps
above ``S`` saved before the rollback are a diverged future. Every manifest saved after it
lists the fence ``(X, S)`` (its *timeline* is ``X``), and a manifest of timeline ``t`` with
step ``N`` is **dead** when some known fence ``(X, S)`` has ``X > t`` and ``N > S``: it is
ignored as if it did not exist.

Saves (docs/checkpointing.md "Save identity"): a step number saved more than once (after a
restart from an older step, or a rollback) has one set of manifests per save, told apart by
their ``save_id`` and ordered by :attr:`Manifest.save_key` (the newer timeline, then rank 0's
clock in the id; the legacy save ``""`` lowest). The manifests of one step are grouped by
save; the step's view is the newest save whose manifests are complete on their own, else
(none is) every rank's newest copy, which the completeness rule then refuses as a mix of
saves or timelines. So the ranks of two saves are never mixed, and an older save that is
complete somewhere (e.g. on the persistent tier, which keeps the first save of a step number)
stays restorable while the newer one is incomplete. Two copies of one (step, rank) of one save
that differ are a conflict: the step is not restorable.
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
    """Everything known about one step: manifests per rank (of one save, see the module
    notes) and their sources."""

    step: int
    manifests: dict[int, Manifest] = field(default_factory=dict)
    sources: dict[int, list[Source]] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)


Fence = tuple[int, int]


def is_dead(manifest: Manifest, fences: Iterable[Fence]) -> bool:
    """Whether ``manifest``'s step was rolled away: a fence ``(request_id, step)`` newer than
    the manifest's timeline rolled the job back to a step below it."""
    return any(rid > manifest.timeline and manifest.step > step for rid, step in fences)


def transfer_refusal(
    incoming: Manifest,
    present: Iterable[Manifest],
    *,
    committed_ranks: Iterable[int] = (),
    fences: Iterable[Fence] = (),
) -> str | None:
    """Why a tier must not take rank ``incoming.rank``'s files of ``incoming``'s step into a
    step folder that already holds ``present`` (docs/checkpointing.md "Save identity").

    A tier holds one save per step number. It refuses, first match wins:

    1. a dead save: a fence (given, or listed by a ``present`` manifest) rolled its timeline
       away (:func:`is_dead`): a late upload or replication from an abandoned timeline;
    2. a second save over a committed one: a ``present`` manifest of another save whose rank
       is committed in this tier (``committed_ranks``: the peer tier's ranks with a commit
       marker; on the persistent tier every rank once ``.metadata`` is there). Nothing is
       written under a committed ``.metadata``: the tier keeps the first save until its
       retention or a rollback removes the step;
    3. an older save over a newer one not committed yet (``save_key``: a late transfer from
       before a restart).

    A newer save over an uncommitted older one is taken (the older one never commits: the
    commit needs every rank's manifest of one save), and so is the same save again (a retry).

    Args:
        incoming: The manifest of the files about to be written.
        present: Manifests already in the step folder (any rank).
        committed_ranks: Ranks committed in this step folder.
        fences: Rollback fences known besides those ``present`` lists (the node's
            ``timeline.json``, other steps' manifests).

    Returns:
        None when the files may be written; otherwise why not, naming the step, the rank and
        the saves.
    """
    present = list(present)
    known = {(int(r), int(s)) for r, s in fences}
    for m in present:
        known.update(m.fences)
    what = f"rank {incoming.rank}'s files of step {incoming.step} (save {_short(incoming)})"
    if is_dead(incoming, known):
        rid, to = max(f for f in known if f[0] > incoming.timeline and incoming.step > f[1])
        return (
            f"{what} are from timeline {incoming.timeline}, which restore request {rid} rolled "
            f"back to step {to}: a late transfer from an abandoned timeline, not written"
        )
    committed = set(committed_ranks)
    for m in present:
        if m.save_id == incoming.save_id:
            continue
        if m.rank in committed:
            return (
                f"{what}: step {incoming.step} here is committed from save {_short(m)} "
                f"(rank {m.rank}); a tier never takes a second save of one step number, "
                "the committed one stays"
            )
        if m.save_key > incoming.save_key:
            return (
                f"{what}: a newer save {_short(m)} of step {incoming.step} is here "
                f"(rank {m.rank}); the older one is not written over it"
            )
    return None


def _short(m: Manifest) -> str:
    return m.save_id[:12] + "…" if m.save_id else "legacy"


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
    tier). The manifests of each step are grouped by save (``save_key``) and the view of the
    step is chosen among them (:func:`_pick_save`). Two manifests of the same save, step and
    rank with different files are a conflict, so the step is not restorable.
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
    saves: dict[int, dict[tuple[int, str], StepView]] = {}
    for entry, manifest in parsed:
        if tier is not None and entry.get("tier") != tier:
            continue
        if is_dead(manifest, known_fences):
            continue
        view = saves.setdefault(manifest.step, {}).setdefault(
            manifest.save_key, StepView(manifest.step)
        )
        rank = manifest.rank
        known = view.manifests.get(rank)
        if known is None:
            view.manifests[rank] = manifest
        elif _files(known) != _files(manifest) or known.world_size != manifest.world_size:
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
    return {step: _pick_save(step, by_save) for step, by_save in saves.items()}


def _pick_save(step: int, by_save: Mapping[tuple[int, str], StepView]) -> StepView:
    """The view of one step among its saves: the newest save complete on its own (at the
    world size its manifests agree on); if none is, every rank's newest copy (whose mix the
    completeness rule names)."""
    newest_first = sorted(by_save.items(), reverse=True)
    for _key, view in newest_first:
        if step_problem(view.manifests, conflicts=view.conflicts) is None:
            return view
    if len(newest_first) == 1:
        return newest_first[0][1]
    mixed = StepView(step)
    for _key, view in reversed(newest_first):  # oldest first: a newer save overwrites
        for rank, manifest in view.manifests.items():
            mixed.manifests[rank] = manifest
            mixed.sources[rank] = list(view.sources.get(rank, []))
        mixed.conflicts += view.conflicts
    return mixed


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
