"""The README stays true to the code.

- Configuration: every ``TIERWATCH_*`` variable that a pydantic-settings class reads (fields
  walked programmatically, nested models with the class's ``env_nested_delimiter``, the env
  prefix from ``model_config``) or that the code names (a grep of app/ agent/ tierwatch/
  examples/ scripts/ demo/) is in one of the README's configuration tables, and every
  variable the README names still exists somewhere. The server and agent tables show each
  setting's default the way :func:`render_default` writes it.
- The ``TieredCheckpointer`` block runs as written against a real agent (twice: the second
  run restores the first one's last step).
- The REST ``curl`` lines run as written against a real server.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from pydantic_settings import BaseSettings

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# where the programs live: every variable named here must be documented
CODE_DIRS = ("app", "agent", "tierwatch", "examples", "scripts", "demo")
# where else a variable may legitimately come from (tests, benchmarks, CI, deployment files)
OTHER_PATHS = ("tests", "bench", ".ci", "docker", "deploy", "Makefile", "docker-compose.yml")
VAR_RE = re.compile(r"TIERWATCH_[A-Z0-9_]+")
CONFIG_HEADING = "## Configuration"
SNIPPET_HEADING = "## Using TieredCheckpointer in your own training loop"
REST_HEADING = "## REST API"
# shell variables of the README's examples, not settings
EXAMPLE_VARS = {"TIERWATCH_URL"}


# -- README parsing ------------------------------------------------------------------------


def readme() -> str:
    return README.read_text(encoding="utf-8")


def section(heading: str) -> str:
    """The text under a ``## `` heading, up to the next ``## `` heading."""
    text = readme()
    start = text.find("\n" + heading + "\n")
    assert start >= 0, f"README.md has no section {heading!r}"
    rest = text[start + len(heading) + 2 :]
    end = re.search(r"^## ", rest, flags=re.MULTILINE)
    return rest[: end.start()] if end else rest


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def names_in(text: str) -> set[str]:
    """``TIERWATCH_*`` names in ``text``; prefixes such as ``TIERWATCH_HEALTH__`` (in
    ``TIERWATCH_HEALTH__*`` or an f-string) are not variables and are left out."""
    return {m for m in VAR_RE.findall(text) if not m.endswith("_")}


@dataclass(frozen=True)
class Row:
    table: str  # the ### heading above the table
    cells: tuple[str, ...]

    @property
    def names(self) -> set[str]:
        return names_in(self.cells[0])

    @property
    def default(self) -> str | None:
        """The first `code` span of the default column."""
        m = re.search(r"`([^`]*)`", self.cells[1]) if len(self.cells) > 1 else None
        return m.group(1) if m else None

    @property
    def options(self) -> set[str]:
        return set(re.findall(r"`(--[a-z0-9-]+)`", self.cells[0]))


def config_rows() -> list[Row]:
    """Body rows of every table in the Configuration section, with their ### heading."""
    rows: list[Row] = []
    table = ""
    for line in section(CONFIG_HEADING).splitlines():
        if line.startswith("### "):
            table = line[4:].strip()
        elif line.startswith("|") and table:
            cells = tuple(c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1])
            if set("".join(cells)) <= set("-: ") or cells[0] in ("variable", "option / variable"):
                continue  # separator or header row
            rows.append(Row(table, cells))
    return rows


# -- the code's variables ------------------------------------------------------------------


def render_default(value: Any) -> str:
    """A default as the README's tables write it: ``none``, ``1``/``0`` for booleans,
    integral floats without ``.0``, JSON (compact) for lists and dicts, ``""`` for ""."""

    def plain(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        return v

    if value is None:
        return "none"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, list | tuple | dict):
        return json.dumps(plain(value), separators=(",", ":"))
    if value == "":
        return '""'
    return str(plain(value))


def settings_classes() -> list[type[BaseSettings]]:
    """Every pydantic-settings class in tierwatch.server and tierwatch.agent (all their
    modules imported)."""
    for pkg_name in ("tierwatch.server", "tierwatch.agent"):
        pkg = importlib.import_module(pkg_name)
        for info in pkgutil.walk_packages(pkg.__path__, pkg_name + "."):
            importlib.import_module(info.name)
    found: list[type[BaseSettings]] = []
    todo = list(BaseSettings.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith("tierwatch."):
            found.append(cls)
    return found


def settings_env(cls: type[BaseModel], prefix: str, delimiter: str | None) -> dict[str, Any]:
    """Environment variable → default for every field (nested models with ``delimiter``)."""
    out: dict[str, Any] = {}
    for name, field in cls.model_fields.items():
        ann = field.annotation
        if delimiter and isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(settings_env(ann, f"{prefix}{name}{delimiter}".upper(), delimiter))
        else:
            out[f"{prefix}{name}".upper()] = field.get_default(call_default_factory=True)
    return out


def table_kind(cls: type[BaseSettings]) -> str:
    """The README table (by heading prefix) that documents a settings class."""
    if cls.__module__.startswith("tierwatch.server."):
        return "Server"
    if cls.__module__.startswith("tierwatch.agent."):
        return "Agent"
    raise AssertionError(f"{cls.__module__}.{cls.__name__}: no README table for this class")


def settings_by_table() -> dict[str, dict[str, Any]]:
    tables: dict[str, dict[str, Any]] = {}
    classes = settings_classes()
    assert {c.__name__ for c in classes} >= {"Settings", "AgentSettings"}
    for cls in classes:
        cfg = cls.model_config
        env = settings_env(cls, cfg.get("env_prefix", ""), cfg.get("env_nested_delimiter"))
        tables.setdefault(table_kind(cls), {}).update(env)
    return tables


def grep(paths: tuple[str, ...]) -> set[str]:
    found: set[str] = set()
    for rel in paths:
        root = REPO / rel
        files = [root] if root.is_file() else root.rglob("*") if root.is_dir() else []
        for path in files:
            if not path.is_file() or "__pycache__" in path.parts or path == Path(__file__):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            found |= names_in(text)
    return found


# -- configuration tests -------------------------------------------------------------------


def test_configuration_tables_list_every_variable_and_nothing_else() -> None:
    settings = settings_by_table()
    required = set().union(*settings.values()) | grep(CODE_DIRS)
    documented = set().union(*(row.names for row in config_rows()))
    known = required | grep(OTHER_PATHS) | EXAMPLE_VARS
    mentioned = names_in(readme())

    missing = sorted(required - documented)
    stale = sorted(mentioned - known)
    problems = []
    if missing:
        problems.append(
            "variables the code reads but README.md's configuration tables lack: "
            + ", ".join(missing)
        )
    if stale:
        problems.append("variables README.md names that no longer exist: " + ", ".join(stale))
    assert not problems, "\n".join(problems)


def test_settings_tables_show_the_code_defaults() -> None:
    settings = settings_by_table()
    problems = []
    for row in config_rows():
        kind = next((k for k in settings if row.table.startswith(k)), None)
        if kind is None:
            continue
        for name in sorted(row.names):
            if name not in settings[kind]:
                problems.append(f"{name} (table {row.table!r}) is not a {kind} setting")
                continue
            want = render_default(settings[kind][name])
            if row.default != want:
                problems.append(f"{name}: README default {row.default!r}, code {want!r}")
    for kind, env in settings.items():  # each setting sits in its own class's tables
        rows = [r for r in config_rows() if r.table.startswith(kind)]
        for name in sorted(set(env) - set().union(*(r.names for r in rows))):
            problems.append(f"{name} is missing from the {kind} tables")
    assert not problems, "\n".join(problems)


def test_agent_table_options_are_the_run_options() -> None:
    from tierwatch.agent import cli
    from tierwatch.agent.config import AgentSettings

    params = set(inspect.signature(cli.run).parameters)
    rows = {
        name: row for row in config_rows() if row.table.startswith("Agent") for name in row.names
    }
    problems = []
    for field in AgentSettings.model_fields:
        row = rows.get(f"TIERWATCH_{field.upper()}")
        if row is None:
            problems.append(f"TIERWATCH_{field.upper()} is missing from the Agent table")
            continue
        option = "--" + field.replace("_", "-")
        want = {option} if field in params else set()
        if row.options != want:
            problems.append(
                f"TIERWATCH_{field.upper()}: README options {sorted(row.options)}, "
                f"`tierwatch-agent run` has {sorted(want) or 'none'}"
            )
    assert not problems, "\n".join(problems)


def test_render_default_is_the_tables_notation() -> None:
    assert [
        render_default(v)
        for v in (None, True, False, 86400.0, 1.5, 8, "", "json", ["A", "B"], {"xid": 3600.0})
    ] == ["none", "1", "0", "86400", "1.5", "8", '""', "json", '["A","B"]', '{"xid":3600}']


# -- the training-loop snippet -------------------------------------------------------------

RUNNER = """\
import json, sys
ns = {"__name__": "__readme__"}
exec(compile(open(sys.argv[1]).read(), "README.md", "exec"), ns)
params = [p.detach().flatten().tolist() for p in ns["model"].parameters()]
print("RESULT " + json.dumps({"last": ns["last"], "step": ns["step"], "params": params}))
"""


def snippet() -> str:
    blocks = code_blocks(section(SNIPPET_HEADING), "python")
    assert blocks, f"no ```python block under {SNIPPET_HEADING!r}"
    return blocks[0]


@pytest.mark.e2e
@pytest.mark.slow
def test_training_loop_snippet_runs_as_written(tmp_path: Path) -> None:
    from procs import base_env, wait_for
    from training import committed_steps, start_cluster

    code, runner = tmp_path / "snippet.py", tmp_path / "runner.py"
    code.write_text(snippet())
    runner.write_text(RUNNER)
    cluster = start_cluster(tmp_path / "cluster", with_server=False)
    try:
        node = cluster.add_node("node-a")
        env = base_env(
            TIERWATCH_AGENT_URL=node.url,
            OMP_NUM_THREADS="1",
            # what the launcher hands every rank once the job is registered on its nodes
            TIERWATCH_JOB_CREDENTIAL=cluster.job_credential("my-job", ["node-a"]),
        )

        def run() -> dict[str, Any]:
            out = subprocess.run(
                [sys.executable, str(runner), str(code)],
                env=env,
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
            line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
            return json.loads(line.removeprefix("RESULT "))

        first = run()
        assert first["last"] is None
        assert first["step"] == 100
        assert committed_steps(node, "my-job", 0)[-1] == 99
        persisted = cluster.persistent_dir / "my-job" / "step-90" / ".metadata"
        wait_for(persisted.exists, timeout=120, what=f"{persisted} (persist_every=10)")

        second = run()  # a restart: restores step 99 and has nothing left to train
        assert second["last"] == 99
        assert second["step"] == 100
        assert second["params"] == first["params"], "restored model differs from the saved one"
    finally:
        cluster.stop()


# -- the REST examples ---------------------------------------------------------------------

JOB, SICK, OTHER = "llm-7b", "gpu-017", "gpu-018"


def curl_lines() -> list[str]:
    """The README's curl commands (continuation lines joined), in order."""
    lines: list[str] = []
    for block in code_blocks(section(REST_HEADING), "sh"):
        for cmd in block.replace("\\\n", " ").splitlines():
            if cmd.strip().startswith("curl "):
                lines.append(cmd.strip())
    return lines


def seed(server_url: str, token_for) -> None:  # noqa: ANN001 - Server.token
    """gpu-017 reports XID 79 (unhealthy); a 2-rank job on gpu-017/gpu-018 has step 1200
    complete in memory and is at step 1250."""
    from support import auth, make_batch, register_job

    from tierwatch.agent.protocol import CheckpointEvent, JobProgress, utcnow

    register_job(server_url, JOB, [SICK, OTHER], token=token_for("operator"))
    now = utcnow()
    for rank, node in enumerate((SICK, OTHER)):
        # interval_s: one report each, which must not turn unreachable during the test
        batch = make_batch(
            node, 1, gpus=8, interval_s=600, xids=[(3, 79)] if node == SICK else None
        )
        batch = batch.model_copy(
            update={
                "progress": [
                    JobProgress(
                        job_id=JOB,
                        rank=rank,
                        world_size=2,
                        step=1250,
                        ts=now,
                        layout=[SICK, OTHER] if rank == 0 else None,
                    )
                ],
                "checkpoint_events": [
                    CheckpointEvent(
                        job_id=JOB,
                        step=step,
                        tier="memory",
                        kind="committed",
                        rank=rank,
                        world_size=2,
                        ts=now,
                        bytes=1 << 20,
                        seconds=0.5,
                    )
                    for step in (1200, 1250)
                ],
            }
        )
        r = httpx.post(
            f"{server_url}/api/v1/ingest/report",
            content=batch.model_dump_json(),
            headers={**auth(token_for("agent", node)), "Content-Type": "application/json"},
            timeout=10,
        )
        assert r.status_code == 200, r.text


@pytest.mark.e2e
def test_rest_examples_run_against_a_real_server(tmp_path: Path) -> None:
    from procs import base_env, make_server

    lines = curl_lines()
    wanted = {
        "list unhealthy": "nodes?state=unhealthy",
        "isolate": "/isolate",
        "restore": '/restore"',
    }
    for what, needle in wanted.items():
        assert any(needle in ln for ln in lines), f"README's REST API has no {what} example"

    server = make_server(tmp_path / "server", f"sqlite:///{tmp_path / 'tierwatch.db'}")
    server.start()
    try:
        seed(server.url, server.token)
        env = base_env(
            TIERWATCH_URL=server.url,
            TOKEN=server.token("operator"),
            PATH=os.environ.get("PATH", "/usr/bin:/bin"),
        )
        answers = []
        for line in lines:
            cmd = line.replace("curl ", "curl -sS -w '\\n%{http_code}' ", 1)
            out = subprocess.run(
                ["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=30
            )
            assert out.returncode == 0, f"{line}\n{out.stderr}"
            body, _, code = out.stdout.rpartition("\n")
            assert code.startswith("2"), f"{line}\nHTTP {code}: {body}"
            answers.append((line, json.loads(body)))
    finally:
        server.stop()

    for line, body in answers:
        if "nodes?state=unhealthy" in line:
            assert [n["name"] for n in body["nodes"]] == [SICK], body
            assert any("XID 79" in r["message"] for r in body["nodes"][0]["reasons"]), body
        elif line.split('"')[-2].endswith("/isolate"):
            assert body["changed"] is True, body
            assert body["node"]["isolated"] is True, body
        elif line.split('"')[-2].endswith("/release"):
            assert body["changed"] is True, body
            assert body["node"]["isolated"] is False, body
        elif line.split('"')[-2].endswith(f"/jobs/{JOB}/restore"):
            assert body["job_id"] == JOB, body
            assert body["step"] == 1200, body
            assert body["state"] == "running", body
        elif line.split('"')[-2].endswith("/restores"):
            assert [r["step"] for r in body] == [1200], body
