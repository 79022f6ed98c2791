"""scripts/container_check.py: its pure and nearly pure pieces (the check itself, ``make
container-check``, needs root, buildah and the images, and runs outside ``make test``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import yaml

from scripts import compose_plan, container_check
from scripts.container_check import CheckFailed, Row

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
PORTS = {"server": 18000, "agent-1": 19471, "agent-2": 19472, "agent-3": 19473}
PORTS["MASTER_PORT"] = 29555
ENV = {"TIERWATCH_SECRET_KEY": "k" * 48}
UID = container_check.UID

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to uid 10001 needs root")


def _topology(workdir: Path = Path("/w"), compose=COMPOSE) -> compose_plan.Topology:
    return compose_plan.plan(compose, env=ENV, ports=PORTS, database_url="db", workdir=workdir)


def _private(path: Path, *, mode: int = 0o600, uid: int = UID, text: str = "t0ken\n") -> Path:
    path.write_text(text)
    path.chmod(mode)
    if os.geteuid() == 0:
        os.chown(path, uid, uid)
    return path


# --- the bootstrap's token files and the job credential ----------------------------------------


@needs_root
def test_token_files_private_to_uid_10001_pass(tmp_path) -> None:
    for node in container_check.NODES:
        _private(tmp_path / f"{node}.token")
    got = container_check.tokens_written(tmp_path)
    assert got == "node-1.token, node-2.token, node-3.token: mode 0600, uid 10001"
    # the mode reported is the one seen, not a fixed string
    (tmp_path / "node-2.token").chmod(0o400)
    assert "mode 0400, 0600" in container_check.tokens_written(tmp_path)


@needs_root
@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"mode": 0o644}, "mode 0644, uid 10001"),
        ({"mode": 0o640}, "mode 0640"),
        ({"uid": 0}, "mode 0600, uid 0"),
        ({"text": ""}, "size 0"),
    ],
    ids=["world-readable", "group-readable", "root-owned", "empty"],
)
def test_a_token_file_others_can_read_or_root_owns_is_refused(tmp_path, change, says) -> None:
    for node in container_check.NODES:
        _private(tmp_path / f"{node}.token", **(change if node == "node-2" else {}))
    with pytest.raises(CheckFailed, match=rf"node-2\.token: file, .*{says}"):
        container_check.tokens_written(tmp_path)


@needs_root
def test_a_missing_or_linked_token_file_is_refused(tmp_path) -> None:
    _private(tmp_path / "node-1.token")
    _private(tmp_path / "node-3.token")
    with pytest.raises(FileNotFoundError):
        container_check.tokens_written(tmp_path)
    # a link to a private file is not the file the bootstrap writes
    (tmp_path / "node-2.token").symlink_to(tmp_path / "node-1.token")
    with pytest.raises(CheckFailed, match="node-2.token: not a regular file"):
        container_check.tokens_written(tmp_path)


@needs_root
def test_the_job_credential_file(tmp_path) -> None:
    f = _private(tmp_path / "gpt-compose.credential")
    assert container_check.credential_written(tmp_path) == (
        "gpt-compose.credential: mode 0600, uid 10001"
    )
    f.chmod(0o604)
    with pytest.raises(CheckFailed, match="mode 0604"):
        container_check.credential_written(tmp_path)


# --- the table -----------------------------------------------------------------------------------


def test_the_table_renders_a_failed_row_and_escapes_pipes() -> None:
    rows = [
        Row("server health check", True, "exits 0", 3.2),
        Row("a | b", False, "CheckFailed: x | y\nsecond line " + "z" * 400, 12.6),
    ]
    meta = {"when": "2026-01-01 00:00 UTC", "builder": "buildah 1", "images": "`i:dev`"}
    text = container_check.table(rows, meta)
    assert "1 of 2 checks passed." in text
    lines = text.splitlines()
    assert "| server health check | pass | exits 0 | 3 |" in lines
    failed = next(ln for ln in lines if ln.startswith("| a "))
    assert failed.startswith(r"| a \| b | FAIL | CheckFailed: x \| y second line zzz")
    assert failed.endswith(" | 13 |")
    # an escaped pipe is not a cell border: 5 borders, as in the header
    assert failed.replace(r"\|", "").count("|") == lines[2].count("|") == 5
    assert len(failed) < 300 + 40  # the detail is cut at 300 characters
    assert "What this did not exercise:" in text


# --- wait_for ---------------------------------------------------------------------------------


def test_wait_for_returns_the_first_truthy_value() -> None:
    answers = iter([None, 0, {"ok": 1}])
    assert container_check.wait_for("x", lambda: next(answers), 5, every_s=0) == {"ok": 1}


def test_wait_for_raises_check_failed_with_the_last_value() -> None:
    seen = iter(range(10**6))
    with pytest.raises(CheckFailed, match=r"nodes healthy: not within 0\.05 s \(last: \[\]\)"):
        container_check.wait_for("nodes healthy", lambda: [] if next(seen) else None, 0.05, 0.01)


def test_wait_for_reports_the_last_error() -> None:
    def probe():
        raise ConnectionError("refused")

    with pytest.raises(CheckFailed, match=r"last: ConnectionError: refused"):
        container_check.wait_for("server", probe, 0.03, every_s=0.01)


# --- the plan against what run_checks does ------------------------------------------------------


def test_the_check_follows_docker_compose_yml() -> None:
    assert container_check.plan_problems(_topology()) == []


def test_a_changed_dependency_an_extra_service_or_no_command_is_refused() -> None:
    t = _topology()
    t.service("trainer-2").depends_on.pop("agent-3")
    t.service("bootstrap").command = []
    t.services.append(compose_plan.Service("extra", "x:dev", ["run"], {}))
    problems = container_check.plan_problems(t)
    assert problems[0].endswith("missing [], extra ['extra']")
    assert any(p.startswith("trainer-2: depends_on {") for p in problems)
    assert "bootstrap: no command: in the compose file" in problems
    assert len(problems) == 3


@pytest.mark.parametrize(
    ("policy", "rc", "again"),
    [
        ("no", 1, False),
        ("on-failure", 0, False),
        ("on-failure", -9, True),
        ("on-failure:3", 1, True),
        ("unless-stopped", 0, True),
        ("always", 0, True),
    ],
)
def test_restart_policies(policy, rc, again) -> None:
    assert container_check.restarts(policy, rc) is again


def test_free_ports_are_distinct() -> None:
    names = [f"s{i}" for i in range(20)]
    ports = container_check.free_ports(names)
    assert list(ports) == names
    assert len(set(ports.values())) == 20
    assert all(1024 < p < 65536 for p in ports.values())


def test_stale_runs_finds_an_earlier_checks_buildah_run_only(tmp_path) -> None:
    def proc(pid: int, *argv: str) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")

    proc(41, "buildah", "--storage-driver", "vfs", "run", "--isolation", "chroot",
         "tierwatch-check-agent-1", "--", "tierwatch-entrypoint")  # fmt: skip
    proc(7, "/usr/bin/buildah", "run", "tierwatch-check-server", "--", "x")
    proc(8, "buildah", "from", "--name", "tierwatch-check-server", "img")  # not a run
    proc(9, "buildah", "run", "other-container", "--", "x")
    proc(10, "python", "run", "tierwatch-check-server")
    (tmp_path / "11").mkdir()  # gone: no cmdline
    (tmp_path / "self").mkdir()
    assert container_check.stale_runs(tmp_path) == [7, 41]


def test_mounts_under_the_work_folder_deepest_first(monkeypatch) -> None:
    table = {
        "/r/var/container-check": "tmpfs",
        "/r/var/container-check/volumes/memory-node-1": "tmpfs",
        "/r/var/container-check-other": "tmpfs",
        "/": "ext4",
    }
    monkeypatch.setattr(container_check, "mount_table", lambda: table)
    assert container_check._mounted_under(Path("/r/var/container-check")) == [
        "/r/var/container-check/volumes/memory-node-1",
        "/r/var/container-check",
    ]


def test_sigterm_ends_the_check_through_its_cleanup() -> None:
    with pytest.raises(SystemExit) as exc:
        container_check._exit_on_signal(signal.SIGTERM, None)
    assert exc.value.code == 143


# --- the volumes at the end ----------------------------------------------------------------------


def _volumes(tmp_path: Path) -> tuple[Path, compose_plan.Topology, dict[str, str]]:
    t = _topology(tmp_path)
    vols = tmp_path / "volumes"
    for x in t.tmpfs:
        (x.host / "ckpt").mkdir(parents=True)
        _private(x.host / "ckpt" / "shard.bin")
    for p in [vols, *vols.rglob("*")]:
        os.chown(p, UID, UID)
    return vols, t, {str(x.host): "tmpfs" for x in t.tmpfs}


@needs_root
def test_volumes_owned_passes_for_tmpfs_tiers_holding_uid_10001_files(tmp_path) -> None:
    vols, t, mounts = _volumes(tmp_path)
    got = container_check.volumes_owned(vols, t, mounts)
    assert got == "3 tmpfs mounts; 9 files and folders, 3 in memory tiers"


@needs_root
def test_volumes_owned_fails_for_a_root_file_a_plain_folder_or_an_empty_tier(tmp_path) -> None:
    vols, t, mounts = _volumes(tmp_path)
    (vols / "memory-node-2" / "ckpt" / "root.bin").write_text("x")
    with pytest.raises(CheckFailed, match=r"root\.bin belongs to uid 0"):
        container_check.volumes_owned(vols, t, mounts)
    (vols / "memory-node-2" / "ckpt" / "root.bin").unlink()
    with pytest.raises(CheckFailed, match="memory-node-3 is not a tmpfs mount"):
        container_check.volumes_owned(vols, t, {**mounts, str(vols / "memory-node-3"): "ext4"})
    # a tier nothing was written into: the containers wrote elsewhere (e.g. under the mount)
    (vols / "memory-node-1" / "ckpt" / "shard.bin").unlink()
    with pytest.raises(CheckFailed, match="memory-node-1: no file in this tmpfs"):
        container_check.volumes_owned(vols, t, mounts)
