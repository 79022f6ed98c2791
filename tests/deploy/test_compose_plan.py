"""scripts/compose_plan.py: docker-compose.yml's topology rewritten for one host's loopback, as
``make container-check`` starts it (pure; the check itself runs outside ``make test``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from scripts import compose_plan
from scripts.compose_plan import ComposeError, plan, substitute

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
PORTS = {"server": 18000, "agent-1": 19471, "agent-2": 19472, "agent-3": 19473}
PORTS["MASTER_PORT"] = 29555
DB = "postgresql+psycopg://postgres@127.0.0.1:5432/check"
ENV = {"TIERWATCH_SECRET_KEY": "k" * 48}


def _plan(compose=COMPOSE, **kw):
    return plan(compose, env=ENV, ports=PORTS, database_url=DB, workdir=Path("/w"), **kw)


def test_every_service_but_postgres_and_the_gpu_profile_is_started_dependencies_first() -> None:
    t = _plan()
    names = [s.name for s in t.services]
    assert sorted(names) == sorted(
        ["server", "bootstrap", "register-job", *(f"agent-{i}" for i in (1, 2, 3))]
        + [f"trainer-{i}" for i in (1, 2, 3)]
    )
    for s in t.services:
        for dep in s.depends_on:
            assert names.index(dep) < names.index(s.name), (dep, s.name)
    assert t.service("agent-1").depends_on == {
        "server": "service_healthy",
        "bootstrap": "service_completed_successfully",
    }
    assert t.service("trainer-2").restart == "on-failure"
    assert t.service("bootstrap").restart == "no"


def test_no_address_names_a_compose_service_after_the_rewrite() -> None:
    t = _plan()
    assert compose_plan.addresses_left(t, COMPOSE) == []
    server = t.service("server")
    assert server.command[-4:] == ["--host", "127.0.0.1", "--port", "18000"]
    assert server.port == 18000
    assert "127.0.0.1:18000/healthz" in server.health[-1]
    for i in (1, 2, 3):
        agent = t.service(f"agent-{i}")
        cmd = agent.command
        assert cmd[cmd.index("--listen") + 1] == f"127.0.0.1:{PORTS[f'agent-{i}']}"
        assert cmd[cmd.index("--advertise-url") + 1] == f"http://127.0.0.1:{PORTS[f'agent-{i}']}"
        assert cmd[cmd.index("--server") + 1] == "http://127.0.0.1:18000"
        assert f"127.0.0.1:{PORTS[f'agent-{i}']}/v1/status" in agent.health[-1]
        assert agent.port == PORTS[f"agent-{i}"]
        # a trainer shares its node agent's addresses (network_mode: service:agent-N)
        trainer = t.service(f"trainer-{i}")
        assert trainer.env["TIERWATCH_AGENT_URL"] == f"http://127.0.0.1:{PORTS[f'agent-{i}']}"
        assert trainer.env["MASTER_ADDR"] == "127.0.0.1"
        assert trainer.env["MASTER_PORT"] == "29555"
        assert trainer.env["GLOO_SOCKET_IFNAME"] == "lo"
        assert trainer.env["RANK"] == str(i - 1)
        assert trainer.port is None
    for name in ("server", "bootstrap", "register-job"):
        assert t.service(name).env["TIERWATCH_DATABASE_URL"] == DB


def test_a_nodes_agent_and_trainer_share_one_tmpfs_memory_tier() -> None:
    t = _plan()
    for i in (1, 2, 3):
        agent = {m.container: m for m in t.service(f"agent-{i}").mounts}
        trainer = {m.container: m for m in t.service(f"trainer-{i}").mounts}
        memory = "/var/lib/tierwatch/memory"
        assert agent[memory].host == trainer[memory].host == Path(f"/w/volumes/memory-node-{i}")
        assert agent["/var/lib/tierwatch/tokens"].read_only
        assert trainer["/var/lib/tierwatch/job"].read_only
        assert not agent[memory].read_only
    tmpfs = {x.host.name: x.options for x in t.tmpfs}
    assert sorted(tmpfs) == ["memory-node-1", "memory-node-2", "memory-node-3"]
    assert all("uid=10001" in o and "size=" in o for o in tmpfs.values())


def test_the_gpu_profile_needs_a_port_for_its_agent() -> None:
    with pytest.raises(ComposeError, match="no loopback port given for agent-gpu"):
        _plan(profiles=frozenset({"gpu"}))
    t = plan(
        COMPOSE,
        env=ENV,
        ports={**PORTS, "agent-gpu": 19479},
        database_url=DB,
        workdir=Path("/w"),
        profiles=frozenset({"gpu"}),
    )
    assert "agent-gpu" in [s.name for s in t.services]
    assert "memory-gpu" in {x.host.name for x in t.tmpfs}


def test_substitution_follows_compose() -> None:
    assert substitute("${A:-x}-${B}", {"A": "1"}) == "1-"
    assert substitute("${A:-x}", {}) == "x"
    assert substitute("${A:-x}", {"A": ""}) == "x"
    with pytest.raises(ComposeError, match="TIERWATCH_SECRET_KEY must be set: set it"):
        substitute("${TIERWATCH_SECRET_KEY:?set it}", {})
    with pytest.raises(ComposeError, match="TIERWATCH_SECRET_KEY must be set"):
        plan(COMPOSE, env={}, ports=PORTS, database_url=DB, workdir=Path("/w"))


def _mini(**server):
    svc = {"image": "x:dev", "command": ["tierwatch-server", "serve", "--port", "8000"]}
    return {"services": {"server": {**svc, **server}}, "volumes": {"v": None}}


@pytest.mark.parametrize(
    ("compose", "says"),
    [
        (_mini(command="tierwatch-server serve --port 8000"), r"as a list \(exec form\)"),
        (_mini(volumes=["nope:/x"]), "volume 'nope' is not declared"),
        (_mini(depends_on={"ghost": {"condition": "service_healthy"}}), "depends on 'ghost'"),
        (_mini(image=None), "no image"),
        (_mini(healthcheck={"test": ["CMD-SHELL", "curl x"]}), "in CMD form"),
    ],
    ids=["shell-command", "undeclared-volume", "missing-dependency", "no-image", "cmd-shell"],
)
def test_a_compose_file_the_check_cannot_run_says_what_to_change(compose, says) -> None:
    with pytest.raises(ComposeError, match=says):
        plan(compose, env=ENV, ports=PORTS, database_url=DB, workdir=Path("/w"))


def test_circular_dependencies_are_refused() -> None:
    compose = {
        "services": {
            "a": {"image": "x", "depends_on": ["b"]},
            "b": {"image": "x", "depends_on": {"a": {"condition": "service_started"}}},
        }
    }
    with pytest.raises(ComposeError, match="in a circle"):
        plan(compose, env=ENV, ports=PORTS, database_url=DB, workdir=Path("/w"))


def test_a_leftover_service_address_is_found() -> None:
    t = _plan()
    t.service("trainer-1").env["EXTRA"] = "http://server:8000/x"
    t.service("agent-2").command.append("0.0.0.0:1")
    assert compose_plan.addresses_left(t, COMPOSE) == [
        "agent-2: 0.0.0.0:1",
        "trainer-1: http://server:8000/x",
    ]


def test_a_url_at_a_port_the_service_does_not_listen_on_is_left_and_reported() -> None:
    # the server listens on 8000 only: a URL at its 9090 is not silently pointed at 8000
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    agent = compose["services"]["agent-1"]
    agent["command"] = [*agent["command"], "--extra-url", "http://server:9090/metrics"]
    t = _plan(compose)
    assert "http://server:9090/metrics" in t.service("agent-1").command
    assert compose_plan.addresses_left(t, compose) == ["agent-1: http://server:9090/metrics"]


def test_a_leftover_database_host_is_reported_but_the_checks_own_url_is_not() -> None:
    t = _plan()
    assert t.service("server").env["TIERWATCH_DATABASE_URL"] == DB
    t.service("bootstrap").env["PGHOST_URL"] = "postgresql://tierwatch@postgres:5432/x"
    assert compose_plan.addresses_left(t, COMPOSE) == [
        "bootstrap: postgresql://tierwatch@postgres:5432/x"
    ]


def test_environment_as_a_list_and_keys_passed_through_from_the_caller() -> None:
    compose = _mini(environment=["A=1", "B=${X:-d}", "PASSED", "MISSING", "C=x=y"])
    t = plan(compose, env={"PASSED": "p"}, ports=PORTS, database_url=DB, workdir=Path("/w"))
    assert t.service("server").env == {"A": "1", "B": "d", "PASSED": "p", "C": "x=y"}
    compose = _mini(environment={"A": None, "B": 2})
    t = plan(compose, env={"A": "from-env"}, ports=PORTS, database_url=DB, workdir=Path("/w"))
    assert t.service("server").env == {"A": "from-env", "B": "2"}


def test_a_service_is_started_when_any_of_its_profiles_is_active() -> None:
    compose = _mini(profiles=["gpu", "debug"])
    assert plan(compose, env=ENV, ports=PORTS, database_url=DB, workdir=Path("/w")).services == []
    t = plan(
        compose,
        env=ENV,
        ports=PORTS,
        database_url=DB,
        workdir=Path("/w"),
        profiles=frozenset({"debug"}),
    )
    assert [s.name for s in t.services] == ["server"]


@pytest.mark.parametrize("key", compose_plan.UNSUPPORTED_KEYS)
def test_keys_the_check_would_not_apply_are_refused(key) -> None:
    with pytest.raises(ComposeError, match=rf"server: `{key}:` is not applied"):
        plan(_mini(**{key: "x"}), env=ENV, ports=PORTS, database_url=DB, workdir=Path("/w"))


@pytest.mark.parametrize(
    "command",
    [
        ["tierwatch-agent", "run", "--listen", "9470"],
        ["tierwatch-server", "serve", "--port", "${PORT}"],
    ],
    ids=["listen-without-port", "port-not-a-number"],
)
def test_a_listen_option_without_a_port_number_is_a_compose_error(command) -> None:
    with pytest.raises(ComposeError, match="no port number"):
        plan(_mini(command=command), env=ENV, ports=PORTS, database_url=DB, workdir=Path("/w"))
