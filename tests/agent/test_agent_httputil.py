"""error_detail: what an HTTP error response says (one helper for the CLI, reporter, peers);
atomic writes (one helper for spool, manifests and markers)."""

from __future__ import annotations

import httpx
import pytest

from tierwatch.agent.fsutil import atomic_write_bytes, atomic_write_json
from tierwatch.agent.httputil import error_detail


@pytest.mark.parametrize(
    ("kwargs", "limit", "expected"),
    [
        ({"json": {"detail": "job_id 'x y': use letters"}}, 1000, "job_id 'x y': use letters"),
        (
            {
                "json": {
                    "detail": [
                        {"loc": ["body", "gpu"], "msg": "must be ≥ 0"},
                        {"loc": ["body"], "msg": "bad"},
                    ]
                }
            },
            1000,
            "gpu: must be ≥ 0; body: bad",
        ),
        ({"json": {"error": "other"}}, 1000, "{'error': 'other'}"),
        ({"json": ["a", "b"]}, 1000, "['a', 'b']"),
        ({"text": "plain failure"}, 1000, "plain failure"),
        ({"text": ""}, 1000, "Service Unavailable"),
        ({"json": {"detail": "x" * 50}}, 10, "x" * 10),
        ({"text": "y" * 50}, 5, "y" * 5),
    ],
)
def test_error_detail(kwargs, limit, expected):
    assert error_detail(httpx.Response(503, **kwargs), limit=limit) == expected


def test_atomic_writes_replace_whole_files_and_leave_no_temporary(tmp_path):
    path = tmp_path / "a.json"
    atomic_write_json(path, {"step": 1})
    atomic_write_bytes(path, b'{"step": 2}', fsync=False)
    assert path.read_bytes() == b'{"step": 2}'
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
    with pytest.raises(FileNotFoundError):
        atomic_write_bytes(tmp_path / "missing" / "b.json", b"x")
