"""Packaging: app/ and agent/ install as tierwatch.server and tierwatch.agent only."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installs_only_under_tierwatch(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = tmp_path.glob("tierwatch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"tierwatch", "tierwatch-0.1.0.dist-info"}
    for expected in (
        "tierwatch/server/main.py",
        "tierwatch/agent/protocol.py",
        "tierwatch/server/data/xid_catalog.csv",
        "tierwatch/server/data/llama3_interruptions.csv",
        "tierwatch/server/templates/base.html",
        "tierwatch/server/migrations/env.py",
        "tierwatch/server/migrations/versions/0001_initial_schema.py",
        "tierwatch/server/migrations/versions/0002_checkpoint_ledger.py",
        "tierwatch/agent/checkpoint/training/checkpointer.py",
    ):
        assert expected in names, expected
    assert not any(n.startswith(("app/", "agent/")) for n in names)


def test_no_generic_top_level_packages_are_importable(tmp_path):
    code = (
        "import importlib.util as u, tierwatch.server, tierwatch.agent;"
        "print(u.find_spec('app'), u.find_spec('agent'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["None", "None"]


@pytest.mark.parametrize(
    "module",
    [
        "tierwatch",
        "tierwatch.agent.cli",
        "tierwatch.server.main",
        "tierwatch.agent.protocol",
        "tierwatch.agent.runtime",
        "tierwatch.agent.checkpoint.tierstore.api",
        "tierwatch.agent.checkpoint.tierstore.worker",
        "tierwatch.agent.checkpoint.tierstore.restore_staging",
        "tierwatch.agent.checkpoint.format.agreement",
        "tierwatch.agent.checkpoint.training.client",
        "tierwatch.agent.checkpoint.training.rollback",
        "tierwatch.agent.checkpoint.tierstore.cli",
        "tierwatch.agent.checkpoint.tierstore.requests",
        "tierwatch.agent.checkpoint.format.rollback",
    ],
)
def test_server_and_agent_do_not_import_torch(module, tmp_path):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_training_api_is_a_lazy_re_export(tmp_path):
    code = (
        "import sys, tierwatch; before = 'torch' in sys.modules; "
        "from tierwatch import TieredCheckpointer, RNGState, ResumableDistributedSampler; "
        "print(before, 'torch' in sys.modules, TieredCheckpointer.__module__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [
        "False",
        "True",
        "tierwatch.agent.checkpoint.training.checkpointer",
    ]
    bad = subprocess.run(
        [sys.executable, "-c", "from tierwatch import Nope"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert "cannot import name 'Nope'" in bad.stderr
