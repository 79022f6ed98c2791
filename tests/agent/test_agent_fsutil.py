"""Link-proof opens (agent/fsutil.py): the agent never follows a symbolic link in the memory
folder the training ranks write, and reads only regular files there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierwatch.agent.fsutil import UnsafePathError, iter_file, open_dir, open_regular


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "mem"
    (r / "jobs" / "j" / "step-1").mkdir(parents=True)
    (r / "jobs" / "j" / "step-1" / "__0_0.distcp").write_bytes(b"shard")
    return r


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    s = tmp_path / "outside" / "secret"
    s.parent.mkdir()
    s.write_bytes(b"not for peers")
    return s


def test_a_regular_file_opens_and_reads(root: Path) -> None:
    with open_regular(root / "jobs" / "j" / "step-1" / "__0_0.distcp", root=root) as f:
        assert f.read() == b"shard"


def test_a_linked_file_is_refused(root: Path, secret: Path) -> None:
    link = root / "jobs" / "j" / "step-1" / "__1_0.distcp"
    link.symlink_to(secret)
    with pytest.raises(UnsafePathError, match="__1_0.distcp: a symbolic link"):
        open_regular(link, root=root)
    with pytest.raises(UnsafePathError, match="a symbolic link"):
        open_regular(link)  # without a root the last component is still never followed


@pytest.mark.parametrize("linked", ["jobs", "jobs/j", "jobs/j/step-1"])
def test_a_linked_folder_above_the_file_is_refused(root: Path, tmp_path: Path, linked: str) -> None:
    real = tmp_path / "elsewhere"
    (root / linked).rename(real)
    (root / linked).symlink_to(real)
    target = root / "jobs" / "j" / "step-1" / "__0_0.distcp"
    assert target.read_bytes() == b"shard"  # a plain open follows the link
    with pytest.raises(UnsafePathError, match=f"{root / linked}: a symbolic link"):
        open_regular(target, root=root)
    with pytest.raises(UnsafePathError, match="a symbolic link"):
        os.close(open_dir(root, root / "jobs" / "j" / "step-1"))


def test_a_linked_root_is_trusted(root: Path, tmp_path: Path) -> None:
    alias = tmp_path / "alias"
    alias.symlink_to(root)  # the operator's --memory-dir may itself be a link (/dev/shm)
    with open_regular(alias / "jobs" / "j" / "step-1" / "__0_0.distcp", root=alias) as f:
        assert f.read() == b"shard"


def test_a_fifo_is_refused_without_blocking(root: Path) -> None:
    fifo = root / "jobs" / "j" / "step-1" / "__2_0.distcp"
    os.mkfifo(fifo)
    # a plain open() for reading would wait for a writer forever
    with pytest.raises(UnsafePathError, match="a FIFO"):
        open_regular(fifo, root=root)


def test_a_folder_is_not_a_file_and_a_file_is_not_a_folder(root: Path) -> None:
    with pytest.raises(UnsafePathError, match="a folder"):
        open_regular(root / "jobs" / "j" / "step-1", root=root)
    with pytest.raises(UnsafePathError, match="not a folder"):
        open_dir(root, root / "jobs" / "j" / "step-1" / "__0_0.distcp")


def test_paths_outside_the_root_are_refused(root: Path, secret: Path) -> None:
    with pytest.raises(UnsafePathError, match="not under"):
        open_regular(secret, root=root)
    with pytest.raises(UnsafePathError, match=r"'\.\.'"):
        open_regular(root / "jobs" / ".." / ".." / "outside" / "secret", root=root)


def test_open_dir_creates_missing_folders_but_not_through_a_link(
    root: Path, tmp_path: Path
) -> None:
    fd = open_dir(root, root / "replicas" / "node-b" / "j" / "step-3", create=True)
    os.close(fd)
    assert (root / "replicas" / "node-b" / "j" / "step-3").is_dir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "replicas" / "node-c").symlink_to(elsewhere)
    with pytest.raises(UnsafePathError, match="node-c: a symbolic link"):
        open_dir(root, root / "replicas" / "node-c" / "j" / "step-1", create=True)
    assert list(elsewhere.iterdir()) == []  # nothing was created through the link


def test_missing_files_are_file_not_found(root: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_regular(root / "jobs" / "j" / "step-1" / "nope", root=root)
    with pytest.raises(FileNotFoundError):
        open_regular(root / "jobs" / "k" / "step-1" / "nope", root=root)


def test_iter_file_yields_at_most_size_bytes_and_closes(root: Path) -> None:
    f = open_regular(root / "jobs" / "j" / "step-1" / "__0_0.distcp", root=root)
    assert b"".join(iter_file(f, 3, chunk=2)) == b"sha"
    assert f.closed
