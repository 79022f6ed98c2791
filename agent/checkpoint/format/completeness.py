"""When one checkpoint step is complete (pure logic, no I/O, no torch).

One rule for every place that asks: the restore agreement
(:func:`tierwatch.agent.checkpoint.format.agreement.restorable`, over the manifests every
rank's agent can supply) and ``tierwatch-agent ckpt ls/export`` (over the copy of a step in
one place: this node's memory, a replica folder, the persistent tier).

A step is complete when (checked in this order, the first failure is the reason):

1. no two copies of one rank's manifest differ (``conflicts``, found while merging sources);
2. there is at least one manifest, and the manifests are of one checkpoint: the same world
   size and state signature (:func:`disagreement`);
3. it was not rolled away by a restore request (``dead``);
4. the manifests come from one timeline (a step saved again after a rollback mixes old and
   new copies until every rank's new copy is there);
5. the manifests come from one save: they all carry the same ``save_id`` (a step number
   saved again, after a restart from an older step or a rollback, is another save; manifests
   without an id, written before save ids, count as one legacy save ``""``);
6. there is a manifest for every rank ``0..world_size-1`` and for no other rank, all at
   ``world_size`` (the job's, or the one the manifests agree on);
7. exactly one manifest lists ``.metadata`` (rank 0's, in DCP's layout);
8. every file the manifests list is present (when the caller knows which files are there;
   sizes and checksums are verified separately, while staging or by ``ckpt verify``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from tierwatch.agent.checkpoint.format.manifest import Manifest


def save_mix(manifests: Mapping[int, Manifest]) -> str | None:
    """Why ``manifests`` (rank → manifest of one step) are not all of one save.

    Returns:
        None when every manifest carries the same ``save_id`` (``""``, the legacy save,
        counts as one id); otherwise which ranks carry which id, e.g. ``the ranks' files come
        from 2 saves of this step (0190…: rank(s) [0]; legacy: rank(s) [1]) …``.
    """
    ids = sorted({m.save_id for m in manifests.values()})
    if len(ids) <= 1:
        return None
    per_id = "; ".join(
        f"{i[:12] + '…' if i else 'legacy'}: rank(s) "
        f"{[r for r, m in sorted(manifests.items()) if m.save_id == i][:8]}"
        for i in ids
    )
    return (
        f"the ranks' files come from {len(ids)} saves of this step ({per_id}); a step is "
        "complete only with every rank's files of one save"
    )


def disagreement(manifests: Mapping[int, Manifest]) -> str | None:
    """Why ``manifests`` (rank → manifest of one step) belong to more than one checkpoint.

    Returns:
        None when they agree on the world size and the state signature; otherwise which of
        the two differs, e.g. ``ranks disagree on the world size (2: rank(s) [0]; 3: rank(s)
        [1])``.
    """
    worlds = sorted({m.world_size for m in manifests.values()})
    if len(worlds) > 1:
        per_world = "; ".join(
            f"{w}: rank(s) {[r for r, m in sorted(manifests.items()) if m.world_size == w][:8]}"
            for w in worlds
        )
        return f"ranks disagree on the world size ({per_world})"
    signatures = {m.signature for m in manifests.values()}
    if len(signatures) > 1:
        return f"ranks disagree on the state signature ({len(signatures)} signatures)"
    return None


def step_problem(
    manifests: Mapping[int, Manifest],
    world_size: int | None = None,
    *,
    conflicts: Iterable[str] = (),
    dead: str | None = None,
    present: Collection[str] | None = None,
) -> str | None:
    """Why one step is not complete (see the module notes), or None when it is.

    Args:
        manifests: rank → that rank's manifest of the step.
        world_size: The world size the step must have (a restore: the job's); None: the one
            the manifests agree on.
        conflicts: Differing copies of one rank's manifest met while merging sources.
        dead: Why the step was rolled away by a restore request (None: it was not).
        present: Names of the files where the step is (None: not checked).

    Returns:
        None when complete; otherwise the first reason, as a short lower-case phrase.
    """
    problems = list(conflicts)
    if problems:
        return "; ".join(problems)
    if not manifests:
        return "no manifests"
    why = disagreement(manifests)
    if why is not None:
        return why
    if dead:
        return dead
    if len({m.timeline for m in manifests.values()}) != 1:
        return (
            "the ranks' files come from different timelines (the step was saved again "
            "after a rollback and not every rank's new copy is here)"
        )
    mixed = save_mix(manifests)
    if mixed is not None:
        return mixed
    world = world_size if world_size is not None else next(iter(manifests.values())).world_size
    missing = [r for r in range(world) if r not in manifests]
    if missing:
        return f"no manifest of rank(s) {missing[:8]}"
    if any(r >= world for r in manifests) or any(m.world_size != world for m in manifests.values()):
        return f"saved at another world size (ranks {sorted(manifests)[:8]}…)"
    if sum(m.has_metadata() for m in manifests.values()) != 1:
        return "no single rank lists .metadata"
    if present is not None:
        absent = sorted(
            {f.name for m in manifests.values() for f in m.files if f.name not in present}
        )
        if absent:
            return f"files missing: {', '.join(absent[:4])}"
    return None
