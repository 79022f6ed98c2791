"""``tierwatch-agent ckpt ls|verify|export|gc`` on memory folders written like the trainer's."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from ckpt_helpers import write_job, write_step
from procs import BIN, base_env

from tierwatch.agent.checkpoint.format.layout import METADATA, manifest_name, shard_name
from tierwatch.agent.checkpoint.format.manifest import load_manifest, verify_file

JOB = "job-cli"
NODE = "node-a"


def ckpt(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "tierwatch-agent"), "ckpt", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=base_env(**(env or {})),
    )


@pytest.fixture
def place(tmp_path: Path) -> tuple[Path, Path]:
    """A memory folder with steps 1 and 2 complete (world 2 on one node), step 3 torn (rank
    1 only wrote its shard), and step 2 also on the persistent tier."""
    mem, pers = tmp_path / "mem", tmp_path / "pers"
    for step in (1, 2):
        write_step(mem, job_id=JOB, step=step, node=NODE, layout=[NODE, NODE], seed=step)
    write_step(mem, job_id=JOB, step=3, node=NODE, layout=[NODE, "node-b"], commit=False)
    src = mem / "jobs" / JOB / "step-2"
    dst = pers / JOB / "step-2"
    dst.mkdir(parents=True)
    for name in (shard_name(0), shard_name(1), manifest_name(0), manifest_name(1), METADATA):
        shutil.copy(src / name, dst / name)
    return mem, pers


def opts(place: tuple[Path, Path]) -> list[str]:
    mem, pers = place
    return ["--memory-dir", str(mem), "--persistent-url", f"file://{pers}"]


def test_ls_lists_steps_per_tier(place):
    out = ckpt("ls", "--job", JOB, *opts(place))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    row = {
        (ln.split("│")[1].strip(), ln.split("│")[3].strip()): ln
        for ln in lines
        if ln.count("│") >= 7
    }
    assert "yes" in row[("memory", "1")]
    assert "0-1" in row[("memory", "2")]
    assert "yes" in row[("persistent", "2")]
    assert "no manifest of rank(s) [1]" in row[("memory", "3")]
    one = ckpt("ls", "--job", JOB, "--step", "2", *opts(place))
    assert "persistent" in one.stdout
    assert "│ 1 " not in one.stdout


def test_ls_orders_persistent_steps_by_number(place):
    """step-10 comes after step-9, not between step-1 and step-2 as its URL sorts."""
    mem, pers = place
    src = pers / JOB / "step-2"
    for step in (9, 10):
        shutil.copytree(src, pers / JOB / f"step-{step}")
    out = ckpt("ls", "--job", JOB, *opts(place))
    assert out.returncode == 0, out.stderr
    steps = [
        int(ln.split("│")[3].strip())
        for ln in out.stdout.splitlines()
        if ln.count("│") >= 7 and ln.split("│")[1].strip() == "persistent"
    ]
    assert steps == [2, 9, 10]


def test_ls_env_and_bad_input(place):
    mem, pers = place
    env = {"TIERWATCH_MEMORY_DIR": str(mem), "TIERWATCH_PERSISTENT_URL": f"file://{pers}"}
    assert ckpt("ls", "--job", JOB, env=env).returncode == 0
    for args, needle in (
        (["ls"], "--job is required"),
        (["ls", "--job", "../etc"], "job_id"),
        (["ls", "--job", "nope", *opts(place)], "no job nope"),
        (["ls", "--job", JOB, "--step", "99", *opts(place)], "no step 99"),
        (["ls", "--job", JOB, "--persistent-url", "file:///x"], "--memory-dir"),
        (["verify", "--job", JOB, "--step", "-1", *opts(place)], "step"),
    ):
        out = ckpt(*args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert needle in out.stderr, (args, out.stderr)


def test_verify_finds_bad_files(place):
    mem, _ = place
    out = ckpt("verify", "--job", JOB, *opts(place))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok   persistent" in out.stdout
    assert "ok   memory (this node) step 1: 3 file(s)" in out.stdout
    shard = mem / "jobs" / JOB / "step-1" / shard_name(1)
    data = bytearray(shard.read_bytes())
    data[7] ^= 1
    shard.write_bytes(bytes(data))
    (mem / "jobs" / JOB / "step-2" / shard_name(0)).write_bytes(b"")
    out = ckpt("verify", "--job", JOB, *opts(place))
    assert out.returncode == 1
    bad = [ln for ln in out.stdout.splitlines() if ln.startswith("BAD")]
    assert len(bad) == 2
    assert "step 1" in bad[0]
    assert shard_name(1) in bad[0]
    assert "checksum" in bad[0]
    assert f"{shard_name(0)}: size 0 bytes" in bad[1]


def test_export_prefers_persistent_and_checks_every_file(place, tmp_path):
    dest = tmp_path / "out"
    out = ckpt("export", "--job", JOB, "--to", str(dest), *opts(place))
    assert out.returncode == 0, out.stderr
    assert "exported step 2" in out.stdout
    assert "from persistent" in out.stdout
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        [METADATA, shard_name(0), shard_name(1), manifest_name(0), manifest_name(1)]
    )
    for r in (0, 1):
        for f in load_manifest(dest / manifest_name(r)).files:
            assert verify_file(dest / f.name, f) is None
    # step 1 only in memory: exported from there
    dest1 = tmp_path / "out1"
    out = ckpt("export", "--job", JOB, "--step", "1", "--to", str(dest1), *opts(place))
    assert out.returncode == 0, out.stderr
    assert "from memory" in out.stdout
    # bad input
    again = ckpt("export", "--job", JOB, "--to", str(dest), *opts(place))
    assert again.returncode == 2
    assert "not an empty folder" in again.stderr
    torn = ckpt("export", "--job", JOB, "--step", "3", "--to", str(tmp_path / "o3"), *opts(place))
    assert torn.returncode == 2
    assert "no complete step 3" in torn.stderr
    assert ckpt("export", "--job", JOB, *opts(place)).returncode == 2


def test_export_refuses_a_corrupt_copy(place, tmp_path):
    _, pers = place
    (pers / JOB / "step-2" / shard_name(1)).write_bytes(b"garbage")
    dest = tmp_path / "out"
    out = ckpt("export", "--job", JOB, "--to", str(dest), *opts(place))
    assert out.returncode == 1
    assert shard_name(1) in out.stderr
    assert not (dest / METADATA).exists()


def test_gc_removes_a_job_and_finished_jobs(place, tmp_path):
    mem, _ = place
    write_step(mem, job_id="done-job", step=1, node=NODE, layout=[NODE])
    write_job(mem, "done-job", [NODE], finished=True)
    replica = mem / "replicas" / "node-b" / JOB / "step-1"
    replica.mkdir(parents=True)
    (replica / shard_name(2)).write_bytes(b"x")
    (mem / "replicas" / "node-b" / "done-job").mkdir()
    out = ckpt("gc", "--finished", "--memory-dir", str(mem))
    assert out.returncode == 0, out.stderr
    assert not (mem / "jobs" / "done-job").exists()
    assert not (mem / "replicas" / "node-b" / "done-job").exists()
    assert (mem / "jobs" / JOB).exists()  # not finished
    out = ckpt("gc", "--job", JOB, "--memory-dir", str(mem))
    assert out.returncode == 0, out.stderr
    assert not (mem / "jobs" / JOB).exists()
    assert not replica.exists()
    assert "nothing to remove" in ckpt("gc", "--job", JOB, "--memory-dir", str(mem)).stdout
    bad = ckpt("gc", "--memory-dir", str(mem))
    assert bad.returncode == 2
    assert "--job J or --finished" in bad.stderr


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("world_size", 3, "disagree"),
        ("signature", "another-model", "disagree"),
        ("save_id", "f" * 32, "saves of this step"),  # each file verifies; the ranks' saves differ
    ],
)
def test_verify_reports_a_step_of_two_checkpoints_as_bad(place, field, value, said):
    _, pers = place
    path = pers / JOB / "step-2" / manifest_name(1)
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    out = ckpt("verify", "--job", JOB, "--step", "2", *opts(place))
    assert out.returncode == 1, out.stdout + out.stderr
    bad = [ln for ln in out.stdout.splitlines() if ln.startswith("BAD  persistent")]
    assert bad, out.stdout
    assert said in bad[0]
    assert not [ln for ln in out.stdout.splitlines() if ln.startswith("ok   persistent")]
    ls = ckpt("ls", "--job", JOB, "--step", "2", *opts(place))
    assert said in ls.stdout


@pytest.mark.parametrize("dest", ["/proc/nope", "FILE/sub", "/proc/self/status"])
def test_export_to_an_unusable_destination_is_one_error_line(place, tmp_path, dest):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    dest = dest.replace("FILE", str(blocker))
    out = ckpt("export", "--job", JOB, "--to", dest, *opts(place))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: --to ")


@pytest.mark.parametrize("cmd", ["ls", "verify", "export", "gc"])
def test_an_os_error_in_a_command_is_one_error_line(place, tmp_path, monkeypatch, cmd):
    from typer.testing import CliRunner

    from tierwatch.agent.checkpoint.tierstore import cli as ckpt_cli

    def unreadable(*_a, **_k):
        raise PermissionError(13, "Permission denied", str(tmp_path / "mem" / "jobs"))

    monkeypatch.setattr(ckpt_cli.Place, "copies", unreadable)
    monkeypatch.setattr(ckpt_cli.MemoryLayout, "jobs", unreadable)
    args = [cmd, "--job", JOB, *opts(place)]
    if cmd == "export":
        args += ["--to", str(tmp_path / "out")]
    if cmd == "gc":
        args = ["gc", "--finished", "--memory-dir", str(place[0])]
    out = CliRunner().invoke(ckpt_cli.app, args)
    assert out.exit_code == 2, out.output
    assert out.exception is None or isinstance(out.exception, SystemExit)
    assert "error: " in out.output
    assert "Permission denied" in out.output


def test_ls_warns_about_a_missing_memory_folder(tmp_path):
    out = ckpt(
        "ls",
        "--job",
        JOB,
        "--memory-dir",
        str(tmp_path / "nonexistent"),
        "--persistent-url",
        f"file://{tmp_path / 'p'}",
    )
    assert out.returncode == 2
    assert "warning: memory folder" in out.stderr
    assert "does not exist" in out.stderr


def test_help_texts_show_each_env_var_once_and_export_step_default():
    for cmd in ("ls", "verify", "export", "gc"):
        out = ckpt(cmd, "--help", env={"COLUMNS": "200", "TERM": "dumb"})
        assert out.returncode == 0, out.stderr
        for var in ("TIERWATCH_MEMORY_DIR", "TIERWATCH_NODE"):
            assert out.stdout.count(var) == 1, (cmd, out.stdout)
        if cmd != "gc":
            assert out.stdout.count("TIERWATCH_PERSISTENT_URL") == 1, (cmd, out.stdout)
    out = ckpt("export", "--help", env={"COLUMNS": "200"})
    assert "newest complete step" in out.stdout
    assert "default: all" not in out.stdout
