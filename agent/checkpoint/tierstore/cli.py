"""``tierwatch-agent ckpt``: inspect, verify, export and clean up checkpoints on a node.

These commands read the memory folder and the persistent URL directly (no agent needed)::

    tierwatch-agent ckpt ls --job J [--step N]        steps per tier: ranks, bytes, complete
    tierwatch-agent ckpt verify --job J [--step N]    checksums of every listed file
    tierwatch-agent ckpt export --job J [--step N] --to DEST   a plain DCP folder
    tierwatch-agent ckpt gc --job J | --finished      remove memory + replicas on this node

``--memory-dir`` (``TIERWATCH_MEMORY_DIR``) defaults to ``/dev/shm/tierwatch/<node>`` with
``--node`` (``TIERWATCH_NODE``); ``--persistent-url`` (``TIERWATCH_PERSISTENT_URL``) defaults
to the one in the memory folder's ``agent.json`` (unless it carried credentials, which
``agent.json`` shows redacted), else ``file://<cwd>/var/checkpoints``.

Exit codes: 0 done; 1 ``verify`` found bad files or ``export`` could not copy a file
correctly; 2 bad input (names, missing options, no such step, a destination in use).
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from tierwatch.agent.checkpoint.format.completeness import disagreement, save_mix, step_problem
from tierwatch.agent.checkpoint.format.layout import (
    METADATA,
    LayoutError,
    MemoryLayout,
    check_job_id,
    check_node_name,
    check_step,
    manifest_name,
    step_dirname,
)
from tierwatch.agent.checkpoint.format.manifest import CHUNK, Manifest, verify_file
from tierwatch.agent.urlsafe import REDACTED

app = typer.Typer(
    help="Inspect, verify, export and clean up checkpoints on this node.",
    no_args_is_help=True,
    add_completion=False,
)

EXIT_BAD = 1
EXIT_USAGE = 2

JobOpt = Annotated[str | None, typer.Option("--job", help="Job id.")]
StepOpt = Annotated[int | None, typer.Option("--step", help="One step (default: all).")]
ExportStepOpt = Annotated[
    int | None,
    typer.Option("--step", help="The step to export (default: the newest complete step)."),
]
# typer shows each envvar itself ("[env var: …]"): the help texts do not repeat it
MemOpt = Annotated[
    Path | None,
    typer.Option(
        "--memory-dir",
        envvar="TIERWATCH_MEMORY_DIR",
        help="Memory folder (default /dev/shm/tierwatch/<node>).",
    ),
]
NodeOpt = Annotated[
    str | None, typer.Option("--node", envvar="TIERWATCH_NODE", help="This node's name.")
]
UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--persistent-url",
        envvar="TIERWATCH_PERSISTENT_URL",
        help="Persistent tier fsspec URL (default: agent.json's, else "
        "file://<cwd>/var/checkpoints).",
    ),
]


class Usage(Exception):
    """Bad input: printed as ``error: …`` and exit 2."""


def _die(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


F = TypeVar("F", bound=Callable[..., Any])


def _one_line_errors(fn: F) -> F:
    """A command whose unexpected ``OSError`` (a folder it cannot read, a destination it
    cannot create) prints one ``error: …`` line and exits 2 instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OSError as exc:
            raise _die(_os_error(exc)) from None

    return wrapper  # type: ignore[return-value]


def _os_error(exc: OSError) -> str:
    """``<file>: <reason>`` of an OSError (its str when it names no file)."""
    if exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


@dataclass
class StepCopy:
    """One step of one job in one place (memory, a replica folder, persistent)."""

    tier: str
    where: str  # memory: this node; peer: "replica of <src>"; persistent: URL
    step: int
    manifests: dict[int, Manifest] = field(default_factory=dict)
    bad_manifests: list[str] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    local_dir: Path | None = None
    dead: str | None = None  # rolled away by a restore request (see rollback.py)

    @property
    def world_size(self) -> int | None:
        sizes = {m.world_size for m in self.manifests.values()}
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def bytes(self) -> int:
        return sum(m.total_bytes() for m in self.manifests.values())

    def complete(self) -> tuple[bool, str]:
        """Whether this copy is a complete step (the rule restore applies:
        :func:`~tierwatch.agent.checkpoint.format.completeness.step_problem`, with every
        listed file present here; sizes and checksums are ``verify``'s), and why not."""
        why = step_problem(self.manifests, dead=self.dead, present=self.names)
        return (True, "complete") if why is None else (False, why)


def _ranges(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    out, start, prev = [], None, None
    for r in ranks:
        if start is None:
            start = prev = r
        elif prev is not None and r == prev + 1:
            prev = r
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = r
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


class Place:
    """Where to look: a memory folder and a persistent URL."""

    def __init__(
        self, memory_dir: Path | None, node: str | None, persistent_url: str | None
    ) -> None:
        if memory_dir is None:
            if not node:
                raise Usage(
                    "set --memory-dir (TIERWATCH_MEMORY_DIR) or --node "
                    "(TIERWATCH_NODE) to find the memory folder"
                )
            try:
                check_node_name(node)
            except LayoutError as exc:
                raise Usage(str(exc)) from None
            memory_dir = Path("/dev/shm/tierwatch") / node
        self.layout = MemoryLayout(memory_dir)
        self._redacted: str | None = None
        if not memory_dir.is_dir():
            typer.echo(
                f"warning: memory folder {memory_dir} does not exist (check --memory-dir / --node)",
                err=True,
            )
        if persistent_url is None:
            try:
                persistent_url = json.loads(self.layout.agent_file.read_text()).get(
                    "persistent_url"
                )
            except (OSError, ValueError, AttributeError):
                persistent_url = None
            if persistent_url and REDACTED in persistent_url:
                # agent.json shows the URL without its credentials: useless to connect
                self._redacted = (
                    f"{self.layout.agent_file} has the persistent URL with its credentials "
                    "redacted; pass --persistent-url (TIERWATCH_PERSISTENT_URL)"
                )
        if not persistent_url:
            persistent_url = "file://" + str(Path.cwd() / "var" / "checkpoints")
        if "://" not in persistent_url:
            persistent_url = "file://" + str(Path(persistent_url).absolute())
        self.persistent_url = persistent_url
        self._persistent: Any = None

    def persistent(self) -> Any:
        """The persistent tier (opened once).

        Raises:
            Usage: the URL came from an ``agent.json`` that shows it redacted, or the
                ``TIERWATCH_*`` storage settings are invalid.
        """
        from tierwatch.agent.checkpoint.tierstore.persister import PersistentError, PersistentTier

        if self._redacted is not None:
            raise Usage(self._redacted)
        if self._persistent is None:
            from pydantic import ValidationError

            from tierwatch.agent.config import AgentSettings

            try:  # storage options from the same TIERWATCH_* variables the agent reads
                settings = AgentSettings(persistent_url=self.persistent_url)
                self._persistent = PersistentTier(
                    settings.resolved_persistent_url(),
                    settings.persistent_storage_options(),
                    part_size=settings.s3_part_size,
                    upload_concurrency=settings.s3_upload_concurrency,
                )
            except ValidationError as exc:
                raise Usage("; ".join(e["msg"] for e in exc.errors())) from None
            except PersistentError as exc:
                raise Usage(str(exc)) from None
        return self._persistent

    def copies(self, job_id: str, step: int | None) -> list[StepCopy]:
        """Every copy of the job's steps (optionally one step) on this node and persistent."""
        from tierwatch.agent.checkpoint.format.manifest import (
            ManifestError,
            load_manifest,
            read_manifest,
        )
        from tierwatch.agent.checkpoint.tierstore.persister import PersistentError
        from tierwatch.agent.checkpoint.tierstore.store import steps_in

        out: list[StepCopy] = []

        def local(tier: str, where: str, job_dir: Path) -> None:
            for s in steps_in(job_dir):
                if step is not None and s != step:
                    continue
                d = job_dir / step_dirname(s)
                copy = StepCopy(
                    tier, where, s, local_dir=d, names={p.name for p in d.iterdir() if p.is_file()}
                )
                for name in sorted(copy.names):
                    if name.startswith("manifest-") and name.endswith(".json"):
                        try:
                            m = load_manifest(d / name)
                        except ManifestError as exc:
                            copy.bad_manifests.append(f"{name}: {exc}")
                            continue
                        copy.manifests[m.rank] = m
                out.append(copy)

        local("memory", "this node", self.layout.job_dir(job_id))
        rdir = self.layout.replicas_dir
        if rdir.is_dir():
            for src in sorted(p.name for p in rdir.iterdir() if p.is_dir()):
                try:
                    local("peer", f"replica of {src}", self.layout.replica_job_dir(src, job_id))
                except LayoutError:
                    continue
        tier = self.persistent()
        try:
            for s in tier.steps(job_id):
                if step is not None and s != step:
                    continue
                names = set(tier.names(job_id, s))
                copy = StepCopy("persistent", tier.shown_step_url(job_id, s), s, names=names)
                for name in sorted(names):
                    if name.startswith("manifest-") and name.endswith(".json"):
                        try:
                            with tier.open_read(job_id, s, name) as f:
                                m = read_manifest(f.read(), where=f"{copy.where}/{name}")
                        except (OSError, ManifestError) as exc:
                            copy.bad_manifests.append(f"{name}: {exc}")
                            continue
                        copy.manifests[m.rank] = m
                out.append(copy)
        except PersistentError as exc:
            typer.echo(f"warning: {exc}", err=True)
        self._mark_dead(job_id, out)
        return out

    def _mark_dead(self, job_id: str, copies: list[StepCopy]) -> None:
        """Mark the copies a rollback left behind (their step is above a newer fence)."""
        from tierwatch.agent.checkpoint.format.agreement import is_dead
        from tierwatch.agent.checkpoint.format.rollback import Timeline

        fences = set(Timeline.read(self.layout.timeline_file(job_id)).fences)
        fences |= {f for c in copies for m in c.manifests.values() for f in m.fences}
        for c in copies:
            for m in c.manifests.values():
                if is_dead(m, fences):
                    rid, to = max(f for f in fences if f[0] > m.timeline and m.step > f[1])
                    c.dead = f"rolled away: restore request {rid} went back to step {to}"
                    break

    def open_file(self, copy: StepCopy, job_id: str, name: str) -> Any:
        if copy.local_dir is not None:
            return open(copy.local_dir / name, "rb")
        return self.persistent().open_read(job_id, copy.step, name)


def _place(memory_dir: Path | None, node: str | None, url: str | None) -> Place:
    try:
        return Place(memory_dir, node, url)
    except Usage as exc:
        raise _die(str(exc)) from None


def _job(job: str | None) -> str:
    if not job:
        raise _die("--job is required")
    try:
        return check_job_id(job)
    except LayoutError as exc:
        raise _die(str(exc)) from None


def _step(step: int | None) -> int | None:
    if step is None:
        return None
    try:
        return check_step(step)
    except LayoutError as exc:
        raise _die(str(exc)) from None


def _console() -> Any:
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


@app.command("ls")
@_one_line_errors
def ls(
    job: JobOpt = None,
    step: StepOpt = None,
    memory_dir: MemOpt = None,
    node: NodeOpt = None,
    persistent_url: UrlOpt = None,
) -> None:
    """List a job's steps per tier: ranks present, bytes, complete or not."""
    from rich.table import Table

    job_id, one = _job(job), _step(step)
    try:
        copies = _place(memory_dir, node, persistent_url).copies(job_id, one)
    except Usage as exc:
        raise _die(str(exc)) from None
    if not copies:
        raise _die(
            f"no {'step ' + str(one) + ' of ' if one is not None else ''}job {job_id} "
            "in this node's memory, its replicas or the persistent tier"
        )
    table = Table(title=f"job {job_id}")
    for col in ("tier", "where", "step", "ranks", "world_size", "bytes", "complete"):
        table.add_column(col, justify="right" if col in ("step", "bytes") else "left")

    def order(c: Any) -> tuple[int, str, int]:
        # by tier, then holder, then step as a number (a persistent row's `where` is the
        # step's own URL: without its step folder, step-10 sorts after step-9)
        holder = c.where.replace(step_dirname(c.step), "")
        return ("memory", "peer", "persistent").index(c.tier), holder, c.step

    for c in sorted(copies, key=order):
        ok, why = c.complete()
        table.add_row(
            c.tier,
            c.where,
            str(c.step),
            _ranges(list(c.manifests)) or "-",
            str(c.world_size or "-"),
            str(c.bytes),
            "yes" if ok else f"no ({why})",
        )
    _console().print(table)


@app.command()
@_one_line_errors
def verify(
    job: JobOpt = None,
    step: StepOpt = None,
    memory_dir: MemOpt = None,
    node: NodeOpt = None,
    persistent_url: UrlOpt = None,
) -> None:
    """Check the size and xxh3 checksum of every file the manifests list (exit 1 when bad)."""
    from tierwatch.agent.checkpoint.format.manifest import FileEntry
    from tierwatch.agent.checkpoint.format.manifest import xxh3_stream as hash_stream

    job_id, one = _job(job), _step(step)
    place = _place(memory_dir, node, persistent_url)
    try:
        copies = place.copies(job_id, one)
    except Usage as exc:
        raise _die(str(exc)) from None
    if not copies:
        raise _die(
            f"nothing to verify: no {'step ' + str(one) + ' of ' if one is not None else ''}"
            f"job {job_id} in this node's memory, replicas or the persistent tier"
        )
    bad = 0
    for c in copies:
        label = f"{c.tier} ({c.where}) step {c.step}"
        for bad_manifest in c.bad_manifests:
            typer.echo(f"BAD  {label}: {bad_manifest}")
            bad += 1
        mixed = disagreement(c.manifests) or save_mix(c.manifests)  # as `ckpt ls` says
        if mixed:
            typer.echo(f"BAD  {label}: {mixed}")
            bad += 1
        count = 0
        for m in c.manifests.values():
            for f in m.files:
                entry = FileEntry(name=f.name, size=f.size, xxh3=f.xxh3)
                if c.local_dir is not None:
                    problem = verify_file(c.local_dir / f.name, entry)
                else:
                    try:
                        with place.open_file(c, job_id, f.name) as fh:
                            size, digest = hash_stream(fh)
                        problem = (
                            None
                            if (size, digest) == (f.size, f.xxh3)
                            else f"{f.name}: {size} bytes with xxh3 {digest}, manifest says "
                            f"{f.size} bytes with {f.xxh3}"
                        )
                    except FileNotFoundError:
                        problem = f"{f.name}: missing"
                    except OSError as exc:
                        problem = f"{f.name}: unreadable ({exc})"
                if problem:
                    typer.echo(f"BAD  {label}: {problem}")
                    bad += 1
                else:
                    count += 1
        if not c.bad_manifests and not mixed:
            typer.echo(
                f"ok   {label}: {count} file(s) of rank(s) {_ranges(list(c.manifests)) or '-'}"
            )
    if bad:
        typer.echo(f"{bad} bad file(s)", err=True)
        raise typer.Exit(EXIT_BAD)


@app.command()
@_one_line_errors
def export(
    to: Annotated[
        Path | None, typer.Option("--to", help="Destination folder (new or empty).")
    ] = None,
    job: JobOpt = None,
    step: ExportStepOpt = None,
    memory_dir: MemOpt = None,
    node: NodeOpt = None,
    persistent_url: UrlOpt = None,
) -> None:
    """Copy a complete step (persistent, else this node's memory) to DEST as a DCP folder."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    job_id, one = _job(job), _step(step)
    if to is None:
        raise _die("--to DEST is required (a new or empty folder)")
    try:
        in_use = to.exists() and (not to.is_dir() or any(to.iterdir()))
    except OSError as exc:
        raise _die(f"--to {to}: cannot use it ({_os_error(exc)})") from None
    if in_use:
        raise _die(f"--to {to}: exists and is not an empty folder; pick a new one")
    place = _place(memory_dir, node, persistent_url)
    try:
        copies = place.copies(job_id, one)
    except Usage as exc:
        raise _die(str(exc)) from None
    complete = [c for c in copies if c.tier in ("persistent", "memory") and c.complete()[0]]
    if not complete:
        seen = (
            ", ".join(f"{c.tier} step {c.step}: {c.complete()[1]}" for c in copies[:6])
            or "nothing found"
        )
        raise _die(
            f"no complete {'step ' + str(one) + ' of ' if one is not None else 'step of '}"
            f"job {job_id} in the persistent tier or this node's memory ({seen})"
        )
    newest = max(c.step for c in complete)
    chosen = sorted(
        (c for c in complete if c.step == newest), key=lambda c: c.tier != "persistent"
    )[0]
    files = sorted(
        {(f.name, f.size, f.xxh3) for m in chosen.manifests.values() for f in m.files},
        key=lambda t: (t[0] == METADATA, t[0]),
    )
    manifests = [manifest_name(r) for r in sorted(chosen.manifests)]
    total = sum(size for _, size, _ in files)
    try:
        to.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _die(f"--to {to}: cannot create it ({_os_error(exc)})") from None
    import xxhash

    failed = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=_console(),
    ) as progress:
        overall = progress.add_task(f"step {newest} from {chosen.tier}", total=total)
        for name, size, digest in [*files, *[(n, None, None) for n in manifests]]:
            task = progress.add_task(name, total=size)
            tmp = to / f".tmp-{name}"
            h = xxhash.xxh3_64()
            n = 0
            try:
                with place.open_file(chosen, job_id, name) as src, open(tmp, "wb") as out:
                    while chunk := src.read(CHUNK):
                        out.write(chunk)
                        h.update(chunk)
                        n += len(chunk)
                        progress.advance(task, len(chunk))
                        if size is not None:
                            progress.advance(overall, len(chunk))
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                failed.append(f"{name}: cannot copy ({exc})")
                continue
            if size is not None and (n != size or h.hexdigest() != digest):
                tmp.unlink(missing_ok=True)
                failed.append(
                    f"{name}: {n} bytes with xxh3 {h.hexdigest()}, the manifest says "
                    f"{size} bytes with {digest}"
                )
                continue
            try:
                tmp.replace(to / name)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                failed.append(f"{name}: cannot write it in {to} ({_os_error(exc)})")
                continue
            progress.remove_task(task)
    if failed:
        for line in failed:
            typer.echo(f"error: {line}", err=True)
        (to / METADATA).unlink(missing_ok=True)  # never leave a loadable partial copy
        raise typer.Exit(EXIT_BAD)
    typer.echo(
        f"exported step {newest} of {job_id} from {chosen.tier} ({chosen.where}) to "
        f"{to}: {len(files)} file(s), {total} bytes"
    )


@app.command()
@_one_line_errors
def gc(
    job: JobOpt = None,
    finished: Annotated[
        bool,
        typer.Option("--finished", help='Remove every job whose job.json says "finished": true.'),
    ] = False,
    memory_dir: MemOpt = None,
    node: NodeOpt = None,
) -> None:
    """Remove a job's memory-tier steps, replicas and restore folders on this node."""
    if not job and not finished:
        raise _die("give --job J or --finished")
    place = _place(memory_dir, node, "file:///")
    layout = place.layout
    jobs: list[str] = []
    if job:
        jobs.append(_job(job))
    if finished:
        for j in layout.jobs():
            try:
                info = json.loads(layout.job_file(j).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(info, dict) and info.get("finished") is True and j not in jobs:
                jobs.append(j)
    removed = 0
    for j in jobs:
        paths = [layout.job_dir(j), layout.root / "restore" / j]
        if layout.replicas_dir.is_dir():
            paths += [p / j for p in layout.replicas_dir.iterdir() if p.is_dir()]
        for p in paths:
            if p.is_dir():
                shutil.rmtree(p)
                typer.echo(f"removed {p}")
                removed += 1
    if not removed:
        typer.echo("nothing to remove" + (f" for job {job}" if job else " (no finished jobs)"))
