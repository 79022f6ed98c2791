"""Simulated collector: determinism per seed, plausible values, and every fault."""

from __future__ import annotations

import pytest

from tierwatch.agent.collectors.simulated import (
    FAULTS,
    SLOWDOWN_C,
    FaultError,
    SimulatedCollector,
    simulated_uuid,
)
from tierwatch.agent.protocol import (
    THROTTLE_HW_SLOWDOWN,
    THROTTLE_HW_THERMAL_SLOWDOWN,
    XidEvent,
)


def _values(samples):
    return [s.model_dump(exclude={"ts"}) for s in samples]


@pytest.fixture
def sim():
    xids: list[XidEvent] = []
    collector = SimulatedCollector("node-a", gpus=4, seed=7, job="job-1", rank=3)
    collector.start(xids.append)
    collector.xids = xids
    return collector


def test_same_seed_same_sequence():
    a = SimulatedCollector("node-a", gpus=4, seed=42)
    b = SimulatedCollector("node-a", gpus=4, seed=42)
    c = SimulatedCollector("node-a", gpus=4, seed=43)
    seq_a = [_values(a.collect()) for _ in range(5)]
    assert seq_a == [_values(b.collect()) for _ in range(5)]
    assert seq_a != [_values(c.collect()) for _ in range(5)]


def test_inventory_and_plausible_values():
    sim = SimulatedCollector("node-a", gpus=8, seed=1)
    inv = sim.inventory()
    assert [g.uuid for g in inv] == [simulated_uuid("node-a", i) for i in range(8)]
    assert inv[0].uuid == SimulatedCollector("node-a", gpus=8, seed=2).inventory()[0].uuid
    assert inv[0].uuid != SimulatedCollector("node-b", gpus=8, seed=1).inventory()[0].uuid
    assert inv[0].name == "NVIDIA H100 80GB HBM3 (simulated)"
    assert sim.simulated
    for _ in range(40):
        for s in sim.collect():
            assert 30 <= s.temperature_c <= 75
            assert 0 <= s.utilization_pct <= 100
            assert 60 <= s.power_w <= s.power_limit_w
            assert s.memory_used_mib < s.memory_total_mib
            assert s.ecc_dbe_volatile == 0
            assert s.throttle_reasons == 0


def test_thermal_runaway_passes_slowdown(sim):
    sim.inject("thermal", 2)
    temps = [sim.collect()[2].temperature_c for _ in range(5)]
    assert temps == sorted(temps)
    assert temps[-1] > SLOWDOWN_C
    last = sim.collect()[2]
    assert last.throttle_reasons & THROTTLE_HW_THERMAL_SLOWDOWN
    assert sim.collect()[0].temperature_c < 80  # other GPUs unaffected


def test_temp_value(sim):
    sim.inject("temp", 1, 95)
    assert sim.collect()[1].temperature_c == 95.0


def test_ecc_dbe_counts_and_pushes_xid_48(sim):
    sim.inject("ecc-dbe", 3)
    s = sim.collect()[3]
    assert (s.ecc_dbe_volatile, s.ecc_dbe_aggregate) == (1, 1)
    assert [(x.gpu, x.xid) for x in sim.xids] == [(3, 48)]


def test_row_remap_failure(sim):
    sim.inject("row-remap-failure", 0)
    s = sim.collect()[0]
    assert s.row_remap_failure is True
    assert s.row_remap_pending is True


def test_xid_code_pushed_at_once(sim):
    sim.inject("xid", 1, 79)
    assert [(x.gpu, x.xid) for x in sim.xids] == [(1, 79)]


def test_throttle(sim):
    sim.inject("throttle", None)  # default GPU 0
    assert sim.collect()[0].throttle_reasons & THROTTLE_HW_SLOWDOWN
    assert sim.collect()[1].throttle_reasons == 0


def test_straggle_multiplies_latency(sim):
    normal = [sim.latency()[0].latency_ms for _ in range(20)]
    assert all(1.0 < v < 3.0 for v in normal)
    sample = sim.latency()[0]
    assert (sample.job_id, sample.rank) == ("job-1", 3)
    sim.inject("straggle")
    slow = [sim.latency()[0].latency_ms for _ in range(20)]
    assert all(v > 10.0 for v in slow)
    sim.inject("clear")
    assert sim.latency()[0].latency_ms < 3.0


def test_no_latency_without_job():
    assert SimulatedCollector("n", gpus=1, seed=1).latency() == []


def test_freeze_repeats_old_sample(sim):
    before = sim.collect()[1]
    sim.inject("freeze", 1)
    frozen = [sim.collect()[1] for _ in range(3)]
    assert all(s == before for s in frozen)  # including the old ts
    sim.inject("clear", 1)
    assert sim.collect()[1].ts > before.ts


def test_clear_all(sim):
    sim.inject("thermal", 0)
    sim.inject("throttle", 1)
    sim.inject("row-remap-failure", 2)
    sim.inject("ecc-dbe", 3)
    sim.collect()
    sim.inject("clear")
    samples = [sim.collect() for _ in range(3)][-1]
    assert samples[0].temperature_c < SLOWDOWN_C
    assert samples[1].throttle_reasons == 0
    assert samples[2].row_remap_failure is False
    assert samples[3].ecc_dbe_volatile == 0  # reset like a GPU reset
    assert samples[3].ecc_dbe_aggregate == 1  # aggregate is kept


@pytest.mark.parametrize(
    ("fault", "gpu", "value", "message"),
    [
        ("melt", None, None, "unknown fault"),
        ("thermal", 4, None, "out of range"),
        ("xid", 0, None, "needs a value"),
        ("xid", 0, 7.5, "integer"),
        ("temp", 0, 500, "between"),
        ("throttle", 0, 3, "takes no value"),
    ],
)
def test_bad_faults_are_refused(sim, fault, gpu, value, message):
    with pytest.raises(FaultError, match=message):
        sim.inject(fault, gpu, value)


def test_every_fault_is_accepted(sim):
    for fault in FAULTS:
        value = {"xid": 13, "temp": 80}.get(fault)
        assert sim.inject(fault, 0, value)


def test_every_fault_has_one_effect():
    assert set(SimulatedCollector._EFFECTS) == set(FAULTS)


# -- extra readings (agent/readings.py) -----------------------------------------------------
def test_extra_readings_are_plausible():
    sim = SimulatedCollector("node-a", gpus=8, seed=1)
    energy = {}
    for _ in range(20):
        samples = sim.collect()
        extras = sim.extras()
        assert sorted(extras) == list(range(8))
        for s in samples:
            e = extras[s.index]
            assert 1000 <= e.sm_clock_mhz <= 1980
            assert e.mem_clock_mhz == 2619
            assert e.memory_temp_c > s.temperature_c
            assert e.total_energy_mj > energy.get(s.index, 0)  # a counter
            energy[s.index] = e.total_energy_mj
            assert e.fb_used_mib + e.fb_free_mib + e.fb_reserved_mib == pytest.approx(
                s.memory_total_mib
            )
            assert 0 <= e.prof_pipe_tensor_active_ratio <= 1
            assert e.prof_pcie_rx_bps > 0
            assert e.driver_version
            assert e.mig == []
    assert extras[0].pci_bus_id == "00000000:18:00.0"
    assert len({e.pci_bus_id for e in extras.values()}) == 8


def test_extras_leave_the_samples_sequence_as_it_was():
    """The extras draw from their own generator: MIG or not, the samples are the same."""
    a = SimulatedCollector("node-a", gpus=2, seed=42)
    b = SimulatedCollector("node-a", gpus=2, seed=42, mig={0: ["3g.40gb"]})
    assert [_values(a.collect()) for _ in range(3)] == [_values(b.collect()) for _ in range(3)]


def test_mig_instances_and_frozen_gpus():
    sim = SimulatedCollector("node-a", gpus=2, seed=1, mig={1: ["3g.40gb", "2g.20gb"]})
    sim.collect()
    mig = sim.extras()[1].mig
    assert [(m.gpu_instance_id, m.profile) for m in mig] == [(1, "3g.40gb"), (2, "2g.20gb")]
    assert mig[0].fb_used_mib + mig[0].fb_free_mib == 40 * 1024
    assert sim.extras()[0].mig == []
    sim.inject("freeze", gpu=1)
    sim.collect()
    assert sorted(sim.extras()) == [0]  # the frozen GPU's sample is stale: no extras


@pytest.mark.parametrize(
    ("mig", "needle"),
    [({2: ["1g.10gb"]}, "out of range"), ({0: ["big"]}, "not <n>g.<m>gb")],
)
def test_bad_mig_layout_is_refused(mig, needle):
    with pytest.raises(ValueError, match=needle):
        SimulatedCollector("node-a", gpus=2, seed=1, mig=mig)
