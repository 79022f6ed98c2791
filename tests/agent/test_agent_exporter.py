"""The agent's /metrics renderer (agent/exporter.py): names, labels, MIG, None, XIDs, staleness,
label-name settings and promtool's findings."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from agent_helpers import parse_series
from executables import require_executable
from pydantic import ValidationError

from tierwatch.agent.collectors.simulated import SimulatedCollector
from tierwatch.agent.config import AgentSettings
from tierwatch.agent.exporter import (
    DCGM_FIELDS,
    XID_ERRORS,
    ExportOptions,
    GpuState,
    MetricsSnapshot,
    MetricsState,
    dcgm_relabel_configs,
    exposed_type,
    lint_findings,
    render,
)
from tierwatch.agent.protocol import GPU_METRICS, GpuInfo, GpuSample, XidEvent
from tierwatch.agent.readings import EXTRA_READINGS, MIG_READINGS, GpuExtras, MigInstance

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
MODEL = "NVIDIA H100 80GB HBM3"

#: dcgm-exporter's default counters (docs: shared/data/dcgm-exporter.md, from its
#: etc/default-counters.csv): name -> (type, help without the final period).
DEFAULT_COUNTERS = {
    "DCGM_FI_DEV_SM_CLOCK": ("gauge", "SM clock frequency (in MHz)"),
    "DCGM_FI_DEV_MEM_CLOCK": ("gauge", "Memory clock frequency (in MHz)"),
    "DCGM_FI_DEV_MEMORY_TEMP": ("gauge", "Memory temperature (in C)"),
    "DCGM_FI_DEV_GPU_TEMP": ("gauge", "GPU temperature (in C)"),
    "DCGM_FI_DEV_POWER_USAGE": ("gauge", "Power draw (in W)"),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": (
        "counter",
        "Total energy consumption since boot (in mJ)",
    ),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("counter", "Total number of PCIe retries"),
    "DCGM_FI_DEV_GPU_UTIL": ("gauge", "GPU utilization (in %)"),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("gauge", "Memory utilization (in %)"),
    "DCGM_FI_DEV_ENC_UTIL": ("gauge", "Encoder utilization (in %)"),
    "DCGM_FI_DEV_DEC_UTIL": ("gauge", "Decoder utilization (in %)"),
    "DCGM_FI_DEV_XID_ERRORS": ("gauge", "Value of the last XID error encountered"),
    "DCGM_FI_DEV_FB_FREE": ("gauge", "Framebuffer memory free (in MiB)"),
    "DCGM_FI_DEV_FB_USED": ("gauge", "Framebuffer memory used (in MiB)"),
    "DCGM_FI_DEV_FB_RESERVED": ("gauge", "Framebuffer memory reserved (in MiB)"),
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": (
        "counter",
        "Total NVLink bandwidth counters for all lanes",
    ),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": (
        "counter",
        "Remapped rows for uncorrectable errors",
    ),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": ("counter", "Remapped rows for correctable errors"),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("gauge", "Whether remapping of rows has failed"),
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": ("gauge", "Ratio of time the graphics engine is active"),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": (
        "gauge",
        "Ratio of cycles the tensor (HMMA) pipe is active",
    ),
    "DCGM_FI_PROF_DRAM_ACTIVE": (
        "gauge",
        "Ratio of cycles the device memory interface is active",
    ),
    "DCGM_FI_PROF_PCIE_TX_BYTES": (
        "gauge",
        "PCIe bytes transmitted per second (headers + payload)",
    ),
    "DCGM_FI_PROF_PCIE_RX_BYTES": ("gauge", "PCIe bytes received per second (headers + payload)"),
}


def _info(index: int) -> GpuInfo:
    return GpuInfo(index=index, uuid=f"GPU-test-{index}", name=MODEL)


def _sample(index: int, ts: datetime = T0, **fields) -> GpuSample:
    base = {"temperature_c": 50.0, "power_w": 300.0, "memory_used_mib": 1000.0}
    return GpuSample(index=index, ts=ts, **{**base, **fields})


def _extras(index: int, **fields) -> GpuExtras:
    base = {"pci_bus_id": f"00000000:{0x18 + index:02X}:00.0", "driver_version": "550.90.07"}
    return GpuExtras(index=index, **{**base, **fields})


def _snapshot(*gpus: GpuState) -> MetricsSnapshot:
    return MetricsSnapshot(
        node="gpu-017", collector="nvml", simulated=False, version="1", gpus=gpus
    )


def _lines(text: bytes, name: str) -> list[tuple[dict[str, str], float]]:
    return [(labels, value) for n, labels, value in parse_series(text.decode()) if n == name]


def _help_and_type(text: bytes) -> dict[str, tuple[str, str]]:
    helps, types = {}, {}
    for line in text.decode().splitlines():
        if line.startswith("# HELP "):
            name, _, rest = line[7:].partition(" ")
            helps[name] = rest
        elif line.startswith("# TYPE "):
            name, _, rest = line[7:].partition(" ")
            types[name] = rest
    assert helps.keys() == types.keys()
    return {name: (types[name], helps[name]) for name in types}


# -- the field table ------------------------------------------------------------------------
def test_every_reading_is_exported_once():
    """One source: each GpuSample metric and each extra reading feeds exactly one family."""
    from_sample = [f.sample for f in DCGM_FIELDS if f.sample]
    from_extras = [f.extra for f in DCGM_FIELDS if f.extra]
    assert sorted(from_sample) == sorted(GPU_METRICS)
    assert sorted(from_extras) == sorted(EXTRA_READINGS)
    names = [f.name for f in (*DCGM_FIELDS, XID_ERRORS)]
    assert len(names) == len(set(names))
    # instance-scoped fields read what a MIG instance has of its own
    assert {f.extra for f in DCGM_FIELDS if f.per_instance and f.extra} <= set(MIG_READINGS)


def test_default_counters_have_dcgm_exporters_names_types_and_help():
    specs = {f.name: (f.kind, f.help) for f in (*DCGM_FIELDS, XID_ERRORS)}
    for name, (kind, help_) in DEFAULT_COUNTERS.items():
        assert specs[name][0] == kind, name
        assert specs[name][1].rstrip(".") == help_, name


def test_bare_counters_keep_their_names_and_are_served_untyped():
    """dcgm-exporter's counters without ``_total`` keep their names, HELP and values; their
    ``# TYPE`` is ``untyped`` (promtool rejects a counter so named); other families keep
    dcgm-exporter's type."""
    sample = _sample(0, pcie_replay_count=7, remapped_rows_correctable=2)
    gpu = GpuState(info=_info(0), sample=sample, extras=_extras(0, total_energy_mj=12345))
    text = render(_snapshot(gpu), ExportOptions())
    meta = _help_and_type(text)
    assert meta["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] == (
        "untyped",
        "Total energy consumption since boot (in mJ).",
    )
    bare = {n for n, (kind, _) in DEFAULT_COUNTERS.items() if kind == "counter"}
    assert {meta[n][0] for n in bare if n in meta} == {"untyped"}
    assert meta["DCGM_FI_DEV_GPU_TEMP"] == ("gauge", "GPU temperature (in C).")
    assert meta["DCGM_FI_DEV_XID_ERRORS"][0] == "gauge"
    assert not [n for n in meta if n.startswith("DCGM_FI") and n.endswith("_total")]
    [(_, energy)] = _lines(text, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION")
    assert energy == 12345.0
    assert _lines(text, "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS")[0][1] == 2.0
    # the one name promtool rejects under any type is served under the server's name
    assert "DCGM_FI_DEV_PCIE_REPLAY_COUNTER" not in meta
    [(replay_labels, replays)] = _lines(text, "tierwatch_gpu_pcie_replays")
    assert replays == 7.0
    assert replay_labels == _lines(text, "DCGM_FI_DEV_GPU_TEMP")[0][0]


def test_dcgm_names_serve_dcgm_exporters_exact_names_and_types():
    sample = _sample(0, pcie_replay_count=7)
    gpu = GpuState(info=_info(0), sample=sample, extras=_extras(0, total_energy_mj=12345))
    text = render(_snapshot(gpu), ExportOptions(dcgm_names=True, model_label="modelName"))
    meta = _help_and_type(text)
    for name, (kind, help_) in DEFAULT_COUNTERS.items():
        if name in meta:
            assert meta[name] == (kind, help_ + "."), name
    assert "tierwatch_gpu_pcie_replays" not in meta
    [(labels, replays)] = _lines(text, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER")
    assert replays == 7.0
    assert labels["modelName"] == MODEL


@pytest.mark.parametrize(
    ("kind", "name", "served"),
    [
        ("counter", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "untyped"),
        ("counter", "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "untyped"),  # _TOTAL is not _total
        ("counter", "tierwatch_x_total", "counter"),
        ("gauge", "DCGM_FI_DEV_GPU_TEMP", "gauge"),
    ],
)
def test_exposed_type(kind, name, served):
    assert exposed_type(kind, name) == served


# -- labels ---------------------------------------------------------------------------------
def test_gpu_line_labels():
    gpu = GpuState(
        info=_info(3),
        sample=_sample(3),
        extras=_extras(3),
        pci_bus_id="00000000:5D:00.0",
        driver_version="550.90.07",
    )
    text = render(_snapshot(gpu), ExportOptions())
    [(labels, value)] = _lines(text, "DCGM_FI_DEV_GPU_TEMP")
    assert value == 50.0
    assert labels == {
        "gpu": "3",
        "UUID": "GPU-test-3",
        "pci_bus_id": "00000000:5D:00.0",
        "device": "nvidia3",
        "model_name": MODEL,
        "Hostname": "gpu-017",
        "DCGM_FI_DRIVER_VERSION": "550.90.07",
    }
    # the tierwatch_* lines: the same labels but the model label
    [(stale_labels, stale)] = _lines(text, "tierwatch_gpu_telemetry_stale")
    assert stale == 0.0
    assert stale_labels == {k: v for k, v in labels.items() if k != "model_name"}


def test_host_and_model_label_names_are_settings_and_unknown_labels_are_left_out():
    gpu = GpuState(info=_info(0), sample=_sample(0))  # no extras: no PCI id, no driver
    text = render(_snapshot(gpu), ExportOptions(host_label="hostname", model_label="modelName"))
    [(labels, _)] = _lines(text, "DCGM_FI_DEV_POWER_USAGE")
    assert labels == {
        "gpu": "0",
        "UUID": "GPU-test-0",
        "device": "nvidia0",
        "modelName": MODEL,
        "hostname": "gpu-017",
    }
    [(info, one)] = _lines(text, "tierwatch_agent_info")
    assert (info, one) == (
        {"hostname": "gpu-017", "collector": "nvml", "simulated": "false", "version": "1"},
        1.0,
    )


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"host_label": "host-name"}, "'host-name' is not a Prometheus label name"),
        ({"host_label": "1host"}, "is not a Prometheus label name"),
        ({"host_label": ""}, "is not a Prometheus label name"),
        ({"model_label": "__model"}, "reserved by Prometheus"),
        ({"host_label": "gpu"}, "a label /metrics sets itself"),
        ({"model_label": "UUID"}, "a label /metrics sets itself"),
        ({"host_label": "node", "model_label": "node"}, "both 'node'"),
    ],
)
def test_bad_label_names_are_refused_with_a_clear_error(kwargs, needle):
    with pytest.raises(ValueError, match="label") as info:
        ExportOptions(**kwargs)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        (
            {"metrics_host_label": "host name"},
            "--metrics-host-label (TIERWATCH_METRICS_HOST_LABEL)",
        ),
        ({"metrics_model_label": "9"}, "--metrics-model-label (TIERWATCH_METRICS_MODEL_LABEL)"),
        ({"metrics_host_label": "x", "metrics_model_label": "x"}, "give them two names"),
        ({"metrics_listen": "127.0.0.1:99999"}, "--metrics-listen (TIERWATCH_METRICS_LISTEN)"),
    ],
)
def test_agent_settings_refuse_bad_metrics_settings(env, needle):
    with pytest.raises(ValidationError) as info:
        AgentSettings(node="n1", **env)
    assert needle in str(info.value)


def test_agent_settings_metrics_defaults_and_listen_address():
    settings = AgentSettings(node="n1")
    assert (settings.metrics_host_label, settings.metrics_model_label) == ("Hostname", "model_name")
    assert (ExportOptions().host_label, ExportOptions().model_label) == ("Hostname", "model_name")
    assert settings.metrics_address is None
    assert AgentSettings(node="n1", metrics_listen="0.0.0.0").metrics_address == ("0.0.0.0", 9471)
    assert AgentSettings(node="n1", metrics_listen=":9500").metrics_address == ("127.0.0.1", 9500)


# -- values ---------------------------------------------------------------------------------
def test_a_value_that_is_none_is_omitted_never_zero():
    g0 = GpuState(
        info=_info(0),
        sample=_sample(0, temperature_c=None, row_remap_failure=False),
        extras=_extras(0, sm_clock_mhz=None, enc_util_pct=0.0),
    )
    g1 = GpuState(info=_info(1), sample=_sample(1), extras=_extras(1, sm_clock_mhz=1410.0))
    text = render(_snapshot(g0, g1), ExportOptions())
    assert [labels["gpu"] for labels, _ in _lines(text, "DCGM_FI_DEV_GPU_TEMP")] == ["1"]
    assert [(lb["gpu"], v) for lb, v in _lines(text, "DCGM_FI_DEV_SM_CLOCK")] == [("1", 1410.0)]
    # a real 0 (or False) is a value
    assert [(lb["gpu"], v) for lb, v in _lines(text, "DCGM_FI_DEV_ENC_UTIL")] == [("0", 0.0)]
    assert [(lb["gpu"], v) for lb, v in _lines(text, "DCGM_FI_DEV_ROW_REMAP_FAILURE")] == [
        ("0", 0.0)
    ]
    # a field nobody has: no family at all (no HELP/TYPE without samples)
    assert "DCGM_FI_PROF_DRAM_ACTIVE" not in text.decode()


def test_fb_used_is_dcgms_without_reserved_when_the_collector_knows_it():
    g0 = GpuState(
        info=_info(0),
        sample=_sample(0, memory_used_mib=1512.0),
        extras=_extras(0, fb_used_mib=1000.0, fb_reserved_mib=512.0, fb_free_mib=500.0),
    )
    g1 = GpuState(info=_info(1), sample=_sample(1, memory_used_mib=1512.0))  # v1 only
    text = render(_snapshot(g0, g1), ExportOptions())
    used = {lb["gpu"]: v for lb, v in _lines(text, "DCGM_FI_DEV_FB_USED")}
    assert used == {"0": 1000.0, "1": 1512.0}


def test_mig_instances_get_their_own_lines_and_labels():
    mig = [
        MigInstance(gpu_instance_id=1, profile="3g.40gb", fb_used_mib=30000.0, fb_free_mib=10000.0),
        MigInstance(gpu_instance_id=2, profile="3g.40gb", fb_used_mib=100.0),
    ]
    gpu = GpuState(
        info=_info(0),
        sample=_sample(0, memory_used_mib=50000.0),
        extras=_extras(0, fb_free_mib=31000.0, fb_reserved_mib=512.0, mig=mig),
        pci_bus_id="00000000:18:00.0",
        driver_version="550.90.07",
    )
    plain = GpuState(info=_info(1), sample=_sample(1), extras=_extras(1))
    text = render(_snapshot(gpu, plain), ExportOptions())
    temps = _lines(text, "DCGM_FI_DEV_GPU_TEMP")
    assert [(lb["gpu"], lb.get("GPU_I_ID"), lb.get("GPU_I_PROFILE")) for lb, _ in temps] == [
        ("0", "1", "3g.40gb"),
        ("0", "2", "3g.40gb"),
        ("1", None, None),
    ]
    # a device-wide field repeats the GPU's value on each instance's line
    assert [v for _, v in temps] == [50.0, 50.0, 50.0]
    first = temps[0][0]
    assert first == {
        "gpu": "0",
        "UUID": "GPU-test-0",
        "pci_bus_id": "00000000:18:00.0",
        "device": "nvidia0",
        "model_name": MODEL,
        "GPU_I_PROFILE": "3g.40gb",
        "GPU_I_ID": "1",
        "Hostname": "gpu-017",
        "DCGM_FI_DRIVER_VERSION": "550.90.07",
    }
    # instance-scoped fields take the instance's own value, or have no line
    used = {(lb["gpu"], lb.get("GPU_I_ID")): v for lb, v in _lines(text, "DCGM_FI_DEV_FB_USED")}
    assert used == {("0", "1"): 30000.0, ("0", "2"): 100.0, ("1", None): 1000.0}
    free = {(lb["gpu"], lb.get("GPU_I_ID")): v for lb, v in _lines(text, "DCGM_FI_DEV_FB_FREE")}
    assert free == {("0", "1"): 10000.0}  # instance 2 has none; GPU 1 has none either
    assert _lines(text, "DCGM_FI_DEV_FB_RESERVED") == []  # the GPU's 512 MiB is not an instance's
    # the tierwatch_* lines: one per physical GPU, without MIG labels
    stale = _lines(text, "tierwatch_gpu_telemetry_stale")
    assert [lb["gpu"] for lb, _ in stale] == ["0", "1"]
    assert not any("GPU_I_ID" in lb for lb, _ in stale)


def test_simulated_mig_gpu_renders_instance_lines():
    sim = SimulatedCollector("sim-1", gpus=2, seed=3, mig={1: ["1g.10gb", "2g.20gb"]})
    state = MetricsState(node="sim-1", collector=sim.name, simulated=True, version="1")
    state.update(sim.inventory(), sim.collect(), sim.extras())
    text = render(state.snapshot(), ExportOptions())
    tensor = _lines(text, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE")
    keys = [(lb["gpu"], lb.get("GPU_I_PROFILE"), lb.get("GPU_I_ID")) for lb, _ in tensor]
    assert keys == [("0", None, None), ("1", "1g.10gb", "1"), ("1", "2g.20gb", "2")]
    assert all(0 <= v <= 1 for _, v in tensor)
    totals = {lb.get("GPU_I_ID"): v for lb, v in _lines(text, "DCGM_FI_DEV_FB_USED")}
    assert totals["1"] < 10 * 1024 < totals[None]


# -- XIDs -----------------------------------------------------------------------------------
def test_every_xid_is_counted_and_the_gauge_holds_the_last():
    state = MetricsState(node="gpu-017", collector="nvml", simulated=False, version="1")
    state.update([_info(0), _info(1)], [_sample(0), _sample(1)], {})
    for code in (79, 79, 48):
        state.count_xid(XidEvent(gpu=1, xid=code, ts=T0))
    text = render(state.snapshot(), ExportOptions())
    counts = {(lb["gpu"], lb["xid"]): v for lb, v in _lines(text, "tierwatch_xid_events_total")}
    assert counts == {("1", "79"): 2.0, ("1", "48"): 1.0}
    last = {lb["gpu"]: v for lb, v in _lines(text, "DCGM_FI_DEV_XID_ERRORS")}
    assert last == {"0": 0.0, "1": 48.0}  # 0: no XID since the agent started
    assert _help_and_type(text)["tierwatch_xid_events_total"][0] == "counter"


# -- stale telemetry ------------------------------------------------------------------------
def test_a_stale_gpu_has_no_value_lines():
    state = MetricsState(node="gpu-017", collector="nvml", simulated=False, version="1")
    inventory = [_info(0), _info(1)]
    first = [_sample(0), _sample(1)]
    state.update(inventory, first, {0: _extras(0, sm_clock_mhz=1980.0), 1: _extras(1)})
    state.count_xid(XidEvent(gpu=0, xid=79, ts=T0))
    text = render(state.snapshot(), ExportOptions())
    assert {lb["gpu"] for lb, _ in _lines(text, "DCGM_FI_DEV_GPU_TEMP")} == {"0", "1"}

    # GPU 0's collector gave its cached sample again (old ts); GPU 1 was read anew
    later = T0 + timedelta(seconds=5)
    state.update(inventory, [first[0], _sample(1, ts=later)], {1: _extras(1)})
    text = render(state.snapshot(), ExportOptions())
    for name in {n for n, _, _ in parse_series(text.decode()) if n.startswith("DCGM_FI")}:
        assert {lb["gpu"] for lb, _ in _lines(text, name)} == {"1"}, name
    stale = {lb["gpu"]: v for lb, v in _lines(text, "tierwatch_gpu_telemetry_stale")}
    assert stale == {"0": 1.0, "1": 0.0}
    seen = {lb["gpu"]: v for lb, v in _lines(text, "tierwatch_gpu_last_sample_timestamp_seconds")}
    assert seen == {"0": T0.timestamp(), "1": later.timestamp()}
    # the XID counter keeps its series, and its labels (the last known identity)
    [(labels, count)] = _lines(text, "tierwatch_xid_events_total")
    assert (labels["gpu"], labels["pci_bus_id"], count) == ("0", "00000000:18:00.0", 1.0)

    # read again: live again
    again = later + timedelta(seconds=5)
    state.update(inventory, [_sample(0, ts=again), _sample(1, ts=again)], {})
    text = render(state.snapshot(), ExportOptions())
    assert {lb["gpu"] for lb, _ in _lines(text, "DCGM_FI_DEV_GPU_TEMP")} == {"0", "1"}


def test_a_gpu_without_sample_and_a_stalled_agent_are_stale():
    state = MetricsState(
        node="gpu-017", collector="nvml", simulated=False, version="1", max_age_s=15.0
    )
    state.update([_info(0), _info(1)], [_sample(0)], {}, now=100.0)
    text = render(state.snapshot(now=101.0), ExportOptions())
    assert {lb["gpu"] for lb, _ in _lines(text, "DCGM_FI_DEV_GPU_TEMP")} == {"0"}
    stale = {lb["gpu"]: v for lb, v in _lines(text, "tierwatch_gpu_telemetry_stale")}
    assert stale == {"0": 0.0, "1": 1.0}
    # no new readings for longer than max_age_s: nothing is live
    text = render(state.snapshot(now=116.0), ExportOptions())
    assert not [n for n, _, _ in parse_series(text.decode()) if n.startswith("DCGM_FI")]
    stale = {lb["gpu"]: v for lb, v in _lines(text, "tierwatch_gpu_telemetry_stale")}
    assert stale == {"0": 1.0, "1": 1.0}


def test_simulated_freeze_makes_the_gpu_stale():
    sim = SimulatedCollector("sim-1", gpus=2, seed=3)
    state = MetricsState(node="sim-1", collector=sim.name, simulated=True, version="1")
    state.update(sim.inventory(), sim.collect(), sim.extras())
    sim.inject("freeze", gpu=1)  # GPU 1 repeats its last sample, with its old ts
    state.update(sim.inventory(), sim.collect(), sim.extras())
    text = render(state.snapshot(), ExportOptions())
    assert {lb["gpu"] for lb, _ in _lines(text, "DCGM_FI_DEV_GPU_TEMP")} == {"0"}


def test_without_dcgm_fields_only_tierwatch_series():
    gpu = GpuState(info=_info(0), sample=_sample(0), extras=_extras(0))
    text = render(_snapshot(gpu), ExportOptions(dcgm_fields=False))
    names = {n for n, _, _ in parse_series(text.decode())}
    assert names == {
        "tierwatch_agent_info",
        "tierwatch_gpu_telemetry_stale",
        "tierwatch_gpu_last_sample_timestamp_seconds",
    }


# -- promtool -------------------------------------------------------------------------------
def promtool_findings(text: bytes) -> tuple[int, set[str]]:
    """``promtool check metrics`` on ``text``: its exit status and its finding lines."""
    promtool = require_executable("promtool", "prometheus")
    out = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=60, check=False
    )
    lines = (out.stdout + out.stderr).decode().splitlines()
    return out.returncode, {line.strip() for line in lines if line.strip()}


def _full_gpu(index: int) -> GpuState:
    sim = SimulatedCollector("sim-1", gpus=1, seed=index)
    sample = sim.collect()[0].model_copy(update={"index": index})
    extras = sim.extras()[0].model_copy(update={"index": index})
    return GpuState(info=_info(index), sample=sample, extras=extras, pci_bus_id="x")


@pytest.mark.parametrize(
    "options",
    [
        ExportOptions(),
        ExportOptions(model_label="modelName"),
        ExportOptions(model_label="modelName", dcgm_names=True),
    ],
    ids=["defaults", "modelName", "dcgm-exact"],
)
def test_promtool_passes_with_the_defaults_and_lint_findings_says_what_the_others_get(options):
    """The full exposition (every field, XID lines) passes promtool with the default options;
    the options that restore dcgm-exporter's exact names get exactly the findings that
    :func:`lint_findings` lists, and never one on a ``tierwatch_*`` family."""
    gpus = [replace(_full_gpu(i), last_xid=79, xid_counts={79: 1}) for i in range(2)]
    text = render(_snapshot(*gpus), options)
    meta = _help_and_type(text)
    served = {f.served_name(options): f.served_type(options) for f in (*DCGM_FIELDS, XID_ERRORS)}
    assert served.keys() <= meta.keys()
    assert {n: meta[n][0] for n in served} == served
    expected = set().union(*(lint_findings(n, t, options) for n, t in served.items()))
    rc, found = promtool_findings(text)
    assert found == expected
    assert rc == (3 if expected else 0)
    if options == ExportOptions():
        assert rc == 0
        assert not found
    else:
        assert expected
    if options.dcgm_names:  # dcgm-exporter's own six, besides the camelCase label
        camel = {x for x in found if "camelCase" in x}
        assert len(found - camel) == 6, found - camel


def test_the_relabel_rules_cover_every_renamed_family():
    rules = dcgm_relabel_configs()
    renames = {r["regex"]: r["replacement"] for r in rules if r.get("target_label") == "__name__"}
    assert renames == {"tierwatch_gpu_pcie_replays": "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"}
    assert rules[0]["source_labels"] == ["model_name"]
    assert rules[0]["target_label"] == "modelName"
