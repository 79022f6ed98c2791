"""Concurrent isolate/release of one node against a real server process (SQLite and
PostgreSQL): no 5xx, and the audit log tells one consistent story: in id order, the entries
with outcome "ok" alternate isolate, release, isolate…, each answer's ``changed`` matches its
entry, and the node's final ``isolated`` flag is the effect of the last "ok" entry.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from security_support import seed_cluster
from support import auth

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

THREADS = 20
ROUNDS = 3  # requests per thread, alternating


def _hammer(url: str, token: str) -> list[tuple[str, int, bool | None]]:
    """THREADS threads, released together, each sending ROUNDS alternating requests
    (even threads start with isolate, odd ones with release). Returns (action, status,
    changed) per request."""
    barrier = threading.Barrier(THREADS)

    def worker(i: int) -> list[tuple[str, int, bool | None]]:
        out = []
        with httpx.Client(base_url=url, headers=auth(token), timeout=60) as c:
            barrier.wait()
            for k in range(ROUNDS):
                action = ("isolate", "release")[(i + k) % 2]
                r = c.post(f"/api/v1/nodes/n1/{action}", json={"reason": f"t{i}-{k}"})
                changed = r.json().get("changed") if r.status_code == 200 else None
                out.append((action, r.status_code, changed))
        return out

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(worker, range(THREADS)))
    return [x for per_thread in results for x in per_thread]


def test_concurrent_isolate_release_leaves_a_consistent_state(server, make_token):
    tokens = {
        "agent_n1": make_token("agent", "n1"),
        "agent_n2": make_token("agent", "n2"),
        "viewer": make_token("viewer"),
        "operator": make_token("operator"),  # (registers the seeded job)
    }
    operator = tokens["operator"]
    with httpx.Client(base_url=server.url, timeout=30) as c:
        seed_cluster(c, tokens)  # type: ignore[arg-type]

    answers = _hammer(server.url, operator)

    statuses = sorted({status for _, status, _ in answers})
    assert statuses == [200], f"statuses {statuses}\n{server.proc.log_tail()}"
    with httpx.Client(base_url=server.url, headers=auth(tokens["viewer"]), timeout=30) as c:
        entries = c.get("/api/v1/audit", params={"target": "n1", "limit": 1000}).json()
        node = c.get("/api/v1/nodes/n1").json()
    entries = sorted(
        (e for e in entries if e["action"] in ("isolate", "release")), key=lambda e: e["id"]
    )
    assert len(entries) == THREADS * ROUNDS
    assert {e["outcome"] for e in entries} <= {"ok", "noop"}
    ok = [e["action"] for e in entries if e["outcome"] == "ok"]
    assert ok, "no request changed anything"
    expected = [("isolate", "release")[i % 2] for i in range(len(ok))]
    assert ok == expected, f"'ok' entries do not alternate: {ok}"
    # One entry per answer, and an answer changed the node exactly when its entry is "ok".
    changed = sum(1 for _, _, ch in answers if ch)
    assert changed == len(ok)
    for action in ("isolate", "release"):
        answered = sum(1 for a, _, ch in answers if a == action and ch)
        assert answered == ok.count(action), action
    assert node["isolated"] is (ok[-1] == "isolate"), (node["isolated"], ok[-1])
    if node["isolated"]:
        last = [e for e in entries if e["outcome"] == "ok"][-1]
        assert node["isolation"]["reason"] == last["reason"]
