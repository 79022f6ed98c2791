"""With NVML present the demo's agents read the real GPUs (stand-in pynvml here: no GPU),
and GPU faults, which cannot be injected into a real GPU, are made real as lost hosts."""

from __future__ import annotations

from agent_helpers import FakeGpu, make_fake_pynvml

from demo import faults
from demo.cluster import nvml_gpus


def test_nvml_with_gpus_is_detected():
    assert nvml_gpus(make_fake_pynvml([FakeGpu(index=0), FakeGpu(index=1)])) == 2


def test_no_driver_means_simulated():
    assert (
        nvml_gpus(make_fake_pynvml([FakeGpu(index=0)], init_error="NVMLError_DriverNotLoaded")) == 0
    )
    assert nvml_gpus(make_fake_pynvml([])) == 0


def test_this_machine_has_no_gpu_so_the_demo_simulates():
    assert nvml_gpus() == 0  # the real nvidia-ml-py: no libnvidia-ml here


def test_gpu_faults_become_lost_hosts_on_real_gpus():
    gpu = faults.FailureKind("Faulty GPU", "GPU", 148, "node")
    assert faults.effect_of(gpu).action == "gpu"
    assert faults.effect_of(gpu, real_gpus=True).action == "host"
    bug = faults.FailureKind("Software Bug", "Dependency", 54, "process")
    assert faults.effect_of(bug, real_gpus=True).action == "process"
    sdc = faults.FailureKind("Silent Data Corruption", "GPU", 6, "rollback")
    assert faults.effect_of(sdc, real_gpus=True).action == "sdc"
