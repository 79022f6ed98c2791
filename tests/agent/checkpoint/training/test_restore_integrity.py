"""A restore loads only steps its own job wrote: signed manifests, SHA-256 per file, checked
before DCP unpickles ``.metadata`` or reads a shard (one training process, a real agent)."""

from __future__ import annotations

import json
import pickle
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from agent_helpers import AUTHORITY
from torch import nn
from training import start_cluster

from tierwatch import RNGState, TieredCheckpointer
from tierwatch.agent.checkpoint.format.layout import step_dirname
from tierwatch.agent.checkpoint.format.manifest import Manifest, manifest_mac
from tierwatch.agent.credentials import manifest_key_of
from tierwatch.agent.protocol import CheckpointEvent

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    cluster = start_cluster(tmp_path_factory.mktemp("ckpt-integrity"), with_server=False)
    node = cluster.add_node("integrity-node")
    yield node
    cluster.stop()


def checkpointer(node, job: str) -> TieredCheckpointer:
    return TieredCheckpointer(
        job, node.url, latency_every=0, job_credential=AUTHORITY.job_credential(job)
    )


def save_two_steps(node, job: str) -> tuple[Path, dict[int, torch.Tensor]]:
    """Steps 0 and 1 of ``{"w": ...}``, committed; returns the job folder and the values."""
    ckpt = checkpointer(node, job)
    values = {}
    for step in (0, 1):
        w = torch.full((1024,), float(step + 1))
        values[step] = w.clone()
        ckpt.save(step, {"w": w})
        assert ckpt.wait() is True
    ckpt.close()
    return ckpt.job_dir, values


def restore_recording(node, job: str) -> tuple[int | None, torch.Tensor, list[CheckpointEvent]]:
    """Restore ``job`` into a fresh ``{"w"}``; the step, the value and the events sent."""
    again = checkpointer(node, job)
    events: list[CheckpointEvent] = []
    send = again.events.event
    again.events.event = lambda e: (events.append(e), send(e))[1]  # type: ignore[method-assign]
    loaded = {"w": torch.zeros(1024)}
    try:
        step = again.restore(loaded)
    finally:
        again.close()
    return step, loaded["w"], events


def rewrite(step_dir: Path, name: str, data: bytes, *, manifest_name: str = "manifest-0.json"):
    """Replace ``name`` with ``data`` and update the manifest's size and xxh3 to match (what a
    sender who controls both can do), leaving its SHA-256 and signature as they were."""
    (step_dir / name).write_bytes(data)
    manifest = json.loads((step_dir / manifest_name).read_text())
    for f in manifest["files"]:
        if f["name"] == name:
            f["size"] = len(data)
            f["xxh3"] = xxhash.xxh3_64(data).hexdigest()
    (step_dir / manifest_name).write_text(json.dumps(manifest))
    return manifest


def shard_name(step_dir: Path) -> str:
    return sorted(p.name for p in step_dir.glob("__0_*.distcp") if p.stat().st_size)[0]


def tamper_shard(step_dir: Path) -> None:
    name = shard_name(step_dir)
    data = bytearray((step_dir / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    rewrite(step_dir, name, bytes(data))


def resign(step_dir: Path, key: bytes, *, with_digests: bool) -> None:
    """Sign step_dir's manifest with ``key`` (after updating its SHA-256s, or not)."""
    import hashlib

    manifest = Manifest.model_validate_json((step_dir / "manifest-0.json").read_text())
    files = [
        f.model_copy(
            update={"sha256": hashlib.sha256((step_dir / f.name).read_bytes()).hexdigest()}
        )
        if with_digests
        else f
        for f in manifest.files
    ]
    manifest = manifest.model_copy(update={"files": files, "mac": ""})
    manifest = manifest.model_copy(update={"mac": manifest_mac(manifest, key)})
    (step_dir / "manifest-0.json").write_text(manifest.model_dump_json())


OTHER_KEY = manifest_key_of(AUTHORITY.job_credential("integrity-other-job"))


def _shard_xxh3_only(d: Path, job: str) -> None:
    tamper_shard(d)


def _shard_resigned_by_another_job(d: Path, job: str) -> None:
    tamper_shard(d)
    resign(d, OTHER_KEY, with_digests=True)


def _manifest_of_another_job(d: Path, job: str) -> None:
    resign(d, OTHER_KEY, with_digests=True)


def _unsigned(d: Path, job: str) -> None:
    manifest = json.loads((d / "manifest-0.json").read_text())
    manifest["mac"] = ""
    (d / "manifest-0.json").write_text(json.dumps(manifest))


def _xxh3_collision(d: Path, job: str) -> None:
    # as if the sender found bytes with the same xxh3 (not collision-resistant) and the
    # manifest stayed the job's own, signed: only the SHA-256 tells the files apart
    tamper_shard(d)
    resign(d, manifest_key_of(AUTHORITY.job_credential(job)), with_digests=False)


def _metadata_xxh3_only(d: Path, job: str) -> None:
    data = bytearray((d / ".metadata").read_bytes())
    data[-2] ^= 0x01
    rewrite(d, ".metadata", bytes(data))


@pytest.mark.parametrize(
    ("plant", "says"),
    [
        (_shard_xxh3_only, "signature"),
        (_shard_resigned_by_another_job, "signature"),
        (_manifest_of_another_job, "signature"),
        (_unsigned, "unsigned"),
        (_xxh3_collision, "digest"),
        (_metadata_xxh3_only, "signature"),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else v,
)
def test_a_planted_step_is_skipped_for_the_older_good_one(
    node, plant: Callable[[Path, str], None], says: str
) -> None:
    job = "integ-" + plant.__name__.strip("_").replace("_", "-")[:40]
    job_dir, values = save_two_steps(node, job)
    plant(job_dir / step_dirname(1), job)

    step, w, events = restore_recording(node, job)

    assert step == 0
    assert torch.equal(w, values[0])
    failed = [e for e in events if e.kind == "failed" and e.step == 1]
    assert failed, events
    assert "step 1" in failed[0].message
    assert says in failed[0].message
    if plant is _xxh3_collision:
        assert shard_name(job_dir / step_dirname(1)) in failed[0].message


class _Plant:
    """A pickle that opens (creates) ``path`` when it is unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_metadata_whose_pickle_runs_code_is_never_unpickled(node, tmp_path: Path) -> None:
    job = "integ-pickle"
    job_dir, values = save_two_steps(node, job)
    marker = tmp_path / "unpickled"
    rewrite(job_dir / step_dirname(1), ".metadata", pickle.dumps(_Plant(str(marker))))

    step, w, events = restore_recording(node, job)

    assert not marker.exists()
    assert step == 0
    assert torch.equal(w, values[0])
    failed = [e for e in events if e.kind == "failed" and e.step == 1]
    assert failed
    assert "signature" in failed[0].message


def test_rng_state_round_trips_bit_exact_through_a_checkpoint(node) -> None:
    job = "integ-rng"
    random.seed(11)
    random.gauss(0.0, 1.0)  # leaves a cached gaussian in Python's state
    np.random.seed(12)
    np.random.standard_normal()  # and in NumPy's
    torch.manual_seed(13)
    ckpt = checkpointer(node, job)
    ckpt.save(0, {"w": torch.zeros(4), "rng": RNGState()})
    assert ckpt.wait() is True
    ckpt.close()
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = FileSystemReader(ckpt.job_dir / step_dirname(0)).read_metadata()
    rng_items = {k: v for k, v in saved.state_dict_metadata.items() if k.startswith("rng.")}
    assert rng_items
    # every RNG value is a tensor's bytes: nothing of it goes through pickle/torch.load
    assert all(isinstance(v, TensorStorageMetadata) for v in rng_items.values()), rng_items
    py, npy, tch = random.getstate(), np.random.get_state(), torch.get_rng_state()
    expected = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.standard_normal())
    expected_t = torch.rand(8)

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    again = checkpointer(node, job)
    assert again.restore({"w": torch.zeros(4), "rng": RNGState()}) == 0
    again.close()

    assert random.getstate() == py
    got = np.random.get_state()
    assert got[0] == npy[0]
    assert np.array_equal(got[1], npy[1])
    assert got[2:] == npy[2:]
    assert torch.equal(torch.get_rng_state(), tch)
    assert (random.random(), random.gauss(0, 1), np.random.rand(), np.random.standard_normal()) == (
        expected
    )
    assert torch.equal(torch.rand(8), expected_t)


def test_a_model_state_restores_from_a_signed_step(node) -> None:
    """The ordinary path still works end to end: a module, signed manifests, digests."""
    job = "integ-model"
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    ckpt = checkpointer(node, job)
    ckpt.save(0, {"model": model})
    assert ckpt.wait() is True
    ckpt.close()
    manifest = Manifest.model_validate_json(
        (ckpt.job_dir / step_dirname(0) / "manifest-0.json").read_text()
    )
    assert manifest.mac
    assert all(len(f.sha256) == 64 for f in manifest.files)
    assert ".metadata" in {f.name for f in manifest.files}
    fresh = nn.Linear(8, 8)
    again = checkpointer(node, job)
    assert again.restore({"model": fresh}) == 0
    again.close()
    pairs = zip(model.parameters(), fresh.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
