"""examples/launch.py --standby: ranks start before their nodes are known and take them
from the supervisor's go file; a bad go file or bad options are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "examples" / "launch.py"

# A stand-in for a training script: it waits for the go file the way train_gpt.py does and
# writes what it got (the launcher's interface is the environment and the go file).
SCRIPT = """
import json, os, sys, time
sys.path.insert(0, {examples!r})
from train_gpt import wait_for_go
if os.environ.get("TIERWATCH_GO_FILE"):
    wait_for_go(os.environ["TIERWATCH_GO_FILE"])
out = {{k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "TIERWATCH_NODE",
                                       "TIERWATCH_AGENT_URL")}}
open(os.path.join({out!r}, "rank-" + os.environ["RANK"] + ".json"), "w").write(json.dumps(out))
"""


def script(tmp_path: Path) -> Path:
    p = tmp_path / "fake_train.py"
    p.write_text(SCRIPT.format(examples=str(REPO / "examples"), out=str(tmp_path)))
    return p


def test_standby_ranks_take_their_nodes_from_the_go_file(tmp_path):
    go, ranks = tmp_path / "go.json", tmp_path / "ranks.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(LAUNCH),
            "--standby",
            str(go),
            "--nnodes",
            "2",
            "--ranks-file",
            str(ranks),
            "--",
            str(script(tmp_path)),
        ]
    )
    try:
        assert not ranks.exists()  # no layout before the go file
        go.write_text(
            json.dumps({"nodes": [["n1", "http://127.0.0.1:1"], ["n2", "http://127.0.0.1:2"]]})
        )
        assert proc.wait(120) == 0
    finally:
        proc.kill()
    got = {r: json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)}
    assert [got[r]["TIERWATCH_NODE"] for r in range(2)] == ["n1", "n2"]
    assert got[1]["TIERWATCH_AGENT_URL"] == "http://127.0.0.1:2"
    assert {g["WORLD_SIZE"] for g in got.values()} == {"2"}
    placed = json.loads(ranks.read_text())["ranks"]
    assert [(p["rank"], p["node"]) for p in placed] == [(0, "n1"), (1, "n2")]


def test_a_malformed_go_file_stops_the_standby_with_the_reason(tmp_path):
    go = tmp_path / "go.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(LAUNCH),
            "--standby",
            str(go),
            "--nnodes",
            "2",
            "--",
            str(script(tmp_path)),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    go.write_text(json.dumps({"nodes": [["only-one", "http://127.0.0.1:1"]]}))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "with 2 nodes" in err


def test_nodes_and_standby_together_are_refused(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(LAUNCH),
            "--node",
            "a=http://127.0.0.1:1",
            "--standby",
            str(tmp_path / "go.json"),
            "--nnodes",
            "1",
            "--",
            "x.py",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "not both" in r.stderr
    r = subprocess.run(
        [sys.executable, str(LAUNCH), "--standby", str(tmp_path / "go.json"), "--", "x.py"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "--standby needs --nnodes" in r.stderr
