"""SnapshotStager and its parts on CPU: DTensor staging (FSDP2, tensor parallel), the host
slab, the version guard and the CUDA event protocol (with fake CUDA calls).

What only a GPU shows (bench/gpu_check.py): pinning with cudaHostRegister, the CUDA branch of
``stage()`` (clones, one batch per device), and that the copies really overlap training.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tierwatch.agent.checkpoint.training.device_copy import DeviceBatch, DeviceCopier
from tierwatch.agent.checkpoint.training.host_slab import (
    ALIGN,
    HostSlab,
    TensorSpec,
    plan_slab,
)
from tierwatch.agent.checkpoint.training.snapshot import PendingCopies, SnapshotStager
from tierwatch.agent.checkpoint.training.tensor_versions import VersionGuard


def everything_lazy(_path, _t) -> bool:
    return True


def nothing_lazy(_path, _t) -> bool:
    return False


# -- DTensor staging --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    """A 1-D CPU device mesh over a gloo process group of world_size 1."""
    owned = not dist.is_initialized()
    if owned:
        store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if owned:
        dist.destroy_process_group()


def fsdp2_state(mesh) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 2))
    fully_shard(model, mesh=mesh)
    return {"model": get_model_state_dict(model)}


def tp_state(mesh) -> dict:
    torch.manual_seed(0)
    return {
        "col": distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]),
        "row": distribute_tensor(torch.randn(4, 8), mesh, [Shard(1)]),
        "rep": distribute_tensor(torch.randn(5), mesh, [Replicate()]),
    }


def dtensor_leaves(value, path=()):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from dtensor_leaves(v, (*path, k))
    elif isinstance(value, DTensor):
        yield path, value


@pytest.mark.parametrize("make", [fsdp2_state, tp_state], ids=["fsdp2", "tensor-parallel"])
@pytest.mark.parametrize("slab", [False, True], ids=["buffers", "slab"])
def test_a_staged_dtensor_is_its_host_buffer_with_the_original_spec(mesh, make, slab) -> None:
    state = make(mesh)
    stager = SnapshotStager(slab=slab)
    staged, pending = stager.stage(state, everything_lazy)
    originals = dict(dtensor_leaves(state))
    assert originals
    for path, dt in dtensor_leaves(staged):
        original = originals[path]
        assert dt._local_tensor.data_ptr() == stager.buffer(path).data_ptr()
        assert dt.device_mesh is original.device_mesh
        assert dt.placements == original.placements
        assert dt.shape == original.shape
        assert dt.stride() == original.stride()
        assert not dt.requires_grad
    pending.run()
    for path, dt in dtensor_leaves(staged):  # the lazy copy filled the staged DTensor
        assert torch.equal(dt._local_tensor, originals[path]._local_tensor)


def test_a_dtensor_on_a_mesh_of_another_device_type_stays_on_the_host(mesh, monkeypatch) -> None:
    """The CUDA-mesh case, simulated: ``DTensor.from_local`` would move the buffer to the
    mesh's device type (a fresh device copy, taken before the lazy copy fills the buffer)."""
    state = tp_state(mesh)
    monkeypatch.setattr(mesh, "_device_type", "cuda")
    stager = SnapshotStager()
    staged, pending = stager.stage(state, everything_lazy)
    pending.run()
    for path, dt in dtensor_leaves(staged):
        assert dt._local_tensor.device.type == "cpu"
        assert dt._local_tensor.data_ptr() == stager.buffer(path).data_ptr()
        assert dt.device_mesh.device_type == "cuda"
        assert torch.equal(dt._local_tensor, state[path[0]]._local_tensor)


def test_an_in_place_change_of_a_dtensor_shard_is_seen(mesh) -> None:
    state = fsdp2_state(mesh)
    _, pending = SnapshotStager().stage(state, everything_lazy)
    with torch.no_grad():
        state["model"]["1.bias"].mul_(2.0)  # on the DTensor: dispatched to its local shard
    assert pending.run() is not None
    assert pending.versions.changed == ["model.1.bias"]


def test_staged_dtensors_save_with_dcp(mesh, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = tp_state(mesh)
    staged, pending = SnapshotStager(slab=True).stage(state, everything_lazy)
    pending.run()
    dcp.save(staged, checkpoint_id=tmp_path)
    loaded = {
        k: distribute_tensor(torch.zeros(v.shape), mesh, v.placements) for k, v in state.items()
    }
    dcp.load(loaded, checkpoint_id=tmp_path)
    for k, v in state.items():
        assert torch.equal(loaded[k].full_tensor(), v.full_tensor()), k


# -- the host slab ----------------------------------------------------------------------------
def test_plan_slab_aligns_every_tensor() -> None:
    specs = [
        TensorSpec("a", (3,), torch.float32),  # 12 bytes
        TensorSpec("b", (0, 4), torch.float32),  # 0 bytes
        TensorSpec("c", (), torch.int64),  # 8 bytes
        TensorSpec("d", (300,), torch.bfloat16),  # 600 bytes
    ]
    offsets, total = plan_slab(specs)
    assert offsets == [0, ALIGN, ALIGN, 2 * ALIGN]
    assert total == 2 * ALIGN + 3 * ALIGN  # 600 bytes → 3 × 256, rounded
    assert plan_slab([]) == ([], 0)


def test_slab_views_are_disjoint_aligned_and_own_exact_storages() -> None:
    specs = [
        TensorSpec("w", (5, 3), torch.float32),
        TensorSpec("step", (), torch.float32),
        TensorSpec("mask", (7,), torch.bool),
        TensorSpec("empty", (0,), torch.float16),
    ]
    slab = HostSlab(specs, pin=False)
    assert not slab.pinned
    base = slab.views["w"].data_ptr()
    for spec in specs:
        view = slab.views[spec.path]
        assert view.shape == spec.shape
        assert view.dtype == spec.dtype
        if spec.nbytes:
            assert (view.data_ptr() - base) % ALIGN == 0
            assert 0 <= view.data_ptr() - base < slab.nbytes
            # DCP's FileSystemWriter clones a view of a larger storage; these are not
            assert view.untyped_storage().nbytes() == view.nbytes
    slab.views["w"].fill_(1.0)
    slab.views["step"].fill_(2.0)
    slab.views["mask"].fill_(True)
    assert slab.views["w"].sum() == 15
    assert slab.views["step"] == 2
    assert slab.views["mask"].all()
    assert slab.fits(specs, pin=False)
    assert not slab.fits(specs[:2], pin=False)


def test_the_slab_is_reused_across_saves_and_replaced_when_a_shape_changes() -> None:
    state = {"model": {"w": torch.randn(4, 4), "b": torch.randn(4)}, "epoch": 3}
    stager = SnapshotStager(slab=True)
    staged, pending = stager.stage(state, everything_lazy)
    pending.run()
    assert stager.allocations == 1
    assert stager.pinned_bytes == 0
    ptrs = {k: v.data_ptr() for k, v in staged["model"].items()}
    state["model"]["w"].add_(1.0)
    again, pending = stager.stage(state, everything_lazy)
    pending.run()
    assert stager.allocations == 1
    assert {k: v.data_ptr() for k, v in again["model"].items()} == ptrs
    assert torch.equal(again["model"]["w"], state["model"]["w"])
    assert again["epoch"] == 3

    state["model"]["w"] = torch.randn(8, 4)  # a new shape: a new slab
    third, pending = stager.stage(state, nothing_lazy)
    assert stager.allocations == 2
    assert torch.equal(third["model"]["w"], state["model"]["w"])
    assert torch.equal(third["model"]["b"], state["model"]["b"])


def test_per_tensor_buffers_on_cpu_as_before() -> None:
    state = {"w": torch.randn(3), "v": torch.randn(2)}
    stager = SnapshotStager()  # CPU-only state: no slab
    staged, _ = stager.stage(state, nothing_lazy)
    assert stager.allocations == 2
    assert stager.pinned_bytes == 0
    assert staged["w"].untyped_storage().data_ptr() != staged["v"].untyped_storage().data_ptr()
    stager.stage(state, nothing_lazy)
    assert stager.allocations == 2


class FakePinning:
    """cudaHostRegister/Unregister stand-ins (torch.cuda._pin_memory_utils)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, refuse: bool = False) -> None:
        from torch.cuda import _pin_memory_utils

        self.pinned: list[tuple[int, int]] = []
        self.unpinned: list[int] = []

        def pin(ptr: int, size: int) -> None:
            if refuse:
                raise RuntimeError("Registering memory failed with cudaError: 2.")
            self.pinned.append((ptr, size))

        monkeypatch.setattr(_pin_memory_utils, "pin_memory", pin)
        monkeypatch.setattr(_pin_memory_utils, "unpin_memory", self.unpinned.append)


def test_a_pinned_slab_is_pinned_once_whole_and_unpinned_when_replaced(monkeypatch) -> None:
    pinning = FakePinning(monkeypatch)
    stager = SnapshotStager(slab=True)
    leaves = [(("w",), torch.zeros(100)), (("b",), torch.zeros(3))]
    stager._prepare_slab(leaves, pin=True)
    stager._prepare_slab(leaves, pin=True)  # the same tensors: reused, not pinned again
    slab = stager._slab
    assert slab is not None
    assert pinning.pinned == [(stager.buffer(("w",)).data_ptr(), slab.nbytes)]
    assert stager.pinned_bytes == slab.nbytes == 3 * ALIGN  # 400 bytes → 512, then 12 → 256
    stager._prepare_slab([(("w",), torch.zeros(200))], pin=True)  # a new shape
    assert pinning.unpinned == [pinning.pinned[0][0]]
    assert len(pinning.pinned) == 2
    assert stager.allocations == 2
    stager._slab.release()  # with the fake, not the real cudaHostUnregister at GC
    assert pinning.unpinned == [ptr for ptr, _ in pinning.pinned]


def test_a_refused_pin_stages_unpinned_and_is_not_retried(monkeypatch, caplog) -> None:
    FakePinning(monkeypatch, refuse=True)
    stager = SnapshotStager(slab=True)
    leaves = [(("w",), torch.zeros(10))]
    stager._prepare_slab(leaves, pin=True)
    assert stager.pin_error is not None
    assert "cudaError" in stager.pin_error
    assert stager.pinned_bytes == 0
    assert "cannot pin" in caplog.text
    stager._prepare_slab(leaves, pin=True)
    assert stager.allocations == 1  # the unpinned slab fits: no new attempt


@pytest.mark.gpu
def test_a_cuda_state_is_staged_into_one_pinned_slab() -> None:
    state = {"w": torch.randn(1000, 3, device="cuda"), "b": torch.randn(7, device="cuda")}
    stager = SnapshotStager()
    staged, pending = stager.stage(state, everything_lazy)
    assert stager.pinned_bytes >= sum(t.nbytes for t in state.values())
    assert all(t.is_pinned() for t in staged.values())
    pending.run()
    assert all(torch.equal(staged[k], state[k].cpu()) for k in state)


# -- the version guard ------------------------------------------------------------------------
def test_the_version_guard_names_changed_tensors_and_closes_once() -> None:
    w, b = torch.zeros(2), torch.zeros(2)
    guard = VersionGuard()
    guard.watch(("model", "w"), w.detach())  # a detached view shares the version counter
    guard.watch(("optim", "state", "b", "exp_avg"), b)
    w.add_(1.0)
    guard.close()
    b.add_(1.0)  # after the window closed (the hooked step): not counted
    guard.close()
    assert guard.changed == ["model.w"]
    assert "model.w" in (guard.problem or "")
    many = VersionGuard()
    ts = [torch.zeros(1) for _ in range(8)]
    for i, t in enumerate(ts):
        many.watch(("p", i), t)
        t.add_(1)
    many.close()
    assert "and 3 more" in (many.problem or "")
    assert VersionGuard().problem is None


# -- the CUDA event protocol, with fake CUDA calls --------------------------------------------
class FakeEvent:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream) -> None:
        self.log.append(("record", self.name, stream.name, threading.current_thread().name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name, threading.current_thread().name))


class FakeStream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.name, threading.current_thread().name))


class FakeCuda:
    """Records the protocol's CUDA calls; copies are plain CPU copies."""

    def __init__(self) -> None:
        self.log: list = []
        self.events = 0
        self.current: dict[str, str] = {}  # thread → its current stream

    def current_stream(self, device):
        thread = threading.current_thread().name
        return FakeStream(self.log, self.current.get(thread, f"default:{thread}:{device}"))

    def new_stream(self, device):
        self.log.append(("new_stream", str(device)))
        return FakeStream(self.log, f"copy:{device}")

    def new_event(self):
        self.events += 1
        return FakeEvent(self.log, f"event{self.events}")

    def set_device(self, device) -> None:
        self.log.append(("set_device", str(device), threading.current_thread().name))

    @contextlib.contextmanager
    def use_stream(self, stream):
        thread = threading.current_thread().name
        before = self.current.get(thread)
        self.current[thread] = stream.name
        try:
            yield stream
        finally:
            if before is None:
                del self.current[thread]
            else:
                self.current[thread] = before

    def copy(self, dst, src) -> None:
        self.log.append(("copy", self.current.get(threading.current_thread().name)))
        dst.copy_(src)


def test_the_copy_protocol_orders_training_and_the_writer_with_events() -> None:
    fake = FakeCuda()
    copier = DeviceCopier(fake)
    device = torch.device("cuda", 3)
    src, dst = torch.arange(4.0), torch.zeros(4)

    # training thread, save(): ready event on its current stream
    batch = copier.mark_ready(device)
    batch.pairs.append((dst, src))
    pending = PendingCopies(pairs=[(dst, src)], batches=[batch], copier=copier)
    pending.versions.watch(("model", "w"), src)
    training = threading.current_thread().name
    issued = threading.Event()
    hook_done = threading.Event()
    result: list = []

    def writer() -> None:
        def on_issued() -> None:
            issued.set()
            assert hook_done.wait(5)  # the optimizer step runs while the copy is in flight

        result.append(pending.run(issued=on_issued))

    t = threading.Thread(target=writer, name="writer")
    t.start()
    assert issued.wait(5)
    pending.before_optimizer_step()  # training thread, optimizer step pre-hook
    src.add_(1.0)  # the optimizer step itself: after the hook, legitimate
    hook_done.set()
    t.join(5)

    assert result == [None]  # the hook closed the version window first
    assert torch.equal(dst, torch.arange(4.0))  # the fake copy ran before the step
    assert batch.pairs == []
    assert pending.pairs == []
    ready, done = "event1", "event2"
    assert fake.log == [
        ("record", ready, f"default:{training}:cuda:3", training),
        ("set_device", "cuda:3", "writer"),
        ("new_stream", "cuda:3"),
        ("wait_event", "copy:cuda:3", ready, "writer"),
        ("copy", "copy:cuda:3"),
        ("record", done, "copy:cuda:3", "writer"),
        ("wait_event", f"default:{training}:cuda:3", done, training),
        ("synchronize", done, "writer"),
    ]


def test_the_copy_stream_is_reused_and_a_failed_issue_orders_nothing() -> None:
    fake = FakeCuda()
    copier = DeviceCopier(fake)
    device = torch.device("cuda", 0)
    for _ in range(2):
        batch = copier.mark_ready(device)
        copier.issue(batch)
        copier.wait(batch)
    assert [e for e in fake.log if e[0] == "new_stream"] == [("new_stream", "cuda:0")]
    never_issued = DeviceBatch(device=device, ready=None)
    fake.log.clear()
    copier.order_after(never_issued)
    copier.wait(never_issued)
    assert fake.log == []


def test_without_device_batches_the_writer_checks_versions_before_releasing_training() -> None:
    src, dst = torch.zeros(3), torch.empty(3)
    pending = PendingCopies(pairs=[(dst, src)], host_pairs=[(dst, src)])
    pending.versions.watch(("model", "w"), src)
    seen: list = []

    def issued() -> None:
        seen.append(pending.versions._closed)  # compared before training was released
        src.add_(1.0)  # the optimizer step, once released

    assert pending.run(issued=issued) is None
    assert seen == [True]
    assert torch.equal(dst, torch.zeros(3))


def test_a_failed_copy_still_waits_for_the_copies_already_enqueued() -> None:
    class FailingOnSecondDevice(FakeCuda):
        def copy(self, dst, src) -> None:
            if self.current.get(threading.current_thread().name) == "copy:cuda:1":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            super().copy(dst, src)

    fake = FailingOnSecondDevice()
    copier = DeviceCopier(fake)
    batches = []
    for index in (0, 1):
        batch = copier.mark_ready(torch.device("cuda", index))
        batch.pairs.append((torch.zeros(2), torch.ones(2)))
        batches.append(batch)
    pending = PendingCopies(batches=batches, copier=copier)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        pending.run()
    recorded = [e[1] for e in fake.log if e[0] == "record" and e[2] == "copy:cuda:0"]
    assert len(recorded) == 1  # cuda:0's done event
    assert ("synchronize", recorded[0], threading.current_thread().name) in fake.log
    assert batches[0].pairs == []  # released only after its copy landed
