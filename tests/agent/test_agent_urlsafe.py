"""Credentials are redacted from URLs wherever the agent logs or returns them.

A table of :func:`redact_url` cases, then a real :class:`CheckpointService` whose persistent
URL carries a password and a signature: neither ``GET /v1/ckpt/info``'s answer, nor
``agent.json``, nor the start-up log line shows them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from agent_helpers import TOKEN

from tierwatch.agent.checkpoint.tierstore.api import CheckpointService
from tierwatch.agent.config import AgentSettings
from tierwatch.agent.urlsafe import redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("s3://KEY:SECRET@bucket/prefix", "s3://KEY:***@bucket/prefix"),
        ("s3://AKIA:ab/cd+ef@bucket/prefix", "s3://AKIA:***@bucket/prefix"),
        ("https://user:pass@host/x", "https://user:***@host/x"),
        ("https://user:1234@host:8443/x", "https://user:***@host:8443/x"),
        ("https://user@host/x", "https://user@host/x"),
        ("https://host:8080/a@b", "https://host:8080/a@b"),
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=ab12&x=1",
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&x=1",
        ),
        (
            "https://a.blob.core.windows.net/c?sv=2022&sig=abc%3D",
            "https://a.blob.core.windows.net/c?sv=2022&sig=***",
        ),
        ("https://h/x?access_token=t&page=2#frag", "https://h/x?access_token=***&page=2#frag"),
        ("https://u:p@h/x?Token=t", "https://u:***@h/x?Token=***"),
        ("https://h/x?sig=", "https://h/x?sig="),
        ("http://cp:8000", "http://cp:8000"),
        ("file:///data/run@1/ckpt", "file:///data/run@1/ckpt"),
        ("/var/checkpoints", "/var/checkpoints"),
        ("", ""),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_ckpt_info_agent_file_and_log_hide_persistent_credentials(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = "memory://user:hunter2@bucket/prefix?sig=s3cr3tsig"
    settings = AgentSettings(
        node="node-a",
        server="http://127.0.0.1:9",
        token=TOKEN,
        spool_dir=tmp_path / "spool",
        memory_dir=tmp_path / "memory",
        state_dir=tmp_path / "state",
        persistent_url=url,
        memory_budget=64 * 2**20,
    )
    svc = CheckpointService(settings, emit=lambda _event: None)
    caplog.set_level(logging.INFO)
    svc.start("127.0.0.1", 9470)
    try:
        info = svc.info()
        agent_file = json.loads(svc.store.layout.agent_file.read_text())
    finally:
        svc.stop()
    assert svc.persistent.url.startswith("memory://user:hunter2@")  # still what it connects with
    assert info["persistent_url"] == "memory://user:***@bucket/prefix?sig=***"
    assert agent_file["persistent_url"] == info["persistent_url"]
    for text in (json.dumps(info), json.dumps(agent_file), caplog.text):
        assert "hunter2" not in text
        assert "s3cr3tsig" not in text
    assert "memory://user:***@bucket/prefix" in caplog.text


def test_ckpt_cli_does_not_connect_with_agent_files_redacted_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from tierwatch.agent.checkpoint.tierstore import cli as ckpt_cli

    monkeypatch.delenv("TIERWATCH_PERSISTENT_URL", raising=False)
    memory = tmp_path / "memory"
    memory.mkdir()
    (memory / "agent.json").write_text(
        json.dumps({"node": "node-a", "persistent_url": "s3://KEY:***@bucket/prefix"})
    )
    out = CliRunner().invoke(ckpt_cli.app, ["ls", "--job", "j1", "--memory-dir", str(memory)])
    assert out.exit_code == 2, out.output
    assert "redacted; pass --persistent-url (TIERWATCH_PERSISTENT_URL)" in out.output


def test_reporter_and_dcgm_exporter_errors_hide_url_credentials(tmp_path: Path) -> None:
    from tierwatch.agent.collectors.base import CollectorError
    from tierwatch.agent.collectors.dcgm_exporter import DcgmExporterCollector
    from tierwatch.agent.netutil import free_port
    from tierwatch.agent.reporter import Reporter, TransientReportError

    port = free_port()  # nothing listens there
    reporter = Reporter(
        node="node-a",
        server=f"http://user:hunter2@127.0.0.1:{port}/?token=s3cr3ttok",
        token=TOKEN,
        spool_dir=tmp_path / "spool",
        collector="simulated",
        simulated=True,
        interval_s=1.0,
        timeout_s=1.0,
    )
    try:
        with pytest.raises(TransientReportError) as err:
            reporter._post_once(b"{}")
    finally:
        reporter.close(flush_timeout_s=0.1)
    assert f"cannot reach http://user:***@127.0.0.1:{port}/?token=***" in str(err.value)
    collector = DcgmExporterCollector(
        f"http://user:hunter2@127.0.0.1:{port}/metrics", timeout_s=1.0
    )
    with pytest.raises(CollectorError) as cerr:
        collector.start(lambda _event: None)
    collector.shutdown()
    assert f"http://user:***@127.0.0.1:{port}/metrics" in str(cerr.value)
    for text in (str(err.value), str(cerr.value)):
        assert "hunter2" not in text
        assert "s3cr3ttok" not in text
