"""Fixtures for the checkpoint tests (tests/agent/checkpoint/ mirrors agent/checkpoint/).

Helpers that tests call directly (``write_step``, ``CkptAgent``, event waits) live in
``ckpt_helpers`` (tests/helpers/, on pytest's pythonpath); the fixtures here start and stop
what a test needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import Receiver
from ckpt_helpers import CkptAgent


@pytest.fixture
def persistent_dir(tmp_path: Path) -> Path:
    """An empty folder for the persistent tier (``file://`` URL of the agents)."""
    d = tmp_path / "persistent"
    d.mkdir()
    return d


@pytest.fixture
def make_agent(
    tmp_path: Path, receiver: Receiver, persistent_dir: Path
) -> Iterator[Callable[..., CkptAgent]]:
    """``make_agent("node-a", **kw) -> CkptAgent`` (not started); all stopped afterwards."""
    made: list[CkptAgent] = []

    def _make(node: str, **kw: Any) -> CkptAgent:
        kw.setdefault("persistent_url", f"file://{persistent_dir}")
        agent = CkptAgent(node=node, workdir=tmp_path / "agents", receiver=receiver, **kw)
        made.append(agent)
        return agent

    yield _make
    for a in made:
        a.stop()
