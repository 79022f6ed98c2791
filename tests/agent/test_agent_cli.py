"""tierwatch-agent CLI: inject exit codes, settings errors, light imports, run + SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from agent_helpers import TOKEN, FakeGpu, make_fake_pynvml, wait_until
from typer.testing import CliRunner

from tierwatch.agent.cli import EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_USAGE, app
from tierwatch.agent.collectors.nvml import NvmlCollector
from tierwatch.agent.collectors.simulated import SimulatedCollector
from tierwatch.agent.config import AgentSettings
from tierwatch.agent.netutil import free_port
from tierwatch.agent.runtime import AgentRuntime

runner = CliRunner()


def _agent(receiver, tmp_path, collector):
    settings = AgentSettings(
        node="node-a",
        server=receiver.url,
        token=TOKEN,
        spool_dir=tmp_path / "spool",
        listen="127.0.0.1:0",
        memory_dir=tmp_path / "memory",
    )
    runtime = AgentRuntime(settings, collector=collector, flush_timeout_s=1.0)
    runtime.start(serve_api=True)
    return runtime


@pytest.fixture
def sim_agent(receiver, tmp_path):
    runtime = _agent(receiver, tmp_path, SimulatedCollector("node-a", gpus=4, seed=1))
    yield f"http://127.0.0.1:{runtime.api_port}"
    runtime.shutdown()


def test_inject_ok(sim_agent, receiver):
    result = runner.invoke(
        app, ["inject", "--token", TOKEN, "--agent", sim_agent, "xid", "79", "--gpu", "3"]
    )
    assert result.exit_code == 0, result.output
    assert "XID 79 on GPU 3" in result.output
    wait_until(lambda: any(b.xids for b in receiver.stored()), what="XID batch")
    result = runner.invoke(
        app, ["inject", "--token", TOKEN, "--agent", sim_agent, "temp", "95", "--gpu", "1"]
    )
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["meltdown"], "fault"),
        (["thermal", "--gpu", "9"], "out of range"),
        (["xid"], "needs a value"),
    ],
)
def test_inject_refused_input(sim_agent, args, needle):
    result = runner.invoke(app, ["inject", "--token", TOKEN, "--agent", sim_agent, *args])
    assert result.exit_code == EXIT_REFUSED
    assert "refused (HTTP 422)" in result.output
    assert needle in result.output


def test_inject_refused_on_real_collector(receiver, tmp_path):
    collector = NvmlCollector(nvml=make_fake_pynvml([FakeGpu(index=0)]), event_wait_ms=50)
    runtime = _agent(receiver, tmp_path, collector)
    try:
        result = runner.invoke(
            app,
            [
                "inject",
                "--token",
                TOKEN,
                "--agent",
                f"http://127.0.0.1:{runtime.api_port}",
                "thermal",
            ],
        )
    finally:
        runtime.shutdown()
    assert result.exit_code == EXIT_REFUSED
    assert "HTTP 409" in result.output
    assert "--collector simulated" in result.output


def test_inject_without_the_agent_token_is_a_usage_error(sim_agent, tmp_path):
    result = runner.invoke(app, ["inject", "--agent", sim_agent, "clear"], env={})
    assert result.exit_code == 2
    assert "only with its agent token" in result.output
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    ok = runner.invoke(
        app, ["inject", "--token-file", str(token_file), "--agent", sim_agent, "clear"], env={}
    )
    assert ok.exit_code == 0, ok.output


def test_inject_unreachable():
    port = free_port()
    result = runner.invoke(
        app, ["inject", "--token", TOKEN, "--agent", f"http://127.0.0.1:{port}", "clear"]
    )
    assert result.exit_code == EXIT_UNREACHABLE
    assert "cannot reach the agent" in result.output


def test_run_without_required_settings(monkeypatch):
    for name in ("NODE", "SERVER", "TOKEN"):
        monkeypatch.delenv(f"TIERWATCH_{name}", raising=False)
    result = runner.invoke(app, ["run", "--node", "n1"])
    assert result.exit_code == EXIT_USAGE
    assert "--server (TIERWATCH_SERVER)" in result.output
    assert "--token (TIERWATCH_TOKEN)" in result.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["--metrics-host-label", "host-name"],
            "--metrics-host-label (TIERWATCH_METRICS_HOST_LABEL)",
        ),
        (["--metrics-model-label", "gpu"], "a label /metrics sets itself"),
        (["--metrics-listen", "127.0.0.1:70000"], "--metrics-listen (TIERWATCH_METRICS_LISTEN)"),
    ],
)
def test_run_refuses_bad_metrics_settings(args, needle):
    result = runner.invoke(
        app, ["run", "--node", "n1", "--server", "http://127.0.0.1:9", "--token", TOKEN, *args]
    )
    assert result.exit_code == EXIT_USAGE
    assert result.output.startswith("error: metrics_")
    assert needle in result.output


@pytest.mark.parametrize("value", ["0", "721"])
def test_run_refuses_a_full_sample_period_out_of_range(value):
    result = runner.invoke(
        app,
        ["run", "--node", "n1", "--server", "http://127.0.0.1:9", "--token", TOKEN]
        + ["--full-sample-every", value],
    )
    assert result.exit_code == EXIT_USAGE
    assert result.output.startswith("error: full_sample_every: Input should be")


def test_cli_import_is_light():
    code = (
        "import sys, tierwatch.agent.cli; "
        "bad = [m for m in ('torch', 'tierwatch.server', 'uvicorn', 'fastapi') "
        "if m in sys.modules]; print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.e2e
def test_run_process_reports_and_exits_0_on_sigterm(receiver, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "TIERWATCH_TOKEN": TOKEN, "TIERWATCH_SIM_SEED": "5"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tierwatch.agent.cli",
            "run",
            "--node",
            "node-a",
            "--server",
            receiver.url,
            "--collector",
            "simulated",
            "--sim-gpus",
            "2",
            "--interval",
            "0.1",
            "--listen",
            "127.0.0.1:0",
            "--spool-dir",
            str(tmp_path),
            "--memory-dir",
            str(tmp_path / "memory"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: len(receiver.stored()) >= 2, timeout=20, what="agent reports")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert "all reports delivered" in stderr
    batches = receiver.stored()
    assert all(b.simulated and b.collector == "simulated" for b in batches)
    # each seq once, none missing (a backlog, e.g. at shutdown, goes newest first)
    assert sorted(b.seq for b in batches) == list(range(1, len(batches) + 1))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_inject_refuses_non_finite_values_without_a_traceback(value):
    result = runner.invoke(
        app, ["inject", "--token", TOKEN, "--agent", "http://127.0.0.1:9", "temp", "--", value]
    )
    assert result.exit_code == EXIT_USAGE
    assert "finite number" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
