"""SlurmDriver against a real Slurm 22.05 (Debian's slurm-wlm + munge): one slurmctld and one
slurmd on loopback, started once for this module (tests/helpers/slurm.py).

tierwatch drains with its mark, resumes only its own drain, and leaves an admin's drain, a
later drain by someone else and a pending reboot in place. Each test has a node of its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from procs import wait_for
from slurm import SlurmCluster, start_slurm
from support import auth, make_batch, post_batch

from tierwatch.server.actions.drivers import IsolationSettings, SlurmDriver
from tierwatch.server.config import Settings
from tierwatch.server.main import create_app

NODES = [f"gpu-node-0{i}" for i in range(1, 8)]


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    cluster = start_slurm(NODES)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def driver(slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmDriver:
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))  # what the server's scontrol reads
    return SlurmDriver(
        IsolationSettings(driver="slurm", scontrol=slurm.bins["scontrol"], timeout_s=30)
    )


def test_isolate_drains_with_the_mark_and_release_resumes(
    slurm: SlurmCluster, driver: SlurmDriver
) -> None:
    node = "gpu-node-01"
    result = driver.isolate(node, "policy: xid-79 (GPU 3): fell off the bus → RESET_GPU")
    assert result.ok, result.output
    state = slurm.node(node)
    assert state.drained
    assert state.reason == "tierwatch: policy: xid-79 (GPU 3): fell off the bus → RESET_GPU"
    assert result.detail["scheduler"]["before"]["state"] == "IDLE"
    assert result.detail["scheduler"]["action"] == "drain"

    again = driver.isolate(node, "a second finding")  # already ours: nothing changes
    assert again.ok
    assert "already drained by tierwatch" in again.output
    assert slurm.node(node).reason == state.reason

    released = driver.release(node, "GPU reseated")
    assert released.ok, released.output
    assert released.detail["scheduler"]["action"] == "resume"
    assert not slurm.node(node).drained
    assert slurm.node(node).base == "IDLE"


def test_an_admins_drain_made_before_the_isolate_survives_the_release(
    slurm: SlurmCluster, driver: SlurmDriver
) -> None:
    node = "gpu-node-02"
    slurm.drain(node, "admin: bad fan")
    isolated = driver.isolate(node, "policy: xid-79")
    assert isolated.ok, isolated.output
    assert slurm.node(node).reason == "admin: bad fan"  # not replaced by tierwatch's
    assert "already drained by someone else" in isolated.output
    assert isolated.detail["scheduler"]["action"] == "none"

    released = driver.release(node, "operator: done")
    assert released.ok, released.output
    after = slurm.node(node)
    assert after.drained
    assert after.reason == "admin: bad fan"
    assert "left in place" in released.detail["scheduler"]["left_in_place"]
    assert "admin: bad fan" in released.output
    slurm.resume(node)


def test_a_drain_made_by_someone_else_after_the_isolate_is_left_alone(
    slurm: SlurmCluster, driver: SlurmDriver
) -> None:
    node = "gpu-node-03"
    assert driver.isolate(node, "policy: row-remap-failure").ok
    assert slurm.node(node).marked
    slurm.drain(node, "NHC: check_hw_ib failed")  # NHC re-drains the node with its reason
    released = driver.release(node, "operator: done")
    assert released.ok, released.output
    after = slurm.node(node)
    assert after.drained
    assert after.reason == "NHC: check_hw_ib failed"
    assert released.detail["scheduler"]["action"] == "none"
    slurm.resume(node)


@pytest.mark.parametrize(
    ("node", "reboot"),
    [
        ("gpu-node-04", ["nextstate=resume"]),  # keeps tierwatch's reason, sets REBOOT_*
        ("gpu-node-05", ["ASAP", "nextstate=resume", "reason=firmware update"]),
    ],
    ids=["reboot-keeps-our-reason", "reboot-asap-with-its-reason"],
)
def test_a_pending_reboot_is_not_resumed(
    slurm: SlurmCluster, driver: SlurmDriver, node: str, reboot: list[str]
) -> None:
    assert driver.isolate(node, "policy: xid-48").ok
    slurm.scontrol("reboot", *reboot, node)
    before = slurm.node(node)
    assert before.reboot_pending
    assert before.drained
    released = driver.release(node, "operator: done")
    assert released.ok, released.output
    after = slurm.node(node)
    assert after.drained
    assert after.reboot_pending
    assert released.detail["scheduler"]["action"] == "none"
    expected = "a reboot is pending" if before.marked else "drained by someone else"
    assert expected in released.output


def test_without_munge_the_error_says_what_to_run(
    slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = slurm.root / "no-munge.conf"
    conf.write_text(
        slurm.conf.read_text().replace(str(slurm.munge_socket), str(slurm.root / "absent.sock"))
    )
    monkeypatch.setenv("SLURM_CONF", str(conf))
    driver = SlurmDriver(
        IsolationSettings(driver="slurm", scontrol=slurm.bins["scontrol"], timeout_s=30)
    )
    result = driver.isolate("gpu-node-06", "sick")
    assert not result.ok
    assert result.exit_code not in (None, 0)
    assert "run munged on the server" in result.output
    assert not slurm.node("gpu-node-06").drained  # nothing was changed


def test_a_node_slurm_does_not_know_is_named(slurm: SlurmCluster, driver: SlurmDriver) -> None:
    result = driver.isolate("gpu-node-99", "sick")
    assert not result.ok
    assert "Slurm has no node named 'gpu-node-99'" in result.output


def test_the_server_drains_and_releases_through_the_api(
    slurm: SlurmCluster, db_url: str, make_token, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole path: operator API → command queue → the leader's driver run → Slurm, with
    the scheduler's state before the change in the audit entry."""
    node = "gpu-node-07"
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    settings = Settings(
        database_url=db_url,
        dev=True,
        prune_interval_s=0,
        background_tick_s=0.2,
        isolation={"driver": "slurm", "scontrol": slurm.bins["scontrol"]},
    )
    with TestClient(create_app(settings)) as client:
        agent = make_token("agent", node)
        operator = auth(make_token("operator"))
        assert post_batch(client, agent, make_batch(node, 1)).status_code == 200
        r = client.post(
            f"/api/v1/nodes/{node}/isolate", json={"reason": "XID 79 twice"}, headers=operator
        )
        assert r.status_code == 200, r.text
        command = r.json()["command"]["id"]
        finished = wait_command(client, operator, command)
        assert finished["state"] == "succeeded", finished
        assert slurm.node(node).reason == "tierwatch: XID 79 twice"

        entry = next(
            e
            for e in client.get(
                "/api/v1/audit", params={"action": "command"}, headers=operator
            ).json()
            if e["detail"].get("command") == command
        )
        assert entry["detail"]["scheduler"]["before"]["state"] == "IDLE"
        assert entry["detail"]["scheduler"]["action"] == "drain"

        r = client.post(f"/api/v1/nodes/{node}/release", json={"reason": "fixed"}, headers=operator)
        assert r.status_code == 200, r.text
        finished = wait_command(client, operator, r.json()["command"]["id"])
        assert finished["state"] == "succeeded", finished
        assert not slurm.node(node).drained


def wait_command(client: TestClient, headers: dict[str, str], command: str) -> dict:
    def finished() -> dict | None:
        got = client.get(f"/api/v1/commands/{command}", headers=headers).json()
        return got if got["state"] in ("succeeded", "failed", "expired") else None

    return wait_for(finished, timeout=30, what=f"command {command} to finish")
