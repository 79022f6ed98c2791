"""The Kubernetes package (``deploy/kubernetes/``, kustomize): rendered, schema-validated, wired.

Rendering: ``kustomize build`` where a ``kustomize`` executable is on ``PATH``, else ``kubectl
kustomize`` (kustomize is built into kubectl, which prints its version from 1.24 on); kustomize
v4 or newer, for components. Three roots are rendered: ``base`` (the package), ``migrate``
(the migration Job, applied first) and ``overlays/servicemonitor`` (the package plus the
optional ServiceMonitors). No renderer: these tests are skipped, or fail under
``TIERWATCH_REQUIRE_SERVERS=1`` (``.ci/run``).

Schemas: kubernetes-validate (PyPI, ``requirements/dev.lock``) validates every rendered object
offline against the JSON schemas it ships, made from the Kubernetes API's OpenAPI document, for
each version in :data:`K8S_VERSIONS`, in strict mode (a field the API does not have is an
error). The ServiceMonitor is a custom resource of the Prometheus Operator
(``monitoring.coreos.com/v1``), for which kubernetes-validate has no schema:
:data:`SERVICEMONITOR_SCHEMA` is written here from the operator's documented API (the fields
this package uses and a few common ones, no other field allowed), with Kubernetes' own
``ObjectMeta`` and ``LabelSelector`` definitions for its metadata and selector.

Wiring: probes, ports, selectors, the service account, the Secret keys, the commands (checked
against the real CLI, as ``test_containers.py`` does), the probe paths (routes of the real
server and agent apps, answered without a credential) and the agent's memory limit against its
``--memory-budget``. Nothing is applied to a cluster: no admission, Pod Security, scheduling,
probe traffic or RBAC check ran.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from executables import REQUIRE_ENV
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from kubernetes.utils import parse_quantity
from referencing import Registry, Resource
from test_containers import _opt, check_command, installed_scripts, parse_stages

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
ROOTS = {
    "base": K8S / "base",
    "migrate": K8S / "migrate",
    "servicemonitor": K8S / "overlays" / "servicemonitor",
}
COMPONENT = K8S / "components" / "servicemonitor"
NAMESPACE = "tierwatch"
#: The oldest and the newest Kubernetes whose schemas the package is validated against.
K8S_VERSIONS = ("1.31.0", "1.37.0")
MIN_KUSTOMIZE = (4, 0)
#: What the agent's limit must hold besides its tmpfs replicas (the --memory-budget): its
#: process (81 MiB RSS measured idle; an S3 upload holds at most 9 x 16 MiB parts).
AGENT_WORKING_SET = 1 << 30
INSTALL_HINT = (
    "install kubectl >= 1.24 (kustomize v4.5+ built in; this machine image ships it with "
    "google-cloud-cli, Debian bookworm's kubernetes-client 1.20 is too old) or a kustomize v4+ "
    "binary on PATH"
)

# --- the ServiceMonitor's schema (Prometheus Operator API, monitoring.coreos.com/v1) ----------

K8S_DEFS = (
    "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1."
)
#: Prometheus' duration (model.Duration), as the operator's Duration type requires it.
DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
    r"(([0-9]+)ms)?)$",
}
LABEL_NAME = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}
RELABEL_ACTIONS = [
    "replace",
    "keep",
    "drop",
    "hashmod",
    "labelmap",
    "labeldrop",
    "labelkeep",
    "lowercase",
    "uppercase",
    "keepequal",
    "dropequal",
]
RELABEL_CONFIG = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": LABEL_NAME},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string", "minLength": 1},
        "regex": {"type": "string"},
        "modulus": {"type": "integer", "minimum": 0},
        "replacement": {"type": "string"},
        "action": {
            "enum": RELABEL_ACTIONS
            + ["Replace", "Keep", "Drop", "HashMod", "LabelMap", "LabelDrop", "LabelKeep"]
            + ["Lowercase", "Uppercase", "KeepEqual", "DropEqual"]
        },
    },
}
ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "anyOf": [{"required": ["port"]}, {"required": ["targetPort"]}],
    "properties": {
        "port": {"type": "string", "minLength": 1},  # a named port of the Service
        "targetPort": {"type": ["integer", "string"]},
        "path": {"type": "string", "pattern": "^/"},
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
        "interval": DURATION,
        "scrapeTimeout": DURATION,
        "honorLabels": {"type": "boolean"},
        "relabelings": {"type": "array", "items": RELABEL_CONFIG},
        "metricRelabelings": {"type": "array", "items": RELABEL_CONFIG},
    },
}
SERVICEMONITOR_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"$ref": K8S_DEFS + "ObjectMeta"},
        "spec": {
            "type": "object",
            # selector: required by every operator release; endpoints: by the older ones
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {"$ref": K8S_DEFS + "LabelSelector"},
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "jobLabel": {"type": "string"},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "endpoints": {"type": "array", "minItems": 1, "items": ENDPOINT},
            },
        },
    },
}


# --- rendering and validating -------------------------------------------------------------------


def _missing(message: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{message}; {REQUIRE_ENV}=1 requires it", pytrace=False)
    pytest.skip(message)


def _version(text: str) -> tuple[int, int] | None:
    m = re.search(r"v(\d+)\.(\d+)", text)
    return (int(m[1]), int(m[2])) if m else None


@pytest.fixture(scope="module")
def kustomize() -> list[str]:
    """The renderer's argv, to which a kustomization folder is appended."""
    standalone = shutil.which("kustomize")
    kubectl = shutil.which("kubectl")
    if standalone:
        argv, probe = [standalone, "build"], [standalone, "version"]
    elif kubectl:
        argv, probe = [kubectl, "kustomize"], [kubectl, "version", "--client"]
    else:
        _missing(f"neither kustomize nor kubectl found: {INSTALL_HINT}")
    proc = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    text = proc.stdout + proc.stderr
    if argv[1] == "kustomize":  # kubectl: "Kustomize Version: v5.5.0"
        text = next((ln for ln in text.splitlines() if ln.startswith("Kustomize")), "")
    found = _version(text)
    if found is None or found < MIN_KUSTOMIZE:
        _missing(
            f"{' '.join(probe)}: kustomize {found or '?'} cannot render components: {INSTALL_HINT}"
        )
    return argv


def render(argv: list[str], root: Path) -> list[dict[str, Any]]:
    proc = subprocess.run([*argv, str(root)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, f"{' '.join(argv)} {root.relative_to(REPO)}:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def rendered(kustomize) -> dict[str, list[dict[str, Any]]]:
    return {name: render(kustomize, root) for name, root in ROOTS.items()}


def listed_files(root: Path) -> list[Path]:
    """The files a kustomization lists, through the kustomizations and components it names."""
    spec = yaml.safe_load((root / "kustomization.yaml").read_text())
    out = []
    for entry in [*spec.get("resources", []), *spec.get("components", [])]:
        path = (root / entry).resolve()
        out += listed_files(path) if path.is_dir() else [path]
    return out


def files_of(root: Path) -> list[dict[str, Any]]:
    """The objects of the files a kustomization lists, read directly: what it renders to when
    it has no transformer."""
    return [d for f in listed_files(root) for d in yaml.safe_load_all(f.read_text()) if d]


def key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return (obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"])


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


@functools.cache
def kubernetes_validate() -> Any:
    try:
        from kubernetes_validate import utils
    except ImportError:
        pytest.fail(
            "kubernetes-validate is not installed: .venv/bin/pip install -r requirements/dev.lock "
            "(make setup)",
            pytrace=False,
        )
    return utils


@functools.cache
def servicemonitor_validator(version: str) -> jsonschema.Draft202012Validator:
    utils = kubernetes_validate()
    major_minor = ".".join(version.split(".")[:2])
    defs = utils.schema_contents(
        f"kubernetes-json-schema/v{major_minor}.0-local-strict/_definitions.json", version
    )
    registry = Resource.from_contents(defs) @ Registry()
    return jsonschema.Draft202012Validator(SERVICEMONITOR_SCHEMA, registry=registry)


def validate(obj: dict[str, Any], version: str) -> None:
    """Raises jsonschema.ValidationError (kubernetes-validate's is one) for an invalid object,
    and fails the test for a kind that no schema covers."""
    if (obj["apiVersion"], obj["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor"):
        servicemonitor_validator(version).validate(obj)
        return
    utils = kubernetes_validate()
    try:
        utils.validate(obj, version, strict=True)
    except utils.SchemaNotFoundError:
        pytest.fail(f"no schema for {obj['apiVersion']} {obj['kind']}: validate it some other way")


# --- the real apps (probe and scrape paths) -------------------------------------------------------


def get_routes(app: FastAPI) -> set[str]:
    return {r.path for r in app.routes if isinstance(r, APIRoute) and "GET" in r.methods}


@pytest.fixture(scope="module")
def server_app(tmp_path_factory) -> FastAPI:
    from tierwatch.server.config import Settings
    from tierwatch.server.main import create_app

    db = tmp_path_factory.mktemp("server") / "tw.db"
    return create_app(Settings(database_url=f"sqlite:///{db}", secret_key="k" * 48))


@pytest.fixture(scope="module")
def agent_apps(tmp_path_factory) -> Iterator[tuple[FastAPI, FastAPI]]:
    """The agent's local API app and its metrics listener's app, over a simulated runtime that
    is never started."""
    from tierwatch.agent.collectors.simulated import SimulatedCollector
    from tierwatch.agent.config import AgentSettings
    from tierwatch.agent.runtime import AgentRuntime
    from tierwatch.agent.server import create_app, create_metrics_app

    tmp = tmp_path_factory.mktemp("agent")
    settings = AgentSettings(
        node="gpu-1",
        server="http://127.0.0.1:9",
        token="t" * 32,
        spool_dir=tmp / "spool",
        listen="127.0.0.1:0",
        memory_dir=tmp / "memory",
        state_dir=tmp / "state",
    )
    runtime = AgentRuntime(settings, collector=SimulatedCollector("gpu-1", gpus=1, seed=1))
    yield create_app(runtime), create_metrics_app(runtime)
    runtime.shutdown()


def check_probe(probe: dict[str, Any], container: dict[str, Any], app: FastAPI, what: str) -> int:
    """A probe is an HTTP GET of a route the app has, on a named container port, answered 200
    without a credential from an address that is not loopback (the kubelet's is the node's).
    Returns the container port number."""
    get = probe["httpGet"]
    assert get["path"] in get_routes(app), f"{what}: {get['path']} is no GET route of the app"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert get["port"] in ports, f"{what}: port {get['port']!r} is not a named container port"
    client = TestClient(app, client=("10.0.0.7", 50000))  # no lifespan: no database needed
    assert client.get(get["path"]).status_code == 200, f"{what}: GET {get['path']} is not 200"
    return ports[get["port"]]


def every_object(rendered: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each object of the three roots once (the overlay holds the base's too)."""
    return list({key(o): o for objs in rendered.values() for o in objs}.values())


def pod_of(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def port_of(listen: str) -> int:
    return int(listen.rsplit(":", 1)[1])


# --- the tests ------------------------------------------------------------------------------


def test_each_root_renders_exactly_its_files(rendered):
    """No transformer: what the files say is what kubectl applies (so test_containers.py's
    checks of the files hold for the rendered package too)."""
    for name, root in ROOTS.items():
        assert sorted(rendered[name], key=key) == sorted(files_of(root), key=key), name
    base = {key(o) for o in rendered["base"]}
    monitored = {key(o) for o in rendered["servicemonitor"]}
    component = {key(o) for o in files_of(COMPONENT)}
    assert monitored == base | component
    assert not base & component
    assert {o["kind"] for o in rendered["migrate"]} == {"Job"}
    # every YAML file of the package is in one of the roots
    listed = {str(p) for root in ROOTS.values() for p in listed_files(root)}
    on_disk = {str(p.resolve()) for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert on_disk == listed, f"not in any kustomization: {sorted(on_disk - listed)}"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_the_api_schemas(rendered, version):
    objects = {key(o): o for o in every_object(rendered)}
    for obj in objects.values():
        try:
            validate(obj, version)
        except jsonschema.ValidationError as exc:
            where = ".".join(str(p) for p in exc.absolute_path)
            pytest.fail(f"{key(obj)} against Kubernetes {version}: {where}: {exc.message}")
    kinds = {k for k, _, _ in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget", "Job", "DaemonSet"} <= kinds
    assert {"ClusterRole", "ClusterRoleBinding", "ServiceMonitor"} <= kinds


def _set(obj: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node: Any = obj
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[int(last) if last.isdigit() else last] = value


BROKEN = [
    # (kind, name, path, value): each must be refused
    (
        "Deployment",
        "tierwatch-server",
        "spec.template.spec.containers.0.readinessProbe.httpGet.port",
        ["http"],
    ),
    ("Deployment", "tierwatch-server", "spec.replicas", "two"),
    ("Deployment", "tierwatch-server", "spec.template.spec.containers.0.livenessProbes", {}),
    ("PodDisruptionBudget", "tierwatch-server", "spec.minAvailable", True),
    (
        "DaemonSet",
        "tierwatch-agent",
        "spec.template.spec.containers.0.livenessProbe.periodSeconds",
        "20s",
    ),
    (
        "Job",
        "tierwatch-migrate",
        "spec.template.spec.containers.0.args",
        "tierwatch-server migrate",
    ),
    ("Service", "tierwatch-server", "spec.ports.0.port", "http"),
    ("ServiceMonitor", "tierwatch-agent", "spec.endpoints.0.interval", "15 seconds"),
    (
        "ServiceMonitor",
        "tierwatch-agent",
        "spec.endpoints.0.metricRelabelings.1.action",
        "labeldorp",
    ),
    ("ServiceMonitor", "tierwatch-agent", "spec.endpoints.0.metricRelabelConfigs", []),
    ("ServiceMonitor", "tierwatch-server", "spec.selector.matchLabel", {}),
]


@pytest.mark.parametrize(
    ("kind", "name", "path", "value"),
    BROKEN,
    ids=[b[2].rsplit(".", 1)[-1] + "-" + b[0] for b in BROKEN],
)
def test_the_validators_refuse_a_broken_manifest(rendered, kind, name, path, value):
    good = one(every_object(rendered), kind, name)
    validate(good, K8S_VERSIONS[-1])  # the object as shipped passes
    bad = copy.deepcopy(good)
    _set(bad, path, value)
    with pytest.raises(jsonschema.ValidationError):
        validate(bad, K8S_VERSIONS[-1])


def test_servicemonitor_without_a_selector_is_refused(rendered):
    sm = copy.deepcopy(one(rendered["servicemonitor"], "ServiceMonitor", "tierwatch-server"))
    del sm["spec"]["selector"]
    with pytest.raises(jsonschema.ValidationError, match="selector"):
        validate(sm, K8S_VERSIONS[-1])


def test_server_deployment(rendered, server_app):
    base = rendered["base"]
    deploy = one(base, "Deployment", "tierwatch-server")
    spec = deploy["spec"]
    pod = pod_of(deploy)
    assert spec["replicas"] >= 2  # leader election over the database (app/leader.py)
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    # the service account bound to the isolation ClusterRole
    binding = one(base, "ClusterRoleBinding", "tierwatch-server-isolation")
    (subject,) = binding["subjects"]
    assert (pod["serviceAccountName"], NAMESPACE) == (subject["name"], subject["namespace"])
    one(base, "ServiceAccount", pod["serviceAccountName"])
    assert pod.get("automountServiceAccountToken", True), "the kubernetes driver needs the token"
    # non-root like the agent, with the image's uid
    agent_pod = pod_of(one(base, "DaemonSet", "tierwatch-agent"))
    for field in ("runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile"):
        assert pod["securityContext"][field] == agent_pod["securityContext"][field], field
    (server,) = pod["containers"]
    (agent,) = agent_pod["containers"]
    assert server["securityContext"] == agent["securityContext"]
    # the command
    args = server["args"]
    problems = check_command(
        args, "Deployment server", installed_scripts(parse_stages(), "server"), "/"
    )
    assert not problems, "\n".join(problems)
    assert args[:2] == ["tierwatch-server", "serve"]
    assert "--no-migrate" not in args  # serve migrates first: it would serve an unmigrated schema
    assert _opt(args, "--host") == "0.0.0.0"
    # probes: real routes on the port serve listens on
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        port = check_probe(server[kind], server, server_app, f"server {kind}")
        assert port == int(_opt(args, "--port")), f"server {kind} probes port {port}"
    res = server["resources"]
    assert {"cpu", "memory"} <= res["requests"].keys()
    assert "memory" in res["limits"]
    assert parse_quantity(res["limits"]["memory"]) >= parse_quantity(res["requests"]["memory"])


def test_server_environment_names_real_settings(rendered):
    from tierwatch.server.actions.drivers import IsolationSettings
    from tierwatch.server.config import Settings

    (server,) = pod_of(one(rendered["base"], "Deployment", "tierwatch-server"))["containers"]
    env = {e["name"]: e for e in server["env"]}
    for name in env:
        top, _, nested = name.removeprefix("TIERWATCH_").lower().partition("__")
        assert top in Settings.model_fields, f"{name} is no server setting"
        if nested:
            assert nested in Settings.model_fields[top].annotation.model_fields, name
    for secret in ("TIERWATCH_DATABASE_URL", "TIERWATCH_SECRET_KEY"):
        ref = env[secret]["valueFrom"]["secretKeyRef"]  # from the Secret, never a value here
        assert ref["name"] == "tierwatch-server", secret
        assert ref["key"], secret
    assert IsolationSettings(driver=env["TIERWATCH_ISOLATION__DRIVER"]["value"]).driver == (
        "kubernetes"
    )


def test_server_service_pdb_and_the_agents_server_url(rendered):
    base = rendered["base"]
    deploy = one(base, "Deployment", "tierwatch-server")
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    (server,) = pod_of(deploy)["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    svc = one(base, "Service", "tierwatch-server")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (port,) = svc["spec"]["ports"]
    assert container_ports[port["targetPort"]] == int(_opt(server["args"], "--port"))
    pdb = one(base, "PodDisruptionBudget", "tierwatch-server")
    assert pdb["spec"]["minAvailable"] == 1 < deploy["spec"]["replicas"]
    assert pdb["spec"]["selector"] == deploy["spec"]["selector"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (agent,) = pod_of(one(base, "DaemonSet", "tierwatch-agent"))["containers"]
    url = f"http://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:{port['port']}"
    assert _opt(agent["args"], "--server") == url


def test_migration_job(rendered):
    job = one(rendered["migrate"], "Job", "tierwatch-migrate")
    pod = pod_of(job)
    (migrate,) = pod["containers"]
    problems = check_command(
        migrate["args"], "Job migrate", installed_scripts(parse_stages(), "server"), "/"
    )
    assert not problems, "\n".join(problems)
    assert migrate["args"] == ["tierwatch-server", "migrate"]
    (server,) = pod_of(one(rendered["base"], "Deployment", "tierwatch-server"))["containers"]
    assert migrate["image"] == server["image"]
    job_env = {e["name"]: e for e in migrate["env"]}
    server_env = {e["name"]: e for e in server["env"]}
    assert job_env["TIERWATCH_DATABASE_URL"] == server_env["TIERWATCH_DATABASE_URL"]
    assert pod["restartPolicy"] == "Never"
    assert job["spec"]["backoffLimit"] <= 3
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert migrate["securityContext"]["readOnlyRootFilesystem"] is True


def test_agent_daemonset_priority_probes_and_memory_limit(rendered, agent_apps):
    from tierwatch.agent.config import parse_memory_budget

    ds = one(rendered["base"], "DaemonSet", "tierwatch-agent")
    pod = pod_of(ds)
    assert pod.get("priorityClassName") == "system-node-critical"
    (agent,) = pod["containers"]
    args = agent["args"]
    local_api, _ = agent_apps
    for kind in ("readinessProbe", "livenessProbe"):
        port = check_probe(agent[kind], agent, local_api, f"agent {kind}")
        assert port == port_of(_opt(args, "--listen")), f"agent {kind} probes port {port}"
    # tmpfs pages are charged to the writer's cgroup: the replicas the agent writes count
    budget = parse_memory_budget(_opt(args, "--memory-budget"))
    limit = parse_quantity(agent["resources"]["limits"]["memory"])
    assert limit >= budget + AGENT_WORKING_SET, (
        f"limits.memory {agent['resources']['limits']['memory']} does not hold the "
        f"--memory-budget {_opt(args, '--memory-budget')} of replicas + 1Gi working set"
    )
    assert parse_quantity(agent["resources"]["requests"]["memory"]) == limit


def test_images_are_the_dockerfile_targets_at_one_tag(rendered):
    stages = parse_stages()
    images = set()
    for obj in every_object(rendered):
        if obj["kind"] in ("Deployment", "DaemonSet", "Job"):
            pod = pod_of(obj)
            images |= {c["image"] for c in pod["containers"] + pod.get("initContainers", [])}
    tags = set()
    for image in images:
        name, _, tag = image.partition(":")
        assert name.removeprefix("tierwatch-") in stages, f"{image}: no Dockerfile target"
        tags.add(tag)
    assert len(tags) == 1, f"image tags {tags}"
    assert "latest" not in tags


def test_servicemonitors_scrape_the_real_metrics_endpoints(rendered, server_app, agent_apps):
    from tierwatch.agent.exporter import dcgm_relabel_configs

    objects = rendered["servicemonitor"]
    _, metrics_app = agent_apps

    def service_for(sm: dict[str, Any]) -> dict[str, Any]:
        wanted = sm["spec"]["selector"]["matchLabels"].items()
        (svc,) = [
            o
            for o in objects
            if o["kind"] == "Service"
            and o["metadata"]["namespace"] == sm["metadata"]["namespace"]
            and wanted <= o["metadata"].get("labels", {}).items()
        ]
        return svc

    def target_port(svc: dict[str, Any], workload: dict[str, Any], port_name: str) -> int:
        assert svc["spec"]["selector"].items() <= (
            workload["spec"]["template"]["metadata"]["labels"].items()
        )
        (svc_port,) = [p for p in svc["spec"]["ports"] if p["name"] == port_name]
        (container,) = pod_of(workload)["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        return ports[svc_port["targetPort"]]

    server_sm = one(objects, "ServiceMonitor", "tierwatch-server")
    (endpoint,) = server_sm["spec"]["endpoints"]
    deploy = one(objects, "Deployment", "tierwatch-server")
    svc = service_for(server_sm)
    assert svc["metadata"]["name"] == "tierwatch-server"
    port = target_port(svc, deploy, endpoint["port"])
    assert port == int(_opt(pod_of(deploy)["containers"][0]["args"], "--port"))
    assert endpoint["path"] in get_routes(server_app)

    agent_sm = one(objects, "ServiceMonitor", "tierwatch-agent")
    (endpoint,) = agent_sm["spec"]["endpoints"]
    ds = one(objects, "DaemonSet", "tierwatch-agent")
    svc = service_for(agent_sm)
    assert svc["spec"]["clusterIP"] == "None"  # every pod is a target
    port = target_port(svc, ds, endpoint["port"])
    assert port == port_of(_opt(pod_of(ds)["containers"][0]["args"], "--metrics-listen"))
    assert endpoint["path"] in get_routes(metrics_app)
    # dcgm-exporter's names, from the one source the demo and the Prometheus test use
    spelling = {"source_labels": "sourceLabels", "target_label": "targetLabel"}
    expected = [{spelling.get(k, k): v for k, v in rule.items()} for rule in dcgm_relabel_configs()]
    assert endpoint["metricRelabelings"] == expected
    for rule in endpoint["metricRelabelings"]:
        re.compile(rule.get("regex", "(.*)"))


def test_namespaced_objects_live_in_the_namespace(rendered):
    (ns,) = [o for o in rendered["base"] if o["kind"] == "Namespace"]
    assert ns["metadata"]["name"] == NAMESPACE
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for obj in every_object(rendered):
        if obj["kind"] not in cluster_scoped:
            assert obj["metadata"].get("namespace") == NAMESPACE, key(obj)
