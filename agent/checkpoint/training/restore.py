"""Restore: the ranks agree on a step, the agents assemble its files, DCP loads (torch).

1. Every rank asks its agent which manifests it can supply from memory and peer replicas;
   the ranks exchange the answers on the checkpoint group and each computes the same newest
   restorable step (:mod:`~tierwatch.agent.checkpoint.format.agreement`). Only when no step is
   restorable from memory and peers do they ask again including the persistent tier, so a
   restore with nothing lost reads no persistent data.
2. Each rank checks the step's manifests' signatures (the job's manifest key), has its agent
   stage ``.metadata`` and checks its SHA-256, then (only then: DCP unpickles it) computes
   from DCP's load plan which files its own load reads, and has them staged (own node
   first, then other nodes, then persistent; every file verified against its manifest; a bad
   copy is reported and the next one tried), and checks each one's SHA-256 before
   ``dcp.load`` opens it (:mod:`~tierwatch.agent.checkpoint.training.verify`). A step that
   fails a check is skipped like one that cannot be staged, with a ``failed`` event naming
   the step and the file.
3. The ranks exchange the staging outcome. If any rank failed, the step is excluded and the
   ranks choose again — a collective decision, never a rank-local fallback, which would
   leave the others waiting in ``dcp.load``.
4. ``dcp.load`` from the staged folder, then the values go back into the model, optimizer,
   scheduler, RNG and sampler. The outcome is reported to the agent (step, files per tier,
   seconds, steps lost), a failure too.

Every rank enters every collective of the protocol, also after a failure of its own (an
agent that answers nonsense, a fetch that raises, a load that fails on one rank): the failure
is its outcome, and all ranks raise the same :class:`CheckpointError` naming the rank, its
node and the cause. The phases in which one rank may take minutes (asking the agents, which
may list the persistent tier; staging, which may fetch from it) run under
:meth:`~.collectives.CheckpointCollectives.gather_outcomes`, whose heartbeats keep every
collective of the waiting ranks shorter than the checkpointer's ``timeout_s``; a phase is
bounded by :data:`FETCH_LIMIT_S` per rank instead (docs/checkpointing.md "Collective
failures").

Steps rolled away by an operator's restore request (dead manifests, see
:mod:`~tierwatch.agent.checkpoint.format.agreement`) are never candidates. Serving a request,
``tier`` restricts every stage to that tier's copies (a step it does not hold completely is
not restorable), and the reports carry ``request_id`` and ``phase``.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tierwatch.agent.checkpoint.format import agreement
from tierwatch.agent.checkpoint.format.layout import METADATA
from tierwatch.agent.checkpoint.training.client import AgentUnavailable
from tierwatch.agent.checkpoint.training.collectives import (
    RankOutcome,
    failure_text,
    values_or_raise,
)
from tierwatch.agent.checkpoint.training.commit_decision import History
from tierwatch.agent.checkpoint.training.errors import CheckpointError, ModelMismatchError
from tierwatch.agent.checkpoint.training.state_adapter import StateAdapter
from tierwatch.agent.protocol import RestoreReport, utcnow

if TYPE_CHECKING:
    from tierwatch.agent.checkpoint.training.checkpointer import TieredCheckpointer

__all__ = ["ModelMismatchError", "RestoreRun", "restore_state"]

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 8
# The longest one rank's part of a slow phase (asking its agent, staging a step's files) may
# take (seconds): AgentClient's stage timeout (1800 s) ends a stuck fetch first; this bounds
# the phase whatever the client does. The other ranks wait in heartbeats meanwhile.
FETCH_LIMIT_S = 1860.0


#: How many nodes' agents list the persistent tier for a restore. The tier is shared, so one
#: listing would do; two keep it visible when one agent cannot reach the store.
PERSISTENT_LISTERS = 2


def askers(nodes_by_rank: list[str]) -> dict[int, bool]:
    """Which ranks ask their node's agent what it holds, and which of them also ask for the
    persistent tier (pure).

    One rank per node asks (the lowest on the node: its agent's answer covers every rank of
    the node, the memory folder and the peer replicas it holds), and the first
    :data:`PERSISTENT_LISTERS` of them also list the persistent tier. So the gathered answers
    hold each node's entries once and the persistent tier's at most twice: O(world × steps)
    entries in all, where one answer per rank with every persistent manifest was
    O(world² × steps) (bench/control_path.py).

    Args:
        nodes_by_rank: Each rank's node, index = rank.

    Returns:
        ``{rank: lists_persistent}`` for the ranks that ask; the other ranks ask nothing.
    """
    leaders: dict[str, int] = {}
    for rank, node in enumerate(nodes_by_rank):
        leaders.setdefault(node, rank)
    return {rank: i < PERSISTENT_LISTERS for i, rank in enumerate(sorted(leaders.values()))}


def _ask(ckpt: TieredCheckpointer, persistent: bool) -> dict[str, Any] | str:
    """This rank's agent's ``available`` answer, or the error as text."""
    last = ""
    for _ in range(3):
        try:
            return ckpt.client.available(ckpt.job_id, persistent=persistent)
        except AgentUnavailable as exc:
            last = str(exc)
            time.sleep(1.0)
    return last


def _gather_views(
    ckpt: TieredCheckpointer, persistent: bool, *, tier: str | None = None
) -> tuple[dict[int, agreement.StepView], dict[int, agreement.StepView]]:
    """Every node's agent's answer (asked by one rank per node, :func:`askers`), merged:
    ``(views of tier, views of every tier)`` (the same when ``tier`` is None); dead steps are
    left out (the ranks' fences and those the manifests list)."""
    plan = askers(ckpt.nodes_by_rank)

    def ask() -> dict[str, Any] | str | None:
        if ckpt.rank not in plan:
            return None  # this node's agent is asked by its lowest rank
        return _ask(ckpt, persistent and plan[ckpt.rank])

    answers = values_or_raise(
        ckpt.collectives.gather_outcomes(ask, what="asking the agents", limit_s=FETCH_LIMIT_S),
        what=f"restore of {ckpt.job_id}: asking the agents which steps they hold",
        nodes=ckpt.nodes_by_rank,
    )
    errors = [
        f"rank {r} ({ckpt.nodes_by_rank[r]}): {a}"
        for r, a in enumerate(answers)
        if isinstance(a, str)
    ]
    if errors:
        raise CheckpointError("restore needs every node's agent: " + "; ".join(errors[:4]))
    fences = ckpt.fences
    every = agreement.merge_available(answers, fences=fences)
    if tier is None:
        return every, every
    return agreement.merge_available(answers, tier=tier, fences=fences), every


def _needed_files(
    template: dict[str, Any], staged_dir: Path, is_coordinator: bool, view: agreement.StepView
) -> list[str]:
    """Files this rank's ``dcp.load`` reads, from DCP's own load plan (all files if the plan
    cannot be computed)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    try:
        metadata = FileSystemReader(staged_dir).read_metadata()
        planner = DefaultLoadPlanner()
        planner.set_up_planner(dict(template), metadata, is_coordinator)
        plan = planner.create_local_plan()
        storage = metadata.storage_data
        names = sorted({storage[item.storage_index].relative_path for item in plan.items})
        known = agreement.file_owner(view)
        if all(n in known for n in names):
            return names
    except Exception as exc:  # noqa: BLE001 - fall back to every file of the step
        log.info("load plan not computed (%s); staging every file", exc)
    return [n for n in agreement.all_file_names(view) if n != METADATA]


def _check_model(
    template: dict[str, Any], staged_dir: Path, modules: list[str], job_id: str, step: int
) -> str | None:
    """Differences between the saved model and ours (None when they match)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        md = FileSystemReader(staged_dir).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001
        return f"cannot read .metadata of step {step}: {exc}"
    problems: list[str] = []
    for key in modules:
        ours = {
            f"{key}.{k}": tuple(v.shape)
            for k, v in template[key].items()
            if isinstance(v, torch.Tensor)
        }
        saved = {
            k: tuple(v.size)
            for k, v in md.items()
            if k.startswith(f"{key}.") and isinstance(v, TensorStorageMetadata)
        }
        for k in sorted(set(ours) - set(saved))[:3]:
            problems.append(f"{k} is not in the checkpoint")
        for k in sorted(set(saved) - set(ours))[:3]:
            problems.append(f"checkpoint has {k}, this model does not")
        for k in sorted(set(ours) & set(saved)):
            if ours[k] != saved[k] and len(problems) < 6:
                problems.append(f"{k}: checkpoint shape {list(saved[k])}, model {list(ours[k])}")
    if problems:
        return (
            f"job_id {job_id!r} step {step} holds a different model: "
            + "; ".join(problems[:6])
            + ". Use another job_id, or free this one with `tierwatch-agent ckpt gc --job "
            f"{job_id}` on every node"
        )
    return None


def _stage(ckpt: TieredCheckpointer, step: int, files: list[dict[str, Any]]) -> dict[str, Any]:
    try:
        return ckpt.client.stage(ckpt.job_id, step, files)
    except AgentUnavailable as exc:
        return {"ok": False, "errors": [str(exc)], "files": []}


def _stage_metadata(
    ckpt: TieredCheckpointer,
    step: int,
    view: agreement.StepView,
    adapter: StateAdapter | None,
    template: dict[str, Any] | None,
    prep_error: Exception | None,
    out: dict[str, Any],
) -> str | None:
    """This rank's first staging phase (on a helper thread): stage ``.metadata`` of ``step``
    and compare the saved model with ours.

    Puts the agent's ``answer``, the staging ``problem`` (None when staged) and the
    ``staged_dir`` into ``out``.

    Returns:
        Why the step holds a different model, or None.

    Raises:
        Exception: ``prep_error`` (building the template failed on this rank), or what the
            agent client or the comparison raised: the phase's failure on this rank.
    """
    if prep_error is not None:
        raise prep_error
    assert adapter is not None
    assert template is not None
    # nothing of a step is staged, let alone unpickled, before its manifests are proven
    bad = ckpt.verifier.manifests_problem(view)
    if bad is not None:
        out["problem"] = _refuse(ckpt, step, bad, {})
        return None
    answer = _stage(ckpt, step, agreement.stage_request(view, [METADATA], node=ckpt.node))
    out["answer"] = answer
    out["problem"] = None if answer.get("ok") else "; ".join(answer.get("errors", []))[:1000]
    if out["problem"] is not None:
        return None
    staged_dir = Path(answer["dir"])
    bad = ckpt.verifier.files_problem(view, staged_dir, [METADATA])
    if bad is not None:
        out["problem"] = _refuse(ckpt, step, bad, answer)
        return None
    out["staged_dir"] = staged_dir
    signature = next(iter(view.manifests.values())).signature
    if signature == adapter.signature(template):
        return None
    return _check_model(template, staged_dir, sorted(adapter.modules), ckpt.job_id, step) or (
        f"job_id {ckpt.job_id!r} step {step} was saved from a different state "
        "(its signature differs); use another job_id"
    )


def _stage_files(
    ckpt: TieredCheckpointer,
    step: int,
    view: agreement.StepView,
    template: dict[str, Any] | None,
    staged_dir: Path | None,
    problem: str | None,
    out: dict[str, Any],
) -> str | None:
    """This rank's second staging phase (on a helper thread): stage the files its own
    ``dcp.load`` reads (DCP's load plan), unless the first phase had a ``problem``.

    Puts the agent's ``answer`` into ``out``.

    Returns:
        Why this rank could not stage the step (a staging problem: the ranks choose again),
        or None.

    Raises:
        Exception: what the agent client or the load plan raised (the phase's failure on
            this rank: every rank gives up).
    """
    if problem is not None or staged_dir is None:
        return problem or "the .metadata was not staged"
    assert template is not None
    files = _needed_files(template, staged_dir, ckpt.rank == 0, view)
    answer = _stage(ckpt, step, agreement.stage_request(view, files, node=ckpt.node))
    out["answer"] = answer
    if not answer.get("ok"):
        return "; ".join(answer.get("errors", []))[:1000]
    bad = ckpt.verifier.files_problem(view, staged_dir, files)
    if bad is not None:
        return _refuse(ckpt, step, bad, answer)
    return None


def _refuse(ckpt: TieredCheckpointer, step: int, problem: str, answer: dict[str, Any]) -> str:
    """Record that ``step`` failed verification (a ``failed`` event on the tier its files
    came from, naming the step and the file) and return the staging problem."""
    tiers = {f.get("tier") for f in answer.get("files", [])} & {"memory", "peer", "persistent"}
    tier = "persistent" if "persistent" in tiers else "peer" if "peer" in tiers else "memory"
    message = f"step {step} skipped, it failed verification: {problem}"[:2000]
    log.warning("rank %d: %s", ckpt.rank, message)
    ckpt._event(step, tier, "failed", message=message)
    return message


@dataclass
class RestoreRun:
    """One restore attempt: when it began, the request it serves, what was reported.

    Attributes:
        t0: ``time.monotonic()`` when it began.
        request_id: The operator request served (None: a plain restore).
        reported: Whether its outcome was reported.
        loading: Whether it failed inside ``dcp.load`` or while putting the values back
            (the live state may then be partly overwritten).
    """

    t0: float = field(default_factory=time.monotonic)
    request_id: int | None = None
    reported: bool = False
    loading: bool = False  # dcp.load began: a failure now may have torn the live state


def restore_state(
    ckpt: TieredCheckpointer,
    state: dict[str, Any],
    *,
    wanted: int | None,
    tier: str | None = None,
    request_id: int | None = None,
    last_done: int | None = None,
    on_loaded: Callable[[int], list[str]] | None = None,
    run: RestoreRun | None = None,
) -> int | None:
    """Run the restore protocol for ``ckpt`` into ``state`` (see the module docstring).

    Args:
        wanted: Load exactly this step (None: the newest restorable).
        tier: Read only from this tier (memory | peer | persistent): a step it does not hold
            completely is not restorable. None: every tier, fastest first.
        request_id: The operator request served (set on the reports, with ``phase``).
        last_done: This rank's newest completed step, for ``steps_lost`` (None: the newest
            step any rank's progress file records; step folders in the tiers never count).
        on_loaded: Called with the step once it is loaded into ``state``, before the
            outcome is reported; returns notes for the report's message.
        run: The attempt's record (default: a new one); after a failure, its ``loading``
            tells the caller whether the live state may be partly overwritten.

    Every outcome is reported once (a failure too, ``ok`` False).

    Returns:
        The step loaded, or None when nothing is restorable and no step was asked for.

    Raises:
        CheckpointError: ``wanted`` is not restorable, or an agent is unreachable.
        ModelMismatchError: the job's checkpoint holds a different model.
    """
    if run is None:
        run = RestoreRun(request_id=request_id)
    try:
        return _restore(
            ckpt, state, run, wanted=wanted, tier=tier, last_done=last_done, on_loaded=on_loaded
        )
    except Exception as exc:
        if not run.reported:
            _report(ckpt, run, None, {}, ok=False, message=f"{type(exc).__name__}: {exc}"[:2000])
        # A refused restore usually ends the process right away (its daemon sender with it):
        # hand the outcome to the agent now, so the refusal reaches the server.
        ckpt.events.flush(REFUSAL_FLUSH_S)
        raise


def _restore(
    ckpt: TieredCheckpointer,
    state: dict[str, Any],
    run: RestoreRun,
    *,
    wanted: int | None,
    tier: str | None,
    last_done: int | None,
    on_loaded: Callable[[int], list[str]] | None,
) -> int | None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException

    from tierwatch.agent.checkpoint.training.checkpointer import describe_error

    t0 = run.t0
    verify_s0 = ckpt.verifier.seconds
    excluded: set[int] = set()
    # the persistent tier is read only when the faster ones cannot serve (or it is the one)
    may_persist = tier in (None, "persistent")
    persistent = tier == "persistent"
    views, every = _gather_views(ckpt, persistent, tier=tier)
    chosen: int | None = None
    staged_dir: Path | None = None
    sources: dict[str, str] = {}
    template: dict[str, Any] | None = None
    adapter: StateAdapter | None = None
    notes: list[str] = []  # bad copies met on the way (staging errors), for the report
    phases: dict[str, float] = {}  # seconds per phase, for the report
    only = f" in the {tier} tier" if tier else ""
    for _attempt in range(MAX_ATTEMPTS):
        chosen, reasons = agreement.choose_step(
            views, ckpt.world_size, excluded=excluded, wanted=wanted
        )
        if chosen is None and not persistent and may_persist:
            persistent = True
            views, every = _gather_views(ckpt, persistent, tier=tier)
            continue
        if chosen is None:
            sizes = {m.world_size for v in views.values() for m in v.manifests.values()}
            if sizes - {ckpt.world_size}:
                others = {
                    s: max(
                        st
                        for st, v in views.items()
                        if any(m.world_size == s for m in v.manifests.values())
                    )
                    for s in sizes - {ckpt.world_size}
                }
                listing = ", ".join(
                    f"world_size {s} (newest step {n})" for s, n in sorted(others.items())
                )
                message = (
                    f"job_id {ckpt.job_id!r} holds steps saved at {listing}, none at "
                    f"world_size {ckpt.world_size}: restart at the same world size, or "
                    "load a persistent step with plain torch.distributed.checkpoint "
                    "and use a new job_id"
                )
                _report(ckpt, run, None, {}, ok=False, message=message)
                raise CheckpointError(message)
            if wanted is None:
                log.info("rank %d: nothing to restore for %s", ckpt.rank, ckpt.job_id)
                _report(ckpt, run, None, {}, ok=True, message="no complete step in any tier")
                return None
            steps = agreement.restorable_steps(views, ckpt.world_size)
            steps = [s for s in steps if s not in excluded]
            why = reasons.get(wanted, "no tier holds any file of it")
            raise CheckpointError(
                f"step {wanted} of {ckpt.job_id} cannot be restored{only} "
                f"({why}); restorable steps{only}: {steps or 'none'}"
            )
        view = views[chosen]
        prep_error: Exception | None = None  # raised in the next phase: every rank learns it
        if adapter is None or template is None:
            t_tpl = time.monotonic()
            try:
                adapter = StateAdapter(state)
                # a state dict of the right structure to load into (optimizer state initialised)
                template = adapter.live().state_dict
            except Exception as exc:  # noqa: BLE001 - the next phase's outcome on this rank
                prep_error = exc
            phases["template"] = time.monotonic() - t_tpl

        # each phase below may fetch from the persistent tier (minutes on one rank): the
        # others wait in heartbeats, and a rank's exception is its outcome, not a skipped
        # collective
        t_stage = time.monotonic()
        first: dict[str, Any] = {}
        mismatches = values_or_raise(
            ckpt.collectives.gather_outcomes(
                partial(_stage_metadata, ckpt, chosen, view, adapter, template, prep_error, first),
                what=f"staging .metadata of step {chosen}",
                limit_s=FETCH_LIMIT_S,
            ),
            what=f"restore of {ckpt.job_id}: staging .metadata of step {chosen}",
            nodes=ckpt.nodes_by_rank,
        )
        answer: dict[str, Any] = first.get("answer", {})
        notes += [f"step {chosen}: {e}" for e in answer.get("errors", [])]
        problem: str | None = first.get("problem")
        staged_dir = first.get("staged_dir")
        mismatches = [m for m in mismatches if m]
        if mismatches:
            _report(ckpt, run, None, {}, ok=False, message=mismatches[0][:2000])
            raise ModelMismatchError(mismatches[0])
        second: dict[str, Any] = {}
        outcomes = values_or_raise(
            ckpt.collectives.gather_outcomes(
                partial(_stage_files, ckpt, chosen, view, template, staged_dir, problem, second),
                what=f"staging the files of step {chosen}",
                limit_s=FETCH_LIMIT_S,
            ),
            what=f"restore of {ckpt.job_id}: staging the files of step {chosen}",
            nodes=ckpt.nodes_by_rank,
        )
        answer2: dict[str, Any] = second.get("answer", {})
        notes += [f"step {chosen}: {e}" for e in answer2.get("errors", [])]
        if problem is None and answer2.get("ok"):
            phases["stage"] = phases.get("stage", 0.0) + time.monotonic() - t_stage
            sources = {
                f["name"]: f"{f.get('tier')}:{f.get('holder')}"
                for f in [*answer.get("files", []), *answer2.get("files", [])]
            }
        failed = [f"rank {r}: {p}" for r, p in enumerate(outcomes) if p]
        if not failed:
            break
        log.warning(
            "rank %d: step %d could not be staged (%s); choosing again",
            ckpt.rank,
            chosen,
            "; ".join(failed)[:500],
        )
        if not persistent and may_persist:
            # the persistent tier is the next source of the bad files: retry this step with it
            persistent = True
            views, every = _gather_views(ckpt, persistent, tier=tier)
        else:
            excluded.add(chosen)
    else:
        raise CheckpointError(f"restore of {ckpt.job_id} gave up after {MAX_ATTEMPTS} attempts")

    assert chosen is not None
    assert staged_dir is not None
    assert template is not None
    assert adapter is not None
    phases["agree+stage"] = time.monotonic() - t0 - phases.get("template", 0.0)
    phases["verify"] = ckpt.verifier.seconds - verify_s0  # SHA-256 of the files read
    t_load = time.monotonic()
    run.loading = True
    load_error: str | None = None
    try:
        dcp_load(
            template,
            storage_reader=FileSystemReader(staged_dir),
            process_group=ckpt.collectives.group,
            no_dist=not ckpt.collectives.distributed,
        )
        adapter.load(template)
    except Exception as exc:  # noqa: BLE001 - every rank learns of it below
        load_error = failure_text(exc)
    except CheckpointException as exc:  # DCP's (a BaseException), names each failed rank
        load_error = describe_error(exc)[:1500]
    # a rank whose load failed alone must not leave the others training on (they would
    # wait in the job's next collective): every rank learns every rank's load outcome, with
    # the newest step it recorded (for steps_lost)
    lasts = values_or_raise(
        ckpt.collectives.all_gather(
            RankOutcome(ckpt.rank, value=_last_trained(ckpt), error=load_error)
        ),
        what=f"restore of {ckpt.job_id}: loading step {chosen}",
        nodes=ckpt.nodes_by_rank,
    )
    run.loading = False
    phases["load"] = time.monotonic() - t_load

    history = None
    if ckpt.rank == 0:
        complete = agreement.restorable_steps(every, ckpt.world_size)
        persisted = sorted(
            {
                s
                for s in complete
                for src in every[s].sources.get(0, [])
                if src.tier == "persistent" and s <= chosen
            }
        )
        history = History.seeded([s for s in complete if s <= chosen], persisted)
    ckpt.restored(chosen, history=history)
    # steps_lost counts to the newest step the ranks themselves recorded (their progress
    # files, or the loop's own step), never to step folders a tier holds: a planted or
    # forged step-<N>/ must not inflate it (docs/checkpointing.md "Ledger")
    if last_done is None:
        last = max([s for s in lasts if s is not None] + [chosen])
    else:
        last = max(last_done, chosen)
    if on_loaded is not None:
        notes += on_loaded(chosen)
    timing = ", ".join(f"{k} {v:.3f} s" for k, v in phases.items() if k != "stage")
    _report(
        ckpt,
        run,
        chosen,
        sources,
        ok=True,
        steps_lost=last - chosen,
        message="; ".join([f"phases: {timing}", *notes])[:2000],
    )
    return chosen


REFUSAL_FLUSH_S = 15.0  # the longest a failed restore waits to hand its report to the agent


def _last_trained(ckpt: TieredCheckpointer) -> int | None:
    """The newest step this rank's previous run completed (its progress file), if known."""
    try:
        return int(json.loads(ckpt.progress_file.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _report(
    ckpt: TieredCheckpointer,
    run: RestoreRun,
    step: int | None,
    sources: dict[str, str],
    *,
    ok: bool,
    message: str = "",
    steps_lost: int | None = None,
) -> None:
    by_tier = Counter(v.split(":", 1)[0] for v in sources.values())
    phase = None if run.request_id is None else ("loaded" if ok and step is not None else "failed")
    report = RestoreReport(
        job_id=ckpt.job_id,
        rank=ckpt.rank,
        world_size=ckpt.world_size,
        step=step,
        ts=utcnow(),
        seconds=time.monotonic() - run.t0,
        steps_lost=steps_lost,
        files_by_tier={
            k: v
            for k, v in by_tier.items()  # type: ignore[misc]
            if k in ("memory", "peer", "persistent")
        },
        sources=dict(list(sources.items())[:4096]),
        ok=ok and phase != "failed",
        message=message[:2000],
        request_id=run.request_id,
        phase=phase,
    )
    run.reported = True
    ckpt.record_restore(report)
    log.info("rank %d restore: %s", ckpt.rank, json.dumps(report.model_dump(mode="json"))[:500])
