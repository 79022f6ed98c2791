"""docker-compose.yml's topology as containers on one host's loopback (pure; used by
``make container-check``, scripts/container_check.py).

Chroot isolation (``buildah run --isolation chroot``) gives each container its own root file
system and mounts but the host's network: there is no compose network, no service DNS name
and no per-container port space. So every address in the compose file is rewritten:

- a service's own port (``--listen 0.0.0.0:9470``, ``--host 0.0.0.0 --port 8000``) becomes
  ``127.0.0.1:<port>``, a distinct free port per service;
- a URL naming a service (``http://server:8000``, ``http://agent-1:9470``) becomes that
  service's loopback address;
- a trainer with ``network_mode: service:agent-N`` shares agent-N's addresses, so its
  ``127.0.0.1:9470`` becomes agent-N's port; ``MASTER_ADDR`` becomes 127.0.0.1 and
  ``GLOO_SOCKET_IFNAME`` ``lo``;
- ``TIERWATCH_DATABASE_URL`` becomes the database the check was given (the host's
  PostgreSQL: the compose file's ``postgres`` service is the one service not started in an
  image).

Named volumes become host folders under the check's work folder; a volume whose driver
options say ``type: tmpfs`` becomes a tmpfs mounted there with the same options, so a node's
agent and trainer share one RAM-backed memory tier as they do under compose.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
DATABASE_SERVICE = "postgres"

# keys that change what a service runs and that the plan does not apply: a file using one is
# refused rather than run differently from compose
UNSUPPORTED_KEYS = ("entrypoint", "user", "working_dir", "env_file", "tmpfs")

_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|:\?)(?P<arg>[^}]*))?\}")


class ComposeError(ValueError):
    """The compose file cannot be run as a loopback topology (the message says what)."""


@dataclass(frozen=True)
class Mount:
    """A bind mount: ``host`` folder at ``container`` path."""

    host: Path
    container: str
    read_only: bool = False

    def option(self) -> str:
        """The ``-v`` value buildah, podman and docker take."""
        return f"{self.host}:{self.container}" + (":ro" if self.read_only else "")


@dataclass(frozen=True)
class Tmpfs:
    """A tmpfs to mount at ``host`` before any container uses it (``mount -t tmpfs -o``)."""

    host: Path
    options: str


@dataclass
class Service:
    """One compose service, ready to start in its image.

    Attributes:
        name: the compose service name.
        image: the image it runs (``image:``).
        command: the command, addresses rewritten (the image's entry point is put in front
            at run time).
        env: the environment, variables substituted and addresses rewritten.
        mounts: bind mounts for its volumes.
        health: the health check's command (``CMD`` form), addresses rewritten; None when
            the service has none.
        restart: compose's restart policy (``no``, ``on-failure``, ``unless-stopped``).
        depends_on: service name -> condition (``service_healthy``,
            ``service_completed_successfully``, ``service_started``).
        port: its own loopback port, None when it listens on none.
    """

    name: str
    image: str
    command: list[str]
    env: dict[str, str]
    mounts: list[Mount] = field(default_factory=list)
    health: list[str] | None = None
    restart: str = "no"
    depends_on: dict[str, str] = field(default_factory=dict)
    port: int | None = None


@dataclass
class Topology:
    """What ``make container-check`` starts: services in start order, and the tmpfs mounts."""

    services: list[Service]
    tmpfs: list[Tmpfs]

    def service(self, name: str) -> Service:
        for s in self.services:
            if s.name == name:
                return s
        raise KeyError(name)


def substitute(value: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: ``${VAR}``, ``${VAR:-default}``, ``${VAR:?message}``.

    Raises:
        ComposeError: a ``${VAR:?message}`` variable is unset or empty (the message says
            which one and compose's own hint).
    """

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group("name"), m.group("op"), m.group("arg")
        have = env.get(name, "")
        if have:
            return have
        if op == ":-":
            return arg
        if op == ":?":
            raise ComposeError(f"{name} must be set: {arg}")
        return ""

    return _VAR.sub(one, value)


def _listen_port(command: list[str]) -> int | None:
    """The port a command listens on: ``--listen HOST:PORT`` or ``--port PORT``.

    Raises:
        ComposeError: the option's value has no port number.
    """
    for i, arg in enumerate(command[:-1]):
        if arg in ("--listen", "--port"):
            value = command[i + 1]
            try:
                return int(value.rsplit(":", 1)[1] if arg == "--listen" else value)
            except (IndexError, ValueError):
                raise ComposeError(f"{arg} {value!r}: no port number") from None
    return None


def _rewrite(text: str, own: tuple[int, int] | None, urls: dict[str, tuple[int, int]]) -> str:
    """Addresses in one argument or value: ``own`` = (compose port, loopback port) of the
    service (or of the one whose network it shares); ``urls``: service -> (compose port,
    loopback port). A URL naming a service at another port is left as it is (so
    ``addresses_left`` reports it): the service listens on one port only here."""
    for name, (inner, outer) in urls.items():
        text = re.sub(rf"//{re.escape(name)}:{inner}\b", f"//{LOOPBACK}:{outer}", text)
    if own is not None:
        inner, outer = own
        text = re.sub(rf"\b(0\.0\.0\.0|127\.0\.0\.1):{inner}\b", f"{LOOPBACK}:{outer}", text)
    return text


def _environment(name: str, raw: Any, env: dict[str, str]) -> dict[str, str]:
    """A service's ``environment:`` (mapping or ``KEY=value`` list), substituted. A key with
    no value takes the caller's variable, as compose does (left out when unset)."""
    if raw is None:
        return {}
    if isinstance(raw, list):
        pairs = [str(item).partition("=") for item in raw]
        raw = {k: (v if sep else None) for k, sep, v in pairs}
    if not isinstance(raw, dict):
        raise ComposeError(f"{name}: environment is neither a mapping nor a list")
    out = {}
    for k, v in raw.items():
        if v is None:
            if str(k) in env:
                out[str(k)] = env[str(k)]
        else:
            out[str(k)] = substitute(str(v), env)
    return out


def _command(raw: Any, env: dict[str, str]) -> list[str]:
    if raw is None:
        return []
    if isinstance(raw, str):
        raise ComposeError("write each command as a list (exec form), not a shell string")
    return [substitute(str(a), env) for a in raw]


def plan(
    compose: dict[str, Any],
    *,
    env: dict[str, str],
    ports: dict[str, int],
    database_url: str,
    workdir: Path,
    profiles: frozenset[str] = frozenset(),
) -> Topology:
    """Turn a parsed compose file into loopback services.

    Args:
        compose: ``yaml.safe_load`` of docker-compose.yml.
        env: the variables for substitution (the caller's environment plus the secrets the
            check generates).
        ports: a free loopback port per service that listens (by compose name) and
            ``MASTER_PORT`` for the trainers' rendezvous.
        database_url: the SQLAlchemy URL every ``TIERWATCH_DATABASE_URL`` becomes.
        workdir: the folder under which each named volume gets ``volumes/<name>``.
        profiles: the profiles to include (a service with a profile not in here is left out,
            as ``docker compose up`` does).

    Returns:
        The services in an order that starts every dependency first, and the tmpfs mounts.

    Raises:
        ComposeError: a service the file needs has no port in ``ports``, a dependency is
            missing or circular, a command is a shell string, or a service uses a key of
            ``UNSUPPORTED_KEYS``.
    """
    services: dict[str, Any] = compose.get("services") or {}
    volumes: dict[str, Any] = compose.get("volumes") or {}
    # compose starts a service with no profile, or with any one of its profiles active
    chosen = {
        name: svc
        for name, svc in services.items()
        if name != DATABASE_SERVICE and (not svc.get("profiles") or set(svc["profiles"]) & profiles)
    }
    for name, svc in chosen.items():
        for key in UNSUPPORTED_KEYS:
            if key in svc:
                raise ComposeError(f"{name}: `{key}:` is not applied by the check; remove it")
    own_port: dict[str, int] = {}
    for name, svc in chosen.items():
        inner = _listen_port(_command(svc.get("command"), env))
        if inner is not None:
            if name not in ports:
                raise ComposeError(f"no loopback port given for {name}")
            own_port[name] = inner
    urls = {name: (inner, ports[name]) for name, inner in own_port.items()}

    out: dict[str, Service] = {}
    for name, svc in chosen.items():
        shared = str(svc.get("network_mode") or "")
        host_of = shared.removeprefix("service:") if shared.startswith("service:") else name
        own = (own_port[host_of], ports[host_of]) if host_of in own_port else None
        environment = _environment(name, svc.get("environment"), env)
        for key in environment:
            if key == "TIERWATCH_DATABASE_URL":
                environment[key] = database_url
            elif key == "MASTER_ADDR":
                environment[key] = LOOPBACK
            elif key == "MASTER_PORT":
                if "MASTER_PORT" not in ports:
                    raise ComposeError("no loopback port given for MASTER_PORT")
                environment[key] = str(ports["MASTER_PORT"])
            elif key == "GLOO_SOCKET_IFNAME":
                environment[key] = "lo"
            else:
                environment[key] = _rewrite(environment[key], own, urls)
        command = [_rewrite(a, own, urls) for a in _command(svc.get("command"), env)]
        if "--host" in command:
            command[command.index("--host") + 1] = LOOPBACK
        if "--port" in command and name in own_port:
            command[command.index("--port") + 1] = str(ports[name])
        mounts = []
        for spec in svc.get("volumes") or []:
            parts = str(spec).split(":")
            if parts[0] not in volumes:
                raise ComposeError(f"{name}: volume {parts[0]!r} is not declared under volumes")
            mounts.append(
                Mount(workdir / "volumes" / parts[0], parts[1], len(parts) > 2 and parts[2] == "ro")
            )
        test = (svc.get("healthcheck") or {}).get("test")
        health = None
        if test:
            if test[0] != "CMD":
                raise ComposeError(f"{name}: write the health check in CMD form")
            health = [_rewrite(str(a), own, urls) for a in test[1:]]
        depends = svc.get("depends_on") or {}
        if isinstance(depends, list):
            depends = {d: {"condition": "service_started"} for d in depends}
        out[name] = Service(
            name=name,
            image=str(svc.get("image") or ""),
            command=command,
            env=environment,
            mounts=mounts,
            health=health,
            restart=str(svc.get("restart") or "no"),
            depends_on={
                d: str((c or {}).get("condition", "service_started"))
                for d, c in depends.items()
                if d != DATABASE_SERVICE
            },
            port=ports.get(host_of) if name in own_port else None,
        )
        if not out[name].image:
            raise ComposeError(f"{name}: no image: (the check runs built images only)")

    tmpfs = []
    for vname, vol in volumes.items():
        opts = (vol or {}).get("driver_opts") or {}
        if opts.get("type") == "tmpfs" and any(
            m.host.name == vname for s in out.values() for m in s.mounts
        ):
            tmpfs.append(Tmpfs(workdir / "volumes" / vname, str(opts.get("o", ""))))
    return Topology(_start_order(out), tmpfs)


def _start_order(services: dict[str, Service]) -> list[Service]:
    """Dependencies first, otherwise the compose file's order."""
    done: dict[str, Service] = {}
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in done:
            return
        if name not in services:
            raise ComposeError(f"a service depends on {name!r}, which is not in the file")
        if name in visiting:
            raise ComposeError(f"services depend on each other in a circle at {name!r}")
        visiting.add(name)
        for dep in services[name].depends_on:
            visit(dep)
        visiting.discard(name)
        done[name] = services[name]

    for name in services:
        visit(name)
    return list(done.values())


def addresses_left(topology: Topology, compose: dict[str, Any]) -> list[str]:
    """Every argument, value or health check of the plan that still names a compose service
    (the ``postgres`` one too) as a host, or listens on all addresses (empty when the rewrite
    is complete): ``"<service>: <text>"``. ``TIERWATCH_DATABASE_URL`` is the check's own."""
    names = list(compose.get("services") or {})
    found = []
    for s in topology.services:
        env = [v for k, v in s.env.items() if k != "TIERWATCH_DATABASE_URL"]
        texts = [*s.command, *env, *(s.health or [])]
        for text in texts:
            for n in names:
                if re.search(rf"(//|@|^){re.escape(n)}(:\d+|$|/)", text):
                    found.append(f"{s.name}: {text}")
            if "0.0.0.0" in text:
                found.append(f"{s.name}: {text}")
    return found
