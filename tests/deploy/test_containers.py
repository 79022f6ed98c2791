"""Static checks of the container and cluster deployment files.

No Docker engine, GPU, Slurm or Kubernetes cluster is involved: ``docker-compose config``
validates and interpolates docker-compose.yml, the Dockerfile, the Kubernetes manifests and the
systemd unit are parsed, and every command they run is checked against the real command-line
interface (``<command> --help`` of the installed entry points and example scripts). The
image's two shell scripts (entrypoint, token bootstrap) are run for real against SQLite.

``docker-compose`` (Debian package, v1.29) missing: the compose tests are skipped, except when
``TIERWATCH_REQUIRE_COMPOSE=1`` or ``TIERWATCH_REQUIRE_BROWSER=1`` is set (``.ci/run``), where
they fail.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "docker" / "Dockerfile"
K8S_DIR = REPO / "deploy" / "kubernetes"
SLURM_DIR = REPO / "deploy" / "slurm"
IMAGE_TARGETS = ("server", "agent", "trainer")
ENTRY_POINTS = ("tierwatch-server", "tierwatch-agent")
COMPOSE_ENV = {
    "TIERWATCH_SECRET_KEY": "k" * 48,
}


# --- the real command-line interfaces -------------------------------------------------------


@functools.cache
def help_text(argv: tuple[str, ...]) -> tuple[int, str]:
    """``argv + ("--help",)``: exit code and output (wide, so no option name is cut)."""
    env = dict(os.environ, COLUMNS="250", NO_COLOR="1", TERM="dumb")
    proc = subprocess.run(
        [*argv, "--help"], capture_output=True, text=True, env=env, timeout=120, cwd=REPO
    )
    return proc.returncode, proc.stdout + proc.stderr


def options_of(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", text))


def commands_of(text: str) -> set[str]:
    """Subcommand names listed in a typer/rich help's "Commands" panel."""
    panel = text.split("Commands", 1)[1] if "Commands" in text else ""
    return set(re.findall(r"^[│|]\s+([a-z][a-z0-9-]*)\s{2,}", panel, flags=re.MULTILINE))


def check_cli(argv: list[str], where: str) -> list[str]:
    """Problems with ``argv`` run as tierwatch-server/tierwatch-agent (empty: none)."""
    exe = str(BIN / argv[0])
    path: list[str] = [exe]
    rest = argv[1:]
    while rest and not rest[0].startswith("-"):
        code, text = help_text(tuple(path))
        if rest[0] not in commands_of(text):
            break
        path.append(rest.pop(0))
    if len(path) == 1:
        return [f"{where}: {argv[0]} without a subcommand: {shlex.join(argv)}"]
    code, text = help_text(tuple(path))
    if code != 0:
        return [f"{where}: `{' '.join([argv[0], *path[1:]])} --help` exited {code}"]
    known = options_of(text)
    return [
        f"{where}: {' '.join([argv[0], *path[1:]])} has no option {opt} (in {shlex.join(argv)})"
        for opt in (w.split("=", 1)[0] for w in rest if w.startswith("--"))
        if opt not in known
    ]


def check_python_script(argv: list[str], where: str, workdir: str) -> list[str]:
    """``python SCRIPT [ARGS]``: SCRIPT exists in the repository (``workdir`` is where the image
    holds the repository's examples/) and every ``--option`` is in its ``--help``."""
    script, args = argv[1], argv[2:]
    rel = script.removeprefix(workdir.rstrip("/") + "/") if script.startswith("/") else script
    local = REPO / rel
    if not local.is_file():
        return [f"{where}: {script} is not a file of the repository ({local})"]
    inner: list[str] = []
    if "--" in args:  # launch.py ... -- SCRIPT ARGS
        cut = args.index("--")
        args, inner = args[:cut], args[cut + 1 :]
    code, text = help_text((sys.executable, str(local)))
    if code != 0:
        return [f"{where}: `python {rel} --help` exited {code}"]
    known = options_of(text)
    problems = [
        f"{where}: {rel} has no option {opt}"
        for opt in (w.split("=", 1)[0] for w in args if w.startswith("--"))
        if opt not in known
    ]
    if inner:
        problems += check_python_script(["python", *inner], where, workdir)
    return problems


# --- Dockerfile ------------------------------------------------------------------------------


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def exec_form(text: str) -> list[str]:
    return yaml.safe_load(text) if text.startswith("[") else shlex.split(text)


def parse_stages(path: Path = DOCKERFILE) -> dict[str, dict[str, Any]]:
    """Stages by name, in order: base image or parent stage, COPYs, RUNs, USER, CMD,
    ENTRYPOINT, WORKDIR (the last ones as written in that stage, None when not)."""
    args: dict[str, str] = {}
    stages: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for word, rest in dockerfile_instructions(path):
        if word == "ARG" and current is None:
            name, _, default = rest.partition("=")
            args[name] = default
            continue
        if word == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            assert m, f"cannot parse FROM {rest}"
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda g: args[g[1] or g[2]], m[1])
            name = m[2] or f"stage-{len(stages)}"
            current = {
                "name": name,
                "from": image,
                "copies": [],
                "runs": [],
                "user": None,
                "cmd": None,
                "entrypoint": None,
                "workdir": None,
            }
            stages[name] = current
            continue
        assert current is not None, f"{word} before FROM"
        if word == "COPY":
            parts = shlex.split(rest)
            flags = [p for p in parts if p.startswith("--")]
            paths = [p for p in parts if not p.startswith("--")]
            source = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
            current["copies"].append({"from": source, "src": paths[:-1], "dest": paths[-1]})
        elif word == "RUN":
            current["runs"].append(rest)
        elif word == "USER":
            current["user"] = rest
        elif word in ("CMD", "ENTRYPOINT"):
            current[word.lower()] = exec_form(rest)
        elif word == "WORKDIR":
            current["workdir"] = rest
    return stages


def resolved(stages: dict[str, dict[str, Any]], name: str, key: str) -> Any:
    """``key`` of stage ``name`` as the image has it: inherited through parent stages."""
    stage = stages[name]
    while stage[key] is None and stage["from"] in stages:
        stage = stages[stage["from"]]
    return stage[key]


def closure(stages: dict[str, dict[str, Any]], name: str) -> set[str]:
    """The stages that image ``name`` is made from (parents and COPY --from sources)."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        n = todo.pop()
        if n in seen or n not in stages:
            continue
        seen.add(n)
        todo.append(stages[n]["from"])
        todo += [c["from"] for c in stages[n]["copies"] if c["from"]]
    return seen


def installed_scripts(stages: dict[str, dict[str, Any]], name: str) -> dict[str, Path]:
    """Files image ``name`` holds under /usr/local/bin, copied from the repository:
    {name and full path: repository file}."""
    out: dict[str, Path] = {}
    for n in closure(stages, name):
        for c in stages[n]["copies"]:
            if c["from"] is None and c["dest"].startswith("/usr/local/bin/"):
                out[c["dest"]] = out[Path(c["dest"]).name] = REPO / c["src"][0]
    return out


def shell_invocations(script: Path) -> list[list[str]]:
    """The tierwatch-server/tierwatch-agent command lines a shell script runs."""
    text = re.sub(r"\\\n\s*", " ", script.read_text())
    found = []
    for line in text.splitlines():
        line = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
        for exe in ENTRY_POINTS:
            at = line.find(exe + " ")
            if at < 0:
                continue
            words = []
            for w in shlex.split(line[at:]):
                if w in (">", ">>", "|", "&&", "||", ";") or w.startswith(">"):
                    break
                words.append(w)
            found.append(words)
    return found


def check_command(argv: list[str], where: str, scripts: dict[str, Path], workdir: str) -> list[str]:
    """A container command is a real entry point: tierwatch-server/-agent with a real
    subcommand and options, ``python examples/...py`` with real options, or a script from the
    repository (whose own tierwatch-* calls are checked the same way)."""
    if not argv:
        return [f"{where}: empty command"]
    if argv[0] in ENTRY_POINTS:
        return check_cli(argv, where)
    if Path(argv[0]).name in ("python", "python3"):
        return check_python_script(argv, where, workdir)
    if argv[0] in scripts:
        script = scripts[argv[0]]
        if not script.is_file():
            return [f"{where}: {argv[0]} is copied from {script}, which does not exist"]
        problems = []
        if not script.stat().st_mode & stat.S_IXUSR:
            problems.append(f"{where}: {script.relative_to(REPO)} is not executable")
        syntax = subprocess.run(["sh", "-n", str(script)], capture_output=True, text=True)
        if syntax.returncode != 0:
            problems.append(f"{where}: sh -n {script.name}: {syntax.stderr.strip()}")
        for call in shell_invocations(script):
            problems += check_cli(call, f"{where} ({script.relative_to(REPO)})")
        return problems
    return [
        f"{where}: {argv[0]!r} is neither a tierwatch entry point, python examples/..., "
        "nor a script the image copies from the repository"
    ]


def test_dockerfile_stages_copies_and_images():
    stages = parse_stages()
    names = list(stages)
    for target in IMAGE_TARGETS:
        assert target in stages, f"docker/Dockerfile has no stage {target!r}"
    ignored = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for i, (name, stage) in enumerate(stages.items()):
        base = stage["from"]
        if base in stages:
            assert names.index(base) < i, f"stage {name} builds on a later stage {base}"
        else:
            repo_tag = base.rsplit("/", 1)[-1]
            assert ":" in repo_tag or "@sha256:" in base, f"FROM {base}: pin a tag"
            assert not repo_tag.endswith(":latest"), f"FROM {base}: pin a tag, not latest"
        for c in stage["copies"]:
            if c["from"] is not None:
                assert c["from"] in names[:i], (
                    f"stage {name}: COPY --from={c['from']} names no earlier stage"
                )
                continue
            for src in c["src"]:
                assert list(REPO.glob(src)), f"stage {name}: COPY {src}: not in the repository"
                parts = Path(src).parts
                for prefix in ("/".join(parts[:i]) for i in range(1, len(parts) + 1)):
                    hit = [
                        p
                        for p in ignored
                        if fnmatch.fnmatch(prefix, p.removeprefix("**/").strip("/"))
                    ]
                    assert not hit, f"stage {name}: COPY {src}, but .dockerignore has {hit}"
    assert stages["assets"]["from"].startswith("node:20-slim")
    assert any("npm ci" in r for r in stages["assets"]["runs"])
    # the three vendor files the Makefile installs (static/vendor/.installed)
    makefile = (REPO / "Makefile").read_text()
    vendored = set(re.findall(r"static/vendor/([\w.]+\.(?:js|css))", makefile))
    assets_runs = " ".join(stages["assets"]["runs"])
    for f in vendored:
        assert f"static/vendor/{f}" in assets_runs, f"the assets stage does not install {f}"
    for target in IMAGE_TARGETS:
        root = closure(stages, target)
        bases = {stages[n]["from"] for n in root if stages[n]["from"] not in stages}
        assert any(b.startswith("python:3.11-slim") for b in bases), target


def dockerfile_build_args(path: Path = DOCKERFILE) -> dict[str, str]:
    """Every ``ARG NAME[=default]`` of the Dockerfile, global or per stage: ``{NAME: default}``."""
    return {
        name: default
        for word, rest in dockerfile_instructions(path)
        if word == "ARG"
        for name, _, default in [rest.partition("=")]
    }


def test_dockerfile_build_args_default_to_public_sources():
    """``make images`` overrides the bases and the torch wheel on a machine without registry
    access; a plain ``docker build`` needs none of that."""
    build_args = dockerfile_build_args()
    assert build_args["PYTHON_IMAGE"] == "python:3.11-slim"
    assert build_args["NODE_IMAGE"] == "node:20-slim"
    assert build_args["TORCH_WHEEL"] == "", "without a local wheel, torch comes from the index"
    # the wheel folder is bind-mounted, so it must exist in a fresh clone and be in the context
    stages = parse_stages()
    trainer_runs = " ".join(r for n in closure(stages, "trainer") for r in stages[n]["runs"])
    mounts = re.findall(r"--mount=type=bind,source=(\S+?),", trainer_runs)
    assert mounts == ["docker/wheels"]
    assert (REPO / "docker" / "wheels" / "README.md").is_file()
    ignored = (REPO / ".dockerignore").read_text().split()
    assert not [p for p in ignored if fnmatch.fnmatch("docker/wheels", p.rstrip("/"))]
    assert "docker/wheels/*.whl" in (REPO / ".gitignore").read_text().split()


def test_make_images_target():
    """``make images`` runs scripts/images.sh, which parses; ``make test`` does not build images
    (minutes)."""
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^images:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert recipe, "Makefile has no images target"
    assert "scripts/images.sh" in recipe[1]
    test_rule = re.search(r"^test:(.*)$", makefile, re.MULTILINE)
    assert test_rule
    assert "images" not in test_rule[1].split()
    script = REPO / "scripts" / "images.sh"
    assert script.stat().st_mode & stat.S_IXUSR, "scripts/images.sh is not executable"
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    text = script.read_text()
    for builder in ("buildah", "docker", "podman", "IMAGE_BUILDER"):
        assert builder in text, builder
    for target in IMAGE_TARGETS:
        assert target in text, target


def _pins(name: str) -> dict[str, str]:
    """``package -> version`` of ``requirements/<name>.lock`` (names lower-cased)."""
    out = {}
    for line in (REPO / "requirements" / f"{name}.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            pkg, version = line.split("==")
            out[re.sub(r"[-_.]+", "-", pkg).lower()] = version
    return out


def test_locks_are_split_runtime_train_dev():
    runtime, train, dev = _pins("runtime"), _pins("train"), _pins("dev")
    assert "torch" not in runtime
    assert "torch" in train
    for tool in ("pytest", "ruff", "playwright", "schemathesis", "mypy", "pytest-xdist"):
        assert tool in dev, tool
        assert tool not in runtime, tool
    assert not set(runtime) & set(train), "a package is pinned in both runtime and train"
    assert not set(dev) & (set(runtime) | set(train)), "dev re-pins a runtime/train package"


def test_dockerfile_installs_only_the_runtime_lock_and_torch_only_in_the_trainer():
    stages = parse_stages()
    torch_pin = _pins("train")["torch"]

    def runs(target: str) -> str:
        return "\n".join(r for n in closure(stages, target) for r in stages[n]["runs"])

    for target in IMAGE_TARGETS:
        text = runs(target)
        assert "pip install -r requirements/runtime.lock" in text, target
        assert "dev.lock" not in text, f"{target} installs the dev tools"
        assert "pip install --no-deps ." in text, target
    for target in ("server", "agent"):
        text = runs(target)
        assert "download.pytorch.org" not in text, f"{target} installs torch"
        assert "train.lock" not in text, f"{target} installs the train lock"
    trainer = runs("trainer")
    assert "requirements/train.lock" in trainer
    assert f"torch=={torch_pin}" in trainer, "trainer torch differs from the lock's pin"
    assert "--index-url https://download.pytorch.org/whl/cpu" in trainer


@pytest.mark.parametrize("target", IMAGE_TARGETS)
def test_dockerfile_target_runs_a_real_entry_point_as_non_root(target):
    stages = parse_stages()
    user = resolved(stages, target, "user")
    assert user, f"image {target} sets no USER: it would run as root"
    assert user.split(":")[0] not in ("root", "0"), f"image {target} runs as {user}"
    entrypoint = resolved(stages, target, "entrypoint") or []
    cmd = resolved(stages, target, "cmd") or []
    scripts = installed_scripts(stages, target)
    workdir = resolved(stages, target, "workdir") or "/"
    problems = []
    for word in entrypoint:  # an entrypoint wrapper must itself come from the repository
        problems += (
            check_command([word], f"{target} ENTRYPOINT", scripts, workdir)
            if word in scripts
            else [f"{target}: ENTRYPOINT {word} is not from the repository"]
        )
    problems += check_command(cmd, f"{target} CMD", scripts, workdir)
    assert not problems, "\n".join(problems)


# --- docker-compose.yml ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_bin() -> str:
    found = shutil.which("docker-compose")
    if found:
        return found
    required = [
        v
        for v in ("TIERWATCH_REQUIRE_COMPOSE", "TIERWATCH_REQUIRE_BROWSER")
        if os.environ.get(v) == "1"
    ]
    why = "docker-compose is not installed (Debian: apt-get install docker-compose)"
    if required:
        pytest.fail(f"{why}, and {required[0]}=1 requires it")
    pytest.skip(why)


def run_compose(compose_bin: str, *args: str, env: dict[str, str] | None = None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIERWATCH_")}
    return subprocess.run(
        [compose_bin, "--project-directory", str(REPO), "-f", str(COMPOSE_FILE), *args],
        capture_output=True,
        text=True,
        env={**base, **(COMPOSE_ENV if env is None else env)},
        timeout=120,
        cwd=REPO,
    )


@functools.cache
def _config(compose_bin: str, profile: str | None) -> dict[str, Any]:
    args = ["--profile", profile] if profile else []
    proc = run_compose(compose_bin, *args, "config")
    assert proc.returncode == 0, f"docker-compose {' '.join(args)} config:\n{proc.stderr}"
    return yaml.safe_load(proc.stdout)


@pytest.mark.parametrize("profile", [None, "gpu"])
def test_compose_config_validates(compose_bin, profile):
    config = _config(compose_bin, profile)
    services = config["services"]
    for name in (
        "postgres",
        "server",
        "bootstrap",
        "agent-1",
        "agent-2",
        "agent-3",
        "trainer-1",
        "trainer-2",
        "trainer-3",
    ):
        assert name in services, f"no service {name}"
    assert services["agent-gpu"]["profiles"] == ["gpu"]
    if profile == "gpu":
        gpu = services["agent-gpu"]
        assert gpu["command"][gpu["command"].index("--collector") + 1] == "nvml"
        devices = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "capabilities": ["gpu"], "count": "all"}]


def test_compose_refuses_to_start_without_the_secrets(compose_bin):
    for missing in COMPOSE_ENV:
        env = {k: v for k, v in COMPOSE_ENV.items() if k != missing}
        proc = run_compose(compose_bin, "config", "-q", env=env)
        assert proc.returncode != 0, f"config passed without {missing}"
        assert f"set {missing}" in proc.stderr, proc.stderr


def test_compose_commands_are_real_entry_points(compose_bin):
    stages = parse_stages()
    services = _config(compose_bin, "gpu")["services"]
    problems = []
    for name, svc in services.items():
        if "build" not in svc:
            continue
        build = svc["build"]
        assert Path(build["context"]).resolve() == REPO, name
        assert (REPO / build["dockerfile"]).resolve() == DOCKERFILE.resolve(), name
        target = build["target"]
        assert target in stages, f"{name}: build target {target} is not a Dockerfile stage"
        scripts = installed_scripts(stages, target)
        workdir = svc.get("working_dir") or resolved(stages, target, "workdir") or "/"
        entrypoint = svc.get("entrypoint") or resolved(stages, target, "entrypoint") or []
        for word in entrypoint:
            if word not in scripts:
                problems.append(f"{name}: entrypoint {word} is not from the repository")
        command = svc.get("command") or resolved(stages, target, "cmd")
        if isinstance(command, str):
            command = shlex.split(command)
        problems += check_command(command, name, scripts, workdir)
    assert not problems, "\n".join(problems)


def _opt(command: list[str], option: str) -> str:
    assert option in command, f"{option} missing in {shlex.join(command)}"
    return command[command.index(option) + 1]


def test_compose_wiring(compose_bin):
    config = _config(compose_bin, None)
    services = config["services"]
    volumes = config["volumes"]

    server = services["server"]
    assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "pg_isready" in services["postgres"]["healthcheck"]["test"]
    assert services["postgres"]["image"] == "postgres:16"
    assert "/healthz" in " ".join(server["healthcheck"]["test"])
    assert server["environment"]["TIERWATCH_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert server["environment"]["TIERWATCH_SECRET_KEY"] == COMPOSE_ENV["TIERWATCH_SECRET_KEY"]
    assert server["command"][:2] == ["tierwatch-server", "serve"]
    assert "--no-migrate" not in server["command"]  # serve runs the migrations first
    assert _opt(server["command"], "--host") == "0.0.0.0"

    boot = services["bootstrap"]
    assert boot["depends_on"]["server"]["condition"] == "service_healthy"
    token_dir = boot["command"][1]
    boot_nodes = set(boot["command"][2:])
    token_volume = next(v.split(":")[0] for v in boot["volumes"] if v.split(":")[1] == token_dir)

    agents = {n: s for n, s in services.items() if n.startswith("agent-") and n != "agent-gpu"}
    assert len(agents) == 3
    memory_of: dict[str, tuple[str, str]] = {}
    for name, svc in agents.items():
        cmd = svc["command"]
        assert _opt(cmd, "--collector") == "simulated"
        node = _opt(cmd, "--node")
        assert node in boot_nodes, f"{name}: bootstrap creates no token for {node}"
        assert svc["depends_on"]["bootstrap"]["condition"] == "service_completed_successfully"
        assert svc["environment"]["TIERWATCH_TOKEN_FILE"] == f"{token_dir}/{node}.token"
        assert "TIERWATCH_PEER_TOKEN" not in svc["environment"]  # no shared peer secret
        assert _opt(cmd, "--advertise-url") == f"http://{name}:9470"
        assert _opt(cmd, "--listen") == "0.0.0.0:9470"
        mounts = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
        assert mounts.get(token_dir) == token_volume, f"{name} does not mount the tokens"
        memory_dir = _opt(cmd, "--memory-dir")
        memory_volume = mounts[memory_dir]
        opts = volumes[memory_volume]["driver_opts"]
        assert opts["type"] == "tmpfs", memory_volume
        assert "size=" in opts["o"], memory_volume
        persistent = _opt(cmd, "--persistent-url").removeprefix("file://")
        assert mounts[persistent] == "checkpoints", f"{name}: persistent tier not shared"
        memory_of[name] = (memory_volume, memory_dir)
    assert len({v for v, _ in memory_of.values()}) == 3, "agents share a memory tier"

    register = services["register-job"]
    assert register["command"][:3] == ["tierwatch-server", "job", "credential"]
    job_dir = str(Path(_opt(register["command"], "--out")).parent)
    job_volume = next(v.split(":")[0] for v in register["volumes"] if v.split(":")[1] == job_dir)
    job_nodes = {
        register["command"][i + 1] for i, w in enumerate(register["command"]) if w == "--node"
    }
    assert job_nodes == {_opt(s["command"], "--node") for s in agents.values()}

    trainers = {n: s for n, s in services.items() if n.startswith("trainer-")}
    ranks = set()
    for name, svc in trainers.items():
        env = svc["environment"]
        world = int(env["WORLD_SIZE"])
        ranks.add(int(env["RANK"]))
        agent = svc["network_mode"].removeprefix("service:")
        assert agent in agents, f"{name} joins no agent's network namespace"
        assert env["TIERWATCH_AGENT_URL"] == "http://127.0.0.1:9470"
        assert env["MASTER_ADDR"] in agents
        mounts = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
        volume, path = memory_of[agent]
        assert mounts.get(path) == volume, f"{name} does not share {agent}'s memory tier"
        # the job credential, from the job's registration; never the agents' tokens
        assert token_volume not in mounts.values(), f"{name} mounts the agent tokens"
        credential = Path(env["TIERWATCH_JOB_CREDENTIAL_FILE"])
        assert mounts.get(str(credential.parent)) == job_volume, name
        assert svc["depends_on"]["register-job"]["condition"] == "service_completed_successfully"
    assert ranks == set(range(world))
    assert world == len(trainers) == 3
    rank0 = next(s for s in trainers.values() if s["environment"]["RANK"] == "0")
    assert rank0["network_mode"] == f"service:{rank0['environment']['MASTER_ADDR']}"


# --- the image's scripts, run for real ---------------------------------------------------------


def test_entrypoint_reads_secret_files(tmp_path):
    script = REPO / "docker" / "entrypoint.sh"
    token = tmp_path / "node-1.token"
    token.write_text("tok-123\n")
    env = dict(os.environ, TIERWATCH_TOKEN_FILE=str(token))
    env.pop("TIERWATCH_TOKEN", None)
    ok = subprocess.run(  # the file variable is gone: the agent would refuse token + file
        [str(script), "sh", "-c", 'printf %s "$TIERWATCH_TOKEN${TIERWATCH_TOKEN_FILE:-}"'],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert (ok.returncode, ok.stdout) == (0, "tok-123")
    env["TIERWATCH_TOKEN_FILE"] = str(tmp_path / "missing")
    bad = subprocess.run([str(script), "true"], capture_output=True, text=True, env=env, timeout=30)
    assert bad.returncode == 78
    assert "TIERWATCH_TOKEN_FILE" in bad.stderr


def test_bootstrap_creates_agent_tokens_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERWATCH_")}
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        TIERWATCH_DATABASE_URL=f"sqlite:///{tmp_path / 'tw.db'}",
    )
    migrate = subprocess.run(
        [str(BIN / "tierwatch-server"), "migrate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert migrate.returncode == 0, migrate.stderr
    script = str(REPO / "docker" / "bootstrap-tokens.sh")
    tokens = tmp_path / "tokens"
    first = subprocess.run(
        [script, str(tokens), "node-1", "node-2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert first.returncode == 0, first.stderr
    made = {p.name: p.read_text().strip() for p in tokens.iterdir()}
    assert set(made) == {"node-1.token", "node-2.token"}
    assert all(made.values())
    assert stat.S_IMODE((tokens / "node-1.token").stat().st_mode) == 0o600
    again = subprocess.run(
        [script, str(tokens), "node-1", "node-2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0
    assert "kept" in again.stderr
    assert {p.name: p.read_text().strip() for p in tokens.iterdir()} == made
    listed = subprocess.run(
        [str(BIN / "tierwatch-server"), "token", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.count("agent") >= 2, listed.stdout


# --- Kubernetes ------------------------------------------------------------------------------


def k8s_objects() -> list[dict[str, Any]]:
    """Every object of the package's files (base, migration Job, ServiceMonitor component), read
    directly; test_kubernetes.py renders them with kustomize and validates the result."""
    docs = []
    for f in sorted(K8S_DIR.rglob("*.yaml")):
        if f.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


def test_kubernetes_agent_daemonset():
    objects = k8s_objects()
    for obj in objects:
        assert {"apiVersion", "kind", "metadata"} <= set(obj), obj
    ds = next(o for o in objects if o["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert (
        ds["spec"]["selector"]["matchLabels"].items()
        <= ds["spec"]["template"]["metadata"]["labels"].items()
    )
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"], "no nodeSelector for GPU nodes"
    (agent,) = pod["containers"]
    sc = agent["securityContext"]
    assert not sc.get("privileged")
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert not sc["capabilities"].get("add")
    env = {e["name"]: e for e in agent["env"]}
    assert env["TIERWATCH_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    for section in ("limits", "requests"):
        assert "nvidia.com/gpu" not in agent.get("resources", {}).get(section, {}), (
            "an agent that only reads NVML must not request a GPU"
        )
    stages = parse_stages()
    problems = check_command(
        agent["args"], "DaemonSet agent", installed_scripts(stages, "agent"), "/"
    )
    assert not problems, "\n".join(problems)
    args = agent["args"]
    assert _opt(args, "--collector") == "nvml"
    # Prometheus scrapes each node's agent (dcgm-exporter's format) on a port of its own
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert _opt(args, "--metrics-listen") == f"0.0.0.0:{ports['metrics']}"
    memory_dir = _opt(args, "--memory-dir")
    mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mount = next(p for p in mounts if memory_dir.startswith(p + "/"))
    memory = volumes[mounts[mount]]
    if "hostPath" in memory:
        assert memory["hostPath"]["path"].startswith("/dev/shm/")
    else:
        assert memory["emptyDir"]["medium"] == "Memory"
        assert memory["emptyDir"]["sizeLimit"]
    # every other writable path is a volume (read-only root file system)
    for opt in ("--spool-dir", "--state-dir"):
        assert any(_opt(args, opt).startswith(p + "/") for p in mounts), opt
    # each node's own token, from the node itself: no Secret holds every node's token, and
    # there is no peer secret (agents sign as their node)
    assert not [v for v in volumes.values() if "secret" in v], "a Secret shared by all nodes"
    token_file = env["TIERWATCH_TOKEN_FILE"]["value"]
    token_volume = volumes[mounts[token_file]]
    assert token_volume["hostPath"] == {"path": token_file, "type": "File"}
    assert "TIERWATCH_PEER_TOKEN_FILE" not in env
    assert "TIERWATCH_PEER_TOKEN" not in env


def test_kubernetes_server_rbac_matches_the_isolation_driver():
    source = (REPO / "app" / "actions" / "drivers.py").read_text()
    calls = set(re.findall(r"self\._core\.(\w+)\(", source))
    verb_of = {
        "read_node": "get",
        "patch_node": "patch",
        "replace_node": "update",
        "list_node": "list",
        "create_namespaced_pod_eviction": "create",
    }
    assert calls <= verb_of.keys(), f"unknown API calls in the driver: {calls - verb_of.keys()}"
    needed = {verb_of[c] for c in calls}
    objects = k8s_objects()
    role = next(o for o in objects if o["kind"] == "ClusterRole")
    granted = {v for r in role["rules"] if "nodes" in r["resources"] for v in r["verbs"]}
    assert granted == needed, f"the driver needs {needed} on nodes, the role grants {granted}"
    binding = next(o for o in objects if o["kind"] == "ClusterRoleBinding")
    sa = next(
        o
        for o in objects
        if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == binding["subjects"][0]["name"]
    )
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert sa["metadata"]["namespace"] == binding["subjects"][0]["namespace"]


# --- Slurm -------------------------------------------------------------------------------------


def unit_sections(path: Path) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"{path.name}: {line} outside a section"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_systemd_unit(tmp_path):
    unit = SLURM_DIR / "tierwatch-agent.service"
    service = unit_sections(unit)["Service"]
    assert service["User"] == ["tierwatch"]
    assert service["EnvironmentFile"] == ["/etc/tierwatch/agent.env"]
    assert service["Restart"] == ["always"]
    (exec_start,) = service["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0] == "/opt/tierwatch/bin/tierwatch-agent"
    problems = check_cli(["tierwatch-agent", *argv[1:]], "ExecStart")
    assert not problems, "\n".join(problems)
    assert _opt(argv, "--memory-dir").startswith("/dev/shm/")
    analyze = shutil.which("systemd-analyze")
    if analyze:  # verify the unit itself, with the binary where this checkout has it
        copy = tmp_path / unit.name
        copy.write_text(unit.read_text().replace(argv[0], str(BIN / "tierwatch-agent")))
        proc = subprocess.run(
            [analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60
        )
        output = "\n".join(
            line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()
        )
        assert proc.returncode == 0, output
        assert not output, output


def env_file(path: Path) -> dict[str, str]:
    pairs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


def test_slurm_env_examples_name_real_settings(monkeypatch):
    from tierwatch.agent.config import AgentSettings
    from tierwatch.server.actions.drivers import SlurmDriver, make_cluster_driver
    from tierwatch.server.config import Settings

    for key in [k for k in os.environ if k.startswith("TIERWATCH_")]:
        monkeypatch.delenv(key)
    server = env_file(SLURM_DIR / "server.env.example")
    assert server["TIERWATCH_ISOLATION__DRIVER"] == "slurm"
    for key in server:
        top, _, nested = key.removeprefix("TIERWATCH_").lower().partition("__")
        assert top in Settings.model_fields, f"server.env.example: {key} is no setting"
        if nested:
            sub = Settings.model_fields[top].annotation
            assert nested in sub.model_fields, f"server.env.example: {key} is no setting"
    for key, value in server.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.isolation.scontrol == server["TIERWATCH_ISOLATION__SCONTROL"]
    assert isinstance(make_cluster_driver(settings.isolation), SlurmDriver)
    settings.check_serving()

    agent = env_file(SLURM_DIR / "agent.env.example")
    for key in server:
        monkeypatch.delenv(key)
    for key, value in agent.items():
        assert key.removeprefix("TIERWATCH_").lower() in AgentSettings.model_fields, key
        monkeypatch.setenv(key, value)
    loaded = AgentSettings()
    assert loaded.node == agent["TIERWATCH_NODE"]


def test_sbatch_runs_train_gpt_one_rank_per_gpu():
    script = SLURM_DIR / "train.sbatch"
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    text = script.read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.MULTILINE))
    assert directives["ntasks-per-node"] == directives["gpus-per-node"]
    assert "srun " in text
    assert re.search(r"^export TIERWATCH_AGENT_URL=http://127\.0\.0\.1:9470$", text, re.MULTILINE)
    joined = re.sub(r"\\\n\s*", " ", text)
    line = next(
        ln
        for ln in joined.splitlines()
        if "examples/train_gpt.py" in ln and not ln.lstrip().startswith("#")
    )
    words = shlex.split(line[line.index("examples/train_gpt.py") :])
    problems = check_python_script(["python", *words], "train.sbatch", "/")
    assert not problems, "\n".join(problems)
    assert _opt(words, "--device") == "cuda"
