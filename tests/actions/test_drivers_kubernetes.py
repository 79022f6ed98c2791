"""KubernetesDriver against a local HTTP stand-in of the node API (GET and merge PATCH)."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes.client import ApiClient, Configuration

from tierwatch.agent.netutil import free_port
from tierwatch.server.actions.drivers import (
    CONFLICT_ATTEMPTS,
    MERGE_PATCH,
    IsolationSettings,
    KubernetesDriver,
)

KEY = "tierwatch.io/isolated"
ANNOTATION = "tierwatch.io/isolation"
OURS = {"key": KEY, "value": "true", "effect": "NoSchedule"}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@dataclass
class FakeNodeApi:
    """In-memory nodes served at ``/api/v1/nodes/{name}``; records every PATCH."""

    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    patches: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    gets: int = 0
    after_get: list[Callable[[str], None]] = field(default_factory=list)
    """One-shot hooks run after a GET is answered (simulate another writer)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    stall: threading.Event | None = None
    """When set, a GET waits for this event and then closes without answering (a hung API)."""

    def add(self, name: str, *, taints: list[dict[str, Any]] | None = None) -> None:
        spec: dict[str, Any] = {"podCIDR": "10.0.0.0/24"}
        if taints is not None:
            spec["taints"] = copy.deepcopy(taints)
        self.nodes[name] = {
            "kind": "Node",
            "apiVersion": "v1",
            "metadata": {"name": name, "resourceVersion": "100", "labels": {"a": "b"}},
            "spec": spec,
        }

    def bump(self, name: str, change: Callable[[dict[str, Any]], None]) -> None:
        with self.lock:
            node = self.nodes[name]
            change(node)
            meta = node["metadata"]
            meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)

    def handle(self, method: str, name: str, content_type: str, body: bytes) -> tuple[int, Any]:
        with self.lock:
            node = self.nodes.get(name)
            if node is None:
                return 404, status(404, "NotFound", f'nodes "{name}" not found')
            if method == "GET":
                self.gets += 1
                return 200, copy.deepcopy(node)
            patch = json.loads(body)
            self.patches.append((name, content_type, patch))
            if content_type != MERGE_PATCH:
                return 415, status(415, "UnsupportedMediaType", content_type)
            wanted = (patch.get("metadata") or {}).get("resourceVersion")
            current = node["metadata"]["resourceVersion"]
            if wanted is not None and wanted != current:
                return 409, status(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on nodes "{name}": the object has been '
                    "modified; please apply your changes to the latest version and try again",
                )
            updated = merge_patch(node, patch)
            updated["metadata"]["resourceVersion"] = str(int(current) + 1)
            self.nodes[name] = updated
            return 200, copy.deepcopy(updated)


@dataclass
class Served:
    api: FakeNodeApi
    url: str


@pytest.fixture
def served() -> Iterator[Served]:
    api = FakeNodeApi()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            prefix = "/api/v1/nodes/"
            path = self.path.split("?", 1)[0]
            if not path.startswith(prefix):
                self.send_error(404)
                return
            name = path[len(prefix) :]
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            if method == "GET" and api.stall is not None:
                api.stall.wait(timeout=30)  # the client gives up first; answer nothing
                self.close_connection = True
                return
            code, answer = api.handle(method, name, self.headers.get("Content-Type", ""), body)
            if method == "GET" and code == 200:
                # another writer changes the node after this read and before the client
                # can send its patch (run before the answer goes out: no race with it)
                hooks, api.after_get[:] = list(api.after_get), []
                for hook in hooks:
                    hook(name)
            data = json.dumps(answer).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server API
            self._answer("GET")

        def do_PATCH(self) -> None:  # noqa: N802 - http.server API
            self._answer("PATCH")

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield Served(api, f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def make_driver(url: str, **settings: Any) -> KubernetesDriver:
    client = ApiClient(Configuration(host=url))
    return KubernetesDriver(
        IsolationSettings(driver="kubernetes", timeout_s=settings.pop("timeout_s", 10), **settings),
        api_client=client,
    )


@pytest.fixture
def driver(served: Served) -> Iterator[KubernetesDriver]:
    d = make_driver(served.url)
    try:
        yield d
    finally:
        d.close()


def mark_of(api: FakeNodeApi, name: str) -> dict[str, Any] | None:
    """tierwatch's annotation on the stand-in's node, parsed (None when absent)."""
    raw = (api.nodes[name]["metadata"].get("annotations") or {}).get(ANNOTATION)
    return None if raw is None else json.loads(raw)


def test_isolate_cordons_adds_taint_and_marks(served: Served, driver: KubernetesDriver) -> None:
    served.api.add("gpu-07")
    result = driver.isolate("gpu-07", "XID 79")
    assert result.ok, result.output
    assert result.exit_code is None
    [(name, content_type, patch)] = served.api.patches
    assert (name, content_type) == ("gpu-07", MERGE_PATCH)
    assert patch["spec"] == {"unschedulable": True, "taints": [OURS]}
    assert patch["metadata"]["resourceVersion"] == "100"
    node = served.api.nodes["gpu-07"]
    assert node["spec"] == {"podCIDR": "10.0.0.0/24", "unschedulable": True, "taints": [OURS]}
    assert node["metadata"]["labels"] == {"a": "b"}
    mark = mark_of(served.api, "gpu-07")
    assert mark is not None
    assert (mark["cordoned"], mark["reason"]) == (True, "XID 79")
    assert mark["at"].endswith("Z")
    lines = result.output.splitlines()
    assert lines[:2] == [
        "kubernetes isolate gpu-07 (reason: XID 79)",
        "GET /api/v1/nodes/gpu-07 -> 200 (resourceVersion 100)",
    ]
    assert lines[2].startswith("PATCH /api/v1/nodes/gpu-07 {")
    assert lines[2].endswith("-> 200")
    assert lines[3] == "cordoned, taint tierwatch.io/isolated=true:NoSchedule set"
    assert result.detail["scheduler"]["before"]["unschedulable"] is False
    assert result.detail["scheduler"]["action"] == "patch"


def test_release_uncordons_and_removes_only_our_taint_and_mark(
    served: Served, driver: KubernetesDriver
) -> None:
    other_effect = {"key": KEY, "value": "manual", "effect": "NoExecute"}
    served.api.add("gpu-07", taints=[GPU_TAINT, other_effect])
    assert driver.isolate("gpu-07", "XID 79").ok
    result = driver.release("gpu-07", "repaired")
    assert result.ok, result.output
    patch = served.api.patches[-1][2]
    assert patch == {
        "metadata": {"resourceVersion": "101", "annotations": {ANNOTATION: None}},
        "spec": {"unschedulable": False, "taints": [GPU_TAINT, other_effect]},
    }
    node = served.api.nodes["gpu-07"]
    assert node["spec"]["taints"] == [GPU_TAINT, other_effect]
    assert node["spec"]["unschedulable"] is False
    assert mark_of(served.api, "gpu-07") is None
    assert "uncordoned, taint tierwatch.io/isolated=true:NoSchedule removed" in result.output


def test_a_cordon_someone_else_made_before_the_isolate_survives_the_release(
    served: Served, driver: KubernetesDriver
) -> None:
    served.api.add("gpu-07")
    served.api.bump("gpu-07", lambda n: n["spec"].update(unschedulable=True))  # kubectl cordon
    isolated = driver.isolate("gpu-07", "XID 79")
    assert isolated.ok, isolated.output
    assert "already cordoned by someone else" in isolated.output
    mark = mark_of(served.api, "gpu-07")
    assert mark is not None
    assert mark["cordoned"] is False
    assert driver.isolate("gpu-07", "again").ok  # a second isolate keeps what it learnt
    mark = mark_of(served.api, "gpu-07")
    assert mark is not None
    assert mark["cordoned"] is False

    released = driver.release("gpu-07", "repaired")
    assert released.ok, released.output
    node = served.api.nodes["gpu-07"]
    assert node["spec"]["unschedulable"] is True  # the admin's cordon stays
    assert node["spec"]["taints"] == []  # tierwatch's taint is gone
    assert mark_of(served.api, "gpu-07") is None
    assert "left cordoned: the cordon was not tierwatch's" in released.output
    assert "left cordoned" in released.detail["scheduler"]["left_in_place"]


def test_release_of_a_node_tierwatch_never_isolated_changes_nothing(
    served: Served, driver: KubernetesDriver
) -> None:
    served.api.add("gpu-07", taints=[GPU_TAINT])
    served.api.bump("gpu-07", lambda n: n["spec"].update(unschedulable=True))  # upgrade cordon
    result = driver.release("gpu-07", "")
    assert result.ok, result.output
    assert served.api.patches == []
    assert served.api.nodes["gpu-07"]["spec"]["unschedulable"] is True
    assert "cordoned by someone else: left in place" in result.output


def test_an_edited_mark_is_not_trusted_to_uncordon(
    served: Served, driver: KubernetesDriver
) -> None:
    served.api.add("gpu-07")
    assert driver.isolate("gpu-07", "XID 79").ok
    served.api.bump(
        "gpu-07", lambda n: n["metadata"]["annotations"].update({ANNOTATION: "by hand"})
    )
    assert driver.release("gpu-07", "").ok
    node = served.api.nodes["gpu-07"]
    assert node["spec"]["unschedulable"] is True
    assert node["spec"]["taints"] == []
    assert ANNOTATION not in node["metadata"]["annotations"]


def test_release_of_last_taint_sends_empty_list(served: Served, driver: KubernetesDriver) -> None:
    served.api.add("gpu-07")
    assert driver.isolate("gpu-07", "").ok
    assert driver.release("gpu-07", "").ok
    assert served.api.patches[-1][2]["spec"] == {"unschedulable": False, "taints": []}
    assert served.api.nodes["gpu-07"]["spec"]["unschedulable"] is False
    assert served.api.nodes["gpu-07"]["spec"]["taints"] == []


@pytest.mark.parametrize(
    ("conditions", "responding", "text"),
    [
        ([{"type": "Ready", "status": "True"}], True, "kubernetes: Ready"),
        ([{"type": "Ready", "status": "Unknown"}], False, "kubernetes: NotReady"),
        ([], None, "kubernetes: Ready unknown"),
    ],
)
def test_observe_reads_the_ready_condition(
    served: Served, driver: KubernetesDriver, conditions: list, responding: bool | None, text: str
) -> None:
    served.api.add("gpu-07")
    served.api.nodes["gpu-07"]["status"] = {"conditions": conditions}
    view = driver.observe("gpu-07")
    assert view.ok
    assert view.responding is responding
    assert view.text == text
    assert served.api.patches == []


def test_observe_of_an_unknown_node_says_so(driver: KubernetesDriver) -> None:
    view = driver.observe("gpu-99")
    assert not view.ok
    assert "no node named 'gpu-99'" in view.text


def test_isolate_keeps_other_taints_and_does_not_duplicate(
    served: Served, driver: KubernetesDriver
) -> None:
    served.api.add("gpu-07", taints=[GPU_TAINT])
    assert driver.isolate("gpu-07", "first").ok
    assert served.api.patches[0][2]["spec"] == {
        "unschedulable": True,
        "taints": [GPU_TAINT, OURS],
    }
    second = driver.isolate("gpu-07", "second")
    assert second.ok, second.output
    assert len(served.api.patches) == 1  # already in the wanted state: no PATCH
    assert "nothing to change" in second.output
    assert served.api.nodes["gpu-07"]["spec"]["taints"] == [GPU_TAINT, OURS]


def test_isolate_of_cordoned_node_with_our_taint_value_changed_keeps_it(
    served: Served, driver: KubernetesDriver
) -> None:
    # Someone else cordoned it; our key+effect is there with another value: only that counts.
    mine_edited = {"key": KEY, "value": "by-hand", "effect": "NoSchedule"}
    served.api.add("gpu-07", taints=[mine_edited])
    assert driver.isolate("gpu-07", "").ok
    assert served.api.patches[0][2]["spec"] == {"unschedulable": True, "taints": [mine_edited]}


def test_conflict_rereads_and_retries(served: Served, driver: KubernetesDriver) -> None:
    served.api.add("gpu-07", taints=[GPU_TAINT])
    late = {"key": "example.com/maintenance", "value": "soon", "effect": "PreferNoSchedule"}

    def other_writer(name: str) -> None:
        served.api.bump(name, lambda n: n["spec"]["taints"].append(late))

    served.api.after_get.append(other_writer)
    result = driver.isolate("gpu-07", "sick")
    assert result.ok, result.output
    assert served.api.gets == 2
    assert [(p[2]["metadata"]["resourceVersion"], p[2]["spec"]) for p in served.api.patches] == [
        ("100", {"unschedulable": True, "taints": [GPU_TAINT, OURS]}),
        ("101", {"unschedulable": True, "taints": [GPU_TAINT, late, OURS]}),
    ]
    assert served.api.nodes["gpu-07"]["spec"]["taints"] == [GPU_TAINT, late, OURS]
    assert "-> 409 Conflict (node changed since read)" in result.output


def test_endless_conflicts_give_up(served: Served, driver: KubernetesDriver) -> None:
    served.api.add("gpu-07")

    def other_writer(name: str) -> None:
        served.api.bump(name, lambda n: None)
        served.api.after_get.append(other_writer)

    served.api.after_get.append(other_writer)
    result = driver.isolate("gpu-07", "sick")
    assert not result.ok
    assert result.exit_code == 409
    assert len(served.api.patches) == CONFLICT_ATTEMPTS
    assert f"gave up after {CONFLICT_ATTEMPTS} attempts" in result.output
    served.api.after_get.clear()


def test_unknown_node(served: Served, driver: KubernetesDriver) -> None:
    result = driver.isolate("gpu-99", "sick")
    assert not result.ok
    assert result.exit_code == 404
    assert served.api.patches == []
    assert 'error 404 Not Found: nodes "gpu-99" not found' in result.output
    assert "no node named 'gpu-99' in this cluster" in result.output


def test_api_down() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    driver = make_driver(url, timeout_s=5)
    try:
        result = driver.isolate("gpu-07", "sick")
    finally:
        driver.close()
    assert not result.ok
    assert result.exit_code is None
    assert f"cannot reach the Kubernetes API at {url}" in result.output


def test_hung_api_times_out(served: Served) -> None:
    served.api.add("gpu-07")
    served.api.stall = threading.Event()
    driver = make_driver(served.url, timeout_s=0.2)
    try:
        result = driver.isolate("gpu-07", "sick")
    finally:
        served.api.stall.set()
        driver.close()
    assert not result.ok
    assert result.exit_code is None
    assert f"timed out after 0.2 s waiting for {served.url}" in result.output
    assert served.api.patches == []


def test_custom_taint_key(served: Served) -> None:
    served.api.add("gpu-07")
    driver = make_driver(served.url, taint_key="example.com/sick-gpu")
    try:
        assert driver.isolate("gpu-07", "").ok
    finally:
        driver.close()
    assert served.api.nodes["gpu-07"]["spec"]["taints"] == [
        {"key": "example.com/sick-gpu", "value": "true", "effect": "NoSchedule"}
    ]
