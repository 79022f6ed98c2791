"""DigestingWriter: the manifest digests computed while DCP writes a step equal those read
back from the files, and a stream it cannot follow records nothing (the manifest then reads
the file back)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from tierwatch.agent.checkpoint.format.manifest import digest_file, make_manifest
from tierwatch.agent.checkpoint.training.digesting_writer import (
    DigestingFileSystem,
    DigestingWriter,
)


def _state() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": 3, "tag": "x"}


@pytest.mark.parametrize("threads", [1, 2])
def test_digests_while_writing_equal_the_files_read_back(tmp_path: Path, threads: int) -> None:
    writer = DigestingWriter(tmp_path, sync_files=False, thread_count=threads)
    dcp.save(_state(), storage_writer=writer, no_dist=True)
    shards = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert shards, "dcp.save wrote no shard"
    digests = writer.digests
    for name in shards:
        assert digests[name] == digest_file(tmp_path / name), name
    # the metadata file is written under a temporary name and renamed: read back, not trusted
    assert ".metadata" not in digests
    # and the step loads as plain DCP wrote it
    back = _state()
    for t in back["model"].values():
        t.zero_()
    dcp.load(back, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(back["model"]["0.weight"], _state()["model"]["0.weight"])


def test_a_stream_that_was_sought_records_nothing(tmp_path: Path) -> None:
    fs = DigestingFileSystem()
    with fs.create_stream(tmp_path / "a.distcp", "wb") as s:
        s.write(b"hello ")
        s.write(memoryview(b"world"))
    assert fs.digests["a.distcp"] == digest_file(tmp_path / "a.distcp")
    with fs.create_stream(tmp_path / "b.distcp", "wb") as s:
        s.write(b"0123456789")
        s.seek(2)
        s.write(b"ab")
    assert "b.distcp" not in fs.digests
    # rewriting a file that was sought records it again
    with fs.create_stream(tmp_path / "b.distcp", "wb") as s:
        s.write(b"fresh")
    assert fs.digests["b.distcp"] == digest_file(tmp_path / "b.distcp")
    # reading passes through
    with fs.create_stream(tmp_path / "a.distcp", "rb") as s:
        assert s.read() == b"hello world"


def test_the_manifest_uses_known_digests_and_reads_back_the_rest(tmp_path: Path) -> None:
    for name, data in (("__0_0.distcp", b"a" * 100), ("__0_1.distcp", b"b" * 50)):
        (tmp_path / name).write_bytes(data)
    (tmp_path / ".metadata").write_bytes(b"m")
    stamp = "f" * 64
    known = {
        "__0_0.distcp": (100, "1" * 16, stamp),  # right size: taken as computed
        "__0_1.distcp": (49, "2" * 16, stamp),  # size differs from the file: read back
    }
    m = make_manifest(
        job_id="j", step=1, rank=0, world_size=1, node="n", directory=tmp_path,
        names=["__0_0.distcp", "__0_1.distcp", ".metadata"], signature="", created_at="t",
        known=known,
    )  # fmt: skip
    by = {f.name: f for f in m.files}
    assert (by["__0_0.distcp"].xxh3, by["__0_0.distcp"].sha256) == ("1" * 16, stamp)
    assert (by["__0_1.distcp"].size, by["__0_1.distcp"].xxh3, by["__0_1.distcp"].sha256) == (
        digest_file(tmp_path / "__0_1.distcp")
    )
    assert by[".metadata"].sha256 == digest_file(tmp_path / ".metadata")[2]
