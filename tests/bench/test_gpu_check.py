"""bench/gpu_check.py's parts that need no GPU: arguments, the no-CUDA exit, the bit-equal
comparison, the NVML verdict, the timing arithmetic and the benchmarks page section."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import gpu_check


def test_arguments() -> None:
    assert gpu_check.parse_args([]).doc == gpu_check.DOC
    assert gpu_check.parse_args(["--dry-run-cpu"]).doc is None
    assert gpu_check.parse_args(["--dry-run-cpu", "--doc", "x.md"]).doc == Path("x.md")
    assert gpu_check.parse_args(["--no-doc"]).doc is None


def test_without_cuda_exits_2_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    assert capsys.readouterr().err.startswith("no CUDA device: ")


def test_stager_options_pin_on_cuda_only() -> None:
    assert gpu_check.stager_options(True) == {
        "use_pinned_memory": True,
        "use_shared_memory": False,
        "use_async_staging": True,
        "use_non_blocking_copy": True,
    }
    cpu = gpu_check.stager_options(False)
    assert not cpu["use_pinned_memory"]
    assert not cpu["use_non_blocking_copy"]


def test_compare_is_bit_exact() -> None:
    w = torch.arange(8, dtype=torch.float32)
    ref = gpu_check.flatten({"model": {"w": w}, "optim": {"param_groups": [{"lr": 0.1}]}})
    assert set(ref) == {"model.w", "optim.param_groups.0.lr"}
    assert (
        gpu_check.compare(ref, {k: v.clone() if hasattr(v, "clone") else v for k, v in ref.items()})
        == []
    )
    flipped = w.clone()
    flipped.view(torch.int32)[3] ^= 1  # one mantissa bit
    assert gpu_check.compare(ref, {**ref, "model.w": flipped}) == ["model.w: 1 of 32 bytes differ"]
    nan = torch.tensor([float("nan"), 0.0])
    assert gpu_check.compare({"x": nan}, {"x": nan.clone()}) == []  # NaN == NaN bitwise
    assert gpu_check.compare({"x": nan}, {"x": torch.tensor([float("nan"), -0.0])}) == [
        "x: 1 of 8 bytes differ"
    ]
    assert gpu_check.compare({"x": w}, {"x": w.double()}) == [
        "x: torch.float32[8] vs torch.float64[8]"
    ]
    assert gpu_check.compare({"x": w, "lr": 0.1}, {"lr": 0.2}) == [
        "lr: 0.1 vs 0.2",
        "x: not loaded",
    ]


def test_local_cpu_is_a_copy() -> None:
    t = torch.ones(3)
    c = gpu_check.local_cpu(t)
    t += 1
    assert c.tolist() == [1.0, 1.0, 1.0]
    assert gpu_check.local_cpu(5) == 5


def test_nvml_verdict() -> None:
    metrics = ["temperature_c", "power_w", "nvlink_crc_errors"]
    sample = {"temperature_c": 40, "power_w": None, "nvlink_crc_errors": 0}
    ok = gpu_check.nvml_verdict([sample], [{"kind": "xid_unavailable", "message": "m"}], metrics)
    assert ok == {
        "ok": True,
        "read": ["temperature_c", "nvlink_crc_errors"],
        "unsupported": ["power_w"],
        "errors": [],
        "missing": [],
    }
    bad = gpu_check.nvml_verdict(
        [{"temperature_c": 40}], [{"kind": "nvml_field_error", "message": "boom"}], metrics
    )
    assert not bad["ok"]
    assert bad["missing"] == ["power_w", "nvlink_crc_errors"]
    assert bad["errors"] == ["nvml_field_error: boom"]
    assert not gpu_check.nvml_verdict([], [], metrics)["ok"]


def test_timing_summary() -> None:
    timing = {
        "baseline": {"step_s": [0.010] * 4, "opt_s": [0.001, 0.001, 0.003]},
        "state_bytes": 123,
        "stager": {"use_pinned_memory": True},
        gpu_check.TIERED: {
            "save_s": [0.002, 0.004],
            "next_opt_s": [0.006, 0.0],
            "step_s": [0.012] * 4,
        },
        gpu_check.ASYNC: {
            "save_s": [0.008, 0.008],
            "next_opt_s": [0.001, 0.001],
            "step_s": [0.014] * 4,
        },
    }
    out = gpu_check.timing_summary(timing)
    tiered, asynced = out["methods"][gpu_check.TIERED], out["methods"][gpu_check.ASYNC]
    # blocking = save call + next optimizer.step over the 1 ms median (never below 0)
    assert tiered["blocking_s"] == pytest.approx((0.007 + 0.004) / 2)
    assert asynced["blocking_s"] == pytest.approx(0.008)
    assert tiered["overhead"] == pytest.approx(0.2)
    assert out["blocking_ratio"] == pytest.approx(0.0055 / 0.008)
    assert out["overhead_ratio"] == pytest.approx(0.002 / 0.004)


def _results(**over: object) -> dict:
    run = {
        "backend": "nccl",
        "device": "cuda:0",
        "saved": [0, 1],
        "committed": [0, 1],
        "compared": 10,
        "mismatches": [],
        "latency": {"ms": 0.05, "device": "cuda:0"},
    }
    results = {
        "date": "2026-12-02 00:00 UTC",
        "machine": "m",
        "command": "bench/gpu_check.py",
        "wall_s": 100.0,
        "sizes": gpu_check.CUDA_SIZES.__dict__,
        "ws1": run,
        "ws2": {**run, "backend": "gloo"},
        "nvml": {"ok": True, "read": ["a"], "unsupported": ["b"], "errors": [], "missing": []},
        "timing": None,
    }
    results.update(over)
    return results


def test_render_marks_failures() -> None:
    good = gpu_check.render(_results())
    assert "**FAILED**" not in good
    assert "| NVML collector | ok | 1 fields read; unsupported (None): b |" in good
    torn = _results(
        ws2={**_results()["ws2"], "mismatches": ["step 1: model.0.weight: 4 of 16 bytes differ"]}
    )
    text = gpu_check.render(torn)
    assert (
        "| FSDP2, 2 processes, one GPU: committed steps bit-equal to .cpu() | **FAILED** |" in text
    )
    assert "step 1: model.0.weight" in text
    lost = _results(ws1={**_results()["ws1"], "committed": [1]})
    assert [ok for _, ok, _ in gpu_check.check_rows(lost)][0] is False


def test_write_doc_replaces_only_its_section() -> None:
    page = (
        "# Benchmarks\n\n## Ingest\n\ni\n\n"
        "## GPU check (bench/gpu_check.py)\n\nstale result\n\n## Demo\n\nd\n"
    )
    out = gpu_check.write_doc(page, "new block")
    assert "stale result" not in out
    assert "new block" in out
    assert out.index("## Ingest") < out.index("## GPU check") < out.index("## Demo")
    assert out.endswith("## Demo\n\nd\n")
    assert gpu_check.write_doc(out, "new block") == out  # idempotent
    appended = gpu_check.write_doc("# Benchmarks\n\n## Ingest\n\ni\n", "b")
    assert appended.startswith(
        "# Benchmarks\n\n## Ingest\n\ni\n\n## GPU check (bench/gpu_check.py)\n"
    )
    assert appended.rstrip().endswith("b")
