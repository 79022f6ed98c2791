"""The demo's report file (``make demo`` → ``var/demo-report.json``): schema and reading.

``scripts/demo.py`` rewrites the file while it runs (``status: "running"``) and once more at
the end (``"finished"``); the server reads it again at every request of ``/demo`` and
``/api/v1/demo/report``. :func:`read_report` turns every way the file can be wrong into one
of two exceptions whose message names the file and says what is wrong, so the routes never
answer 500:

* :class:`ReportAbsent`: the file does not exist (yet).
* :class:`ReportInvalid`: it cannot be read, is not JSON, or does not match
  :class:`DemoReport` (each wrong field is listed, at most :data:`MAX_LISTED_ERRORS`).

Unknown fields are kept (``extra="allow"``): a newer demo may add numbers before the page
shows them. Nullable fields may be left out (they default to null), and so may the lists and
maps (they default to empty); the run's parameters, times, ``duration_s`` and ``steps`` are
required.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

MAX_REPORT_BYTES = 32 * 1024 * 1024
MAX_LISTED_ERRORS = 8
CHART_MAX_POINTS = 2000
GOT_MAX_CHARS = 80
#: Seconds a client should wait before asking again for a report it could not use.
RETRY_AFTER_S = 5
NOT_CONFIGURED = (
    "This server shows no demo report: start `make demo` (it runs the server with "
    "TIERWATCH_DEMO_REPORT=var/demo-report.json), or set TIERWATCH_DEMO_REPORT to the "
    "report's path and restart the server."
)
MID_WRITE_HINT = (
    "The demo rewrites this file while it runs; if it was caught in the middle of a write, "
    "the next refresh shows it."
)


def _as_utc(value: datetime) -> datetime:
    """Read a time without an offset as UTC (the demo writes UTC)."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


UtcDatetime = Annotated[datetime, AfterValidator(_as_utc)]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Baseline(_Open):
    """The persistent-only baseline the demo compares against (seconds).

    ``formula`` is the expression the demo evaluated, e.g. Daly's (2006) efficiency with
    checkpoints every ``interval_s`` costing ``checkpoint_s``, and each failure (MTBF
    ``mtbf_s``) costing ``restart_s + restore_s`` plus half an interval of lost work.
    """

    interval_s: float
    checkpoint_s: float
    restart_s: float
    restore_s: float
    mtbf_s: float
    formula: str


class Steps(_Open):
    """Training steps: the last one reached, those that count, those redone after a restore."""

    final: int
    useful: int
    lost: int


class Nodes(_Open):
    """Simulated node names by role at the time of the report."""

    in_use: list[str] = Field(default_factory=list)
    spare: list[str] = Field(default_factory=list)
    isolated: list[str] = Field(default_factory=list)


class Failure(_Open):
    """One injected failure and how the system recovered from it.

    Attributes:
        at_s: when it was injected, seconds after training started.
        component: what failed (e.g. ``gpu``, ``nic``, ``trainer``).
        category: the kind of fault (e.g. ``xid``, ``ecc``, ``crash``).
        failure_class: ``node``, ``process``, ``rack`` or ``rollback``: which tiers can
            serve the restore.
        node, rank: where, when it hit one node or rank.
        injected: what the demo did, in words.
        detected_after_s: seconds from injection to detection (null: not detected).
        isolated: the node was isolated; ``replaced_by``: the spare that took its place.
        restored_step, restore_tier: the step training resumed from and the fastest tier
            used; ``rank_tiers``: the tier each rank restored from.
        steps_lost: steps redone; ``downtime_s``: seconds without training.
        recovered: training runs again; ``note``: anything else worth saying.
    """

    at_s: float
    component: str
    category: str
    failure_class: str
    node: str | None = None
    rank: int | None = None
    injected: str
    detected_after_s: float | None = None
    isolated: bool = False
    replaced_by: str | None = None
    restored_step: int | None = None
    restore_tier: str | None = None
    rank_tiers: dict[str, str] = Field(default_factory=dict)
    steps_lost: int | None = None
    downtime_s: float | None = None
    recovered: bool
    note: str | None = None


class DemoReport(_Open):
    """The report ``scripts/demo.py`` writes (version 1).

    Attributes:
        status: ``running`` while the demo runs, ``finished`` once it has stopped.
        seed, mtbf_s, seconds: the run's parameters (``seconds`` is ``DEMO_SECONDS``; 0 runs
            until Ctrl-C).
        started_at, updated_at: UTC times (a time without an offset is read as UTC).
        duration_s: wall time of training so far (seconds).
        effective_training_time: useful training time / wall time, 0-1 (null: not known yet).
        baseline_persistent_only: the same for persistent-only checkpointing, from
            ``baseline``'s formula, 0-1.
        loss_start, loss_end: training loss at the first and the latest step.
        tiers_used: the checkpoint tiers restores came from (memory, peer, persistent).
        costs: measured medians by name, e.g. ``restart_s``, ``save_stall_s``,
            ``persistent_write_s`` (seconds for ``_s`` names).
        loss_curve: ``[step, loss]`` pairs in step order.
    """

    version: Literal[1]
    status: Literal["running", "finished"]
    seed: int
    mtbf_s: float
    seconds: float
    started_at: UtcDatetime
    updated_at: UtcDatetime
    duration_s: float
    effective_training_time: float | None = None
    baseline_persistent_only: float | None = None
    baseline: Baseline | None = None
    loss_start: float | None = None
    loss_end: float | None = None
    steps: Steps
    tiers_used: list[str] = Field(default_factory=list)
    costs: dict[str, float] = Field(default_factory=dict)
    loss_curve: list[tuple[int, float]] = Field(default_factory=list)
    nodes: Nodes = Field(default_factory=Nodes)
    failures: list[Failure] = Field(default_factory=list)


class ReportAbsent(Exception):
    """The report file does not exist (the demo has not written it yet)."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"{path} does not exist yet")
        self.path = path


class ReportInvalid(Exception):
    """The report file exists but cannot be used; ``problem`` says why (one line each)."""

    def __init__(self, path: Path, problem: str, errors: list[str] | None = None) -> None:
        self.path = path
        self.problem = problem
        self.errors = errors or []
        listed = f": {'; '.join(self.errors)}" if self.errors else ""
        super().__init__(f"{path}: {problem}{listed}")


def _describe(exc: ValidationError) -> tuple[str, list[str]]:
    errors = exc.errors(include_url=False)
    if len(errors) == 1 and errors[0]["type"] == "json_invalid":
        return f"it is not valid JSON ({errors[0]['msg']})", []
    lines = []
    for e in errors[:MAX_LISTED_ERRORS]:
        where = ".".join(str(p) for p in e["loc"]) or "the whole file"
        got = e.get("input")
        shown = ""
        if e["type"] != "missing" and (got is None or isinstance(got, str | int | float)):
            text = repr(got)
            shown = f" (got {text[:GOT_MAX_CHARS]}{'…' if len(text) > GOT_MAX_CHARS else ''})"
        lines.append(f"{where}: {e['msg']}{shown}")
    more = len(errors) - len(lines)
    if more > 0:
        lines.append(f"(and {more} more)")
    count = len(errors)
    return (
        f"it does not match the demo report schema (version 1): {count} "
        f"problem{'s' if count != 1 else ''}",
        lines,
    )


def read_report(path: Path) -> DemoReport:
    """Read and validate the report at ``path``.

    Raises:
        ReportAbsent: no file at ``path``.
        ReportInvalid: not a regular file, unreadable, over :data:`MAX_REPORT_BYTES`, not JSON,
            or not a :class:`DemoReport`.
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError as exc:
        raise ReportAbsent(path) from exc
    except OSError as exc:
        raise ReportInvalid(path, f"it cannot be read ({exc.strerror or exc})") from exc
    if not path.is_file():
        raise ReportInvalid(path, "it is not a regular file")
    if size > MAX_REPORT_BYTES:
        raise ReportInvalid(
            path, f"it is {size} bytes, over the {MAX_REPORT_BYTES}-byte limit for a report"
        )
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:  # replaced between stat() and open()
        raise ReportAbsent(path) from exc
    except OSError as exc:
        raise ReportInvalid(path, f"it cannot be read ({exc.strerror or exc})") from exc
    if not data.strip():
        raise ReportInvalid(path, "it is empty")
    try:
        return DemoReport.model_validate_json(data)
    except ValidationError as exc:
        problem, errors = _describe(exc)
        raise ReportInvalid(path, problem, errors) from exc


def chart_points(curve: list[tuple[int, float]], limit: int = CHART_MAX_POINTS) -> list[Any]:
    """At most ``limit`` ``[step, loss]`` points of ``curve`` for the chart, in step order.

    A step trained again after a restore keeps its newest loss (the run that counts), so the
    x values are unique and sorted, as uPlot needs. Over ``limit`` points are evenly spaced,
    the first and the last always kept.
    """
    newest = {int(step): loss for step, loss in curve}
    points = [[step, newest[step]] for step in sorted(newest)]
    if len(points) <= limit:
        return points
    stride = (len(points) - 1) / (limit - 1)
    return [points[round(i * stride)] for i in range(limit)]
