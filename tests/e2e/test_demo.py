"""`make demo` runs scripts/demo.py: it must bring up 4 live simulated nodes and exit 0."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import httpx
import pytest
from procs import REPO_ROOT, free_port, port_block, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_demo_brings_up_four_live_nodes_and_exits_zero(tmp_path):
    port, agent_port = free_port(), port_block(4)
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "demo.py"),
            "--seconds",
            "25",
            "--port",
            str(port),
            "--agent-port",
            str(agent_port),
            "--var-dir",
            str(tmp_path / "demo"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        url = f"http://127.0.0.1:{port}"
        token = wait_for(
            lambda: next(
                (m.group(1) for line in lines if (m := re.search(r"sign in\s+:\s+(tw_\S+)", line))),
                None,
            ),
            timeout=60,
            what="the demo banner",
        )
        assert any(f"{url}/" in line for line in lines)

        def live():
            r = httpx.get(f"{url}/api/v1/nodes", headers={"Authorization": f"Bearer {token}"})
            body = r.json()
            return (
                len(body["nodes"]) == 4
                and body["counts"]["healthy"] == 4
                and all(n["simulated"] and len(n["gpus"]) == 8 for n in body["nodes"])
            )

        wait_for(live, timeout=30, what="4 healthy simulated nodes with 8 GPUs")
        assert proc.wait(timeout=60) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(5)
    assert "demo stopped" in "".join(lines)
