"""NVML collector against a stand-in pynvml module (no GPU here)."""

from __future__ import annotations

import threading

import pynvml
import pytest
from agent_helpers import FakeGpu, make_fake_pynvml, wait_until

from tierwatch.agent.collectors import CollectorError, make_collector
from tierwatch.agent.collectors.nvml import NvmlCollector
from tierwatch.agent.config import AgentSettings
from tierwatch.agent.protocol import THROTTLE_HW_SLOWDOWN, XidEvent


def _gpus() -> list[FakeGpu]:
    g0 = FakeGpu(
        index=0,
        temperature=61,
        power_mw=412_345,
        limit_mw=700_000,
        util=97,
        mem_used=40 * 1024**3,
        ecc={
            (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC): 2,
            (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC): 1,
            (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC): 12,
            (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC): 3,
        },
        rows=(4, 1, 1, 0),
        reasons=THROTTLE_HW_SLOWDOWN,
        nvlink_links=2,
        nvlink={
            (0, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT): 5,
            (1, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT): 1,
            (1, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA): 2,
            (0, pynvml.NVML_NVLINK_ERROR_DL_REPLAY): 7,
            (1, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY): 1,
        },
    )
    g1 = FakeGpu(
        index=1,
        temperature=40,
        unsupported={
            "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceGetRemappedRows",
            "nvmlDeviceGetPcieReplayCounter",
            "nvmlDeviceGetTemperatureThreshold",
            "nvmlDeviceGetCurrentClocksEventReasons",
            "nvmlDeviceGetCurrentClocksThrottleReasons",
        },
    )
    return [g0, g1]


@pytest.fixture
def started():
    gpus = _gpus()
    nv = make_fake_pynvml(gpus)
    collector = NvmlCollector(nvml=nv, event_wait_ms=50)
    xids: list[XidEvent] = []
    lock = threading.Lock()

    def on_xid(event: XidEvent) -> None:
        with lock:
            xids.append(event)

    assert collector.is_available()
    collector.start(on_xid)
    yield collector, nv, gpus, xids
    collector.shutdown()


def test_reads_every_field_with_units(started):
    collector, nv, _, _ = started
    inv = collector.inventory()
    assert [g.index for g in inv] == [0, 1]
    assert inv[0].uuid == "GPU-fake-0"
    assert inv[0].name == "NVIDIA H100 80GB HBM3"
    assert inv[0].memory_total_mib == 81920.0
    s0 = collector.collect()[0]
    assert s0.temperature_c == 61
    assert (s0.slowdown_temp_c, s0.shutdown_temp_c) == (90, 95)
    assert s0.power_w == pytest.approx(412.345)  # mW -> W
    assert s0.power_limit_w == 700.0
    assert s0.utilization_pct == 97
    assert (s0.memory_used_mib, s0.memory_total_mib) == (40960.0, 81920.0)  # bytes -> MiB
    assert (s0.ecc_sbe_volatile, s0.ecc_dbe_volatile) == (2, 1)
    assert (s0.ecc_sbe_aggregate, s0.ecc_dbe_aggregate) == (12, 3)
    assert (s0.remapped_rows_correctable, s0.remapped_rows_uncorrectable) == (4, 1)
    assert (s0.row_remap_pending, s0.row_remap_failure) == (True, False)
    assert s0.pcie_replay_count == 3
    assert s0.throttle_reasons == THROTTLE_HW_SLOWDOWN
    # summed over the two supported links; CRC = flit + data
    assert (s0.nvlink_crc_errors, s0.nvlink_replay_errors, s0.nvlink_recovery_errors) == (8, 7, 1)
    assert nv.calls["nvmlInit"] == 1  # initialised once


def test_unsupported_fields_are_none_and_sample_kept(started):
    collector, _, _, _ = started
    s1 = collector.collect()[1]
    assert s1.index == 1
    assert s1.temperature_c == 40
    assert s1.power_w == 250.0
    for name in (
        "ecc_sbe_volatile",
        "ecc_dbe_aggregate",
        "remapped_rows_correctable",
        "row_remap_failure",
        "pcie_replay_count",
        "slowdown_temp_c",
        "throttle_reasons",
        "nvlink_crc_errors",
    ):
        assert getattr(s1, name) is None, name
    # "not supported" is normal, not an operator event
    assert collector.drain_events() == []


def test_unsupported_nvlink_links_are_probed_once(started):
    collector, nv, _, _ = started
    collector.collect()
    first = nv.calls["nvmlDeviceGetNvLinkErrorCounter"]
    collector.collect()
    # second collection only asks the supported links: 2 links x 4 counters on GPU 0
    assert nv.calls["nvmlDeviceGetNvLinkErrorCounter"] - first == 8


def test_throttle_reasons_fall_back_to_older_call():
    gpus = [FakeGpu(index=0, reasons=0x40)]
    nv = make_fake_pynvml(gpus, clocks_event_reasons=False)
    collector = NvmlCollector(nvml=nv, event_wait_ms=50)
    collector.start(lambda e: None)
    try:
        assert collector.collect()[0].throttle_reasons == 0x40
    finally:
        collector.shutdown()


def test_xid_event_is_pushed_with_index_from_handle(started):
    collector, nv, _, xids = started
    assert {i for i, _ in nv.state["registered"]} == {0, 1}
    assert all(t == pynvml.nvmlEventTypeXidCriticalError for _, t in nv.state["registered"])
    nv.push_xid(1, 79)
    wait_until(lambda: xids, what="XID callback")
    assert (xids[0].gpu, xids[0].xid) == (1, 79)


def test_lost_gpu_keeps_old_sample_and_raises_event(started):
    collector, _, gpus, _ = started
    before = collector.collect()[0]
    gpus[0].lost = True
    gpus[0].temperature = 99
    after = collector.collect()
    assert after[0] == before  # same values, same old ts: stale telemetry
    assert after[1].ts > before.ts
    events = collector.drain_events()
    assert [(e.kind, e.gpu) for e in events] == [("nvml_gpu_error", 0)]
    assert "old timestamp" in events[0].message
    collector.collect()
    assert collector.drain_events() == []  # not repeated every interval
    gpus[0].lost = False
    fresh = collector.collect()[0]
    assert fresh.temperature_c == 99
    assert fresh.ts > before.ts
    assert [e.kind for e in collector.drain_events()] == ["nvml_gpu_recovered"]


def test_out_of_range_reading_becomes_none_with_event(started):
    collector, _, gpus, _ = started
    gpus[0].temperature = 255  # beyond the protocol's range
    sample = collector.collect()[0]
    assert sample.temperature_c is None
    assert sample.power_w is not None
    assert [e.kind for e in collector.drain_events()] == ["invalid_reading"]


def test_shutdown_stops_thread_and_nvml(started):
    collector, nv, _, _ = started
    collector.shutdown()
    assert nv.state["freed"] == 1
    assert not nv.state["initialized"]
    assert not any(t.name == "nvml-xid" for t in threading.enumerate())


def test_auto_falls_back_to_simulated_without_nvml(tmp_path):
    nv = make_fake_pynvml([], init_error="NVMLError_LibraryNotFound")
    settings = AgentSettings(node="n1", collector="auto", sim_gpus=2, _env_file=None)
    collector = make_collector(settings, nvml=nv)
    assert collector.name == "simulated"
    assert collector.simulated
    with pytest.raises(CollectorError, match="nvmlInit failed"):
        make_collector(AgentSettings(node="n1", collector="nvml"), nvml=nv)


def test_auto_picks_nvml_when_it_loads():
    nv = make_fake_pynvml([FakeGpu(index=0)])
    collector = make_collector(AgentSettings(node="n1", collector="auto"), nvml=nv)
    assert collector.name == "nvml"
    assert not collector.simulated


# -- extra readings (agent/readings.py, for the agent's /metrics) --------------------------
def test_extra_readings_with_units(started):
    collector, _, _, _ = started
    collector.collect()
    extras = collector.extras()
    assert sorted(extras) == [0, 1]
    e0 = extras[0]
    assert (e0.pci_bus_id, e0.driver_version) == ("00000000:18:00.0", "550.90.07")
    assert (e0.sm_clock_mhz, e0.mem_clock_mhz) == (1980.0, 2619.0)
    assert e0.memory_temp_c == 52.0  # field value NVML_FI_DEV_MEMORY_TEMP
    assert e0.total_energy_mj == 123_456_789
    assert (e0.enc_util_pct, e0.dec_util_pct, e0.mem_copy_util_pct) == (0.0, 0.0, 10.0)
    # nvmlDeviceGetMemoryInfo version 2: used without the 512 MiB reserved
    assert (e0.fb_used_mib, e0.fb_free_mib, e0.fb_reserved_mib) == (40448.0, 40960.0, 512.0)
    # DCGM-only readings: NVML has none
    assert e0.nvlink_bandwidth_total is None
    assert e0.prof_pipe_tensor_active_ratio is None
    assert e0.mig == []
    assert extras[1].pci_bus_id == "00000000:19:00.0"


def test_unsupported_extra_readings_are_none_quietly():
    gpu = FakeGpu(
        index=0,
        memory_temp=None,
        unsupported={
            "nvmlDeviceGetClockInfo",
            "nvmlDeviceGetTotalEnergyConsumption",
            "nvmlDeviceGetEncoderUtilization",
            "nvmlDeviceGetPciInfo",
            "nvmlDeviceGetMigMode",
        },
    )
    nv = make_fake_pynvml([gpu], driver_version=None)
    del nv.nvmlDeviceGetDecoderUtilization  # an older nvidia-ml-py without the function
    del nv.nvmlMemory_v2  # ... and without nvmlDeviceGetMemoryInfo version 2
    collector = NvmlCollector(nvml=nv, event_wait_ms=50)
    collector.start(lambda e: None)
    try:
        sample = collector.collect()[0]
        extras = collector.extras()[0]
    finally:
        collector.shutdown()
    assert sample.temperature_c == 45  # the sample is untouched
    assert extras.model_dump(exclude_none=True) == {
        "index": 0,
        "mem_copy_util_pct": 10.0,
        "fb_free_mib": 61440.0,  # version 1's free
        "mig": [],
    }
    assert collector.drain_events() == []


def test_mig_instances_are_read_from_mig_device_handles():
    gib = 1024**3
    gpu = FakeGpu(
        index=0,
        name="NVIDIA A100-SXM4-80GB",
        mig=[(1, "3g.40gb", 30 * gib, 40 * gib), (2, "3g.40gb", 1 * gib, 40 * gib)],
    )
    collector = NvmlCollector(nvml=make_fake_pynvml([gpu]), event_wait_ms=50)
    collector.start(lambda e: None)
    try:
        collector.collect()
        mig = collector.extras()[0].mig
    finally:
        collector.shutdown()
    assert [(m.gpu_instance_id, m.profile, m.fb_used_mib, m.fb_free_mib) for m in mig] == [
        (1, "3g.40gb", 30720.0, 10240.0),
        (2, "3g.40gb", 1024.0, 39936.0),
    ]
    assert collector.drain_events() == []  # the empty MIG slots answer NotFound, quietly


def test_mig_profile_from_the_devices_name():
    from tierwatch.agent.collectors.nvml import mig_profile

    assert mig_profile("NVIDIA A100-SXM4-40GB MIG 1g.5gb") == "1g.5gb"
    assert mig_profile("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me") == "1g.10gb+me"
    assert mig_profile("NVIDIA H100 80GB HBM3") is None


def test_a_lost_gpu_has_no_extra_readings(started):
    collector, _, gpus, _ = started
    collector.collect()
    gpus[0].lost = True
    collector.collect()
    assert sorted(collector.extras()) == [1]
