"""Fixtures for the agent tests (helpers live in ``agent_helpers``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from agent_helpers import Receiver


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A report receiver on 127.0.0.1 (ephemeral port), stopped after the test."""
    r = Receiver()
    yield r
    r.stop()
