"""Cluster isolation drivers: take a sick node out of the scheduler's service and put it back.

The server records an isolation; the configured driver (``TIERWATCH_ISOLATION__DRIVER``)
applies it to the cluster scheduler:

- ``none`` (default): record only, nothing is applied.
- ``command``: node-local, run by the node's agent (``tierwatch.agent.commands``), not here.
- ``slurm``: ``scontrol update nodename=<node> state=drain reason=<reason>`` /
  ``state=resume``, run on the server (:class:`SlurmDriver`), in the server's environment
  less its secrets (:func:`tierwatch.agent.envsafe.scrubbed_env`).
- ``kubernetes``: cordon + a ``NoSchedule`` taint through the API server, run on the server
  (:class:`KubernetesDriver`).

The cluster drivers run on the server so that a node whose agent is dead can still be drained.
They never raise for a runtime failure (scheduler down, node unknown, permission denied): the
failure comes back as ``DriverResult(ok=False, ...)`` whose ``output`` the dashboard shows.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol

from pydantic import BaseModel, Field, field_validator
from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from tierwatch.agent.envsafe import scrubbed_env

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

OUTPUT_LIMIT = 4000
"""Most characters of ``DriverResult.output`` (the tail of a command's output is kept)."""

DEFAULT_SLURM_REASON = "tierwatch"
CONFLICT_ATTEMPTS = 5
"""Read-modify-PATCH rounds before a Kubernetes update that keeps hitting 409 gives up."""

MERGE_PATCH = "application/merge-patch+json"
TAINT_EFFECT = "NoSchedule"
TAINT_VALUE = "true"

# A Kubernetes qualified name: an optional DNS-subdomain prefix and "/", then a name of at most
# 63 alphanumerics, "-", "_", "." (starting and ending alphanumeric).
_QUALIFIED_NAME = re.compile(
    r"^(?:(?=.{1,253}/)[a-z0-9]([-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(?=.{1,63}$)[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


class DriverConfigError(ValueError):
    """Isolation settings a driver cannot be built from; the message says what to set."""


class IsolationSettings(BaseModel):
    """How isolations are applied to the cluster (nested in the server settings as
    ``isolation``, so ``TIERWATCH_ISOLATION__DRIVER=slurm`` etc.).

    Attributes:
        driver: ``none`` (record only), ``command`` (run on the node's agent), ``slurm`` or
            ``kubernetes`` (run on the server).
        timeout_s: limit for one driver call, an isolate or a release (seconds, > 0).
        scontrol: the ``scontrol`` executable, a name on ``PATH`` or a path.
        kubeconfig: kubeconfig file for the ``kubernetes`` driver; unset: the in-cluster
            configuration (the pod's service account).
        kube_context: context in ``kubeconfig`` (unset: its current context).
        taint_key: key of the taint the ``kubernetes`` driver adds
            (``<key>=true:NoSchedule``); a qualified name such as ``tierwatch.io/isolated``.
    """

    driver: Literal["none", "command", "slurm", "kubernetes"] = "none"
    timeout_s: Annotated[float, Field(gt=0)] = 60.0
    scontrol: Annotated[str, Field(min_length=1)] = "scontrol"
    kubeconfig: str | None = None
    kube_context: str | None = None
    taint_key: str = "tierwatch.io/isolated"

    @field_validator("kubeconfig", "kube_context")
    @classmethod
    def _empty_is_unset(cls, value: str | None) -> str | None:
        return value or None

    @field_validator("taint_key")
    @classmethod
    def _qualified_name(cls, value: str) -> str:
        if not _QUALIFIED_NAME.match(value):
            raise ValueError(
                f"{value!r} is not a Kubernetes taint key: use [prefix/]name, e.g. "
                "tierwatch.io/isolated (name: at most 63 of A-Z a-z 0-9 - _ .)"
            )
        return value


@dataclass(frozen=True)
class DriverResult:
    """What one isolate/release call did.

    Attributes:
        ok: the scheduler accepted the change (or the node already was in that state).
        exit_code: the process exit code (slurm), the HTTP status of the failing API call
            (kubernetes), or None (success without a status, timeout, not found, unreachable).
        output: for an operator: the command line run and the tail of its stdout/stderr, or
            the API calls made and the error (at most ``OUTPUT_LIMIT`` characters).
    """

    ok: bool
    exit_code: int | None
    output: str


class ClusterDriver(Protocol):
    """A driver that applies isolations to the cluster scheduler from the server."""

    name: str

    def isolate(self, node: str, reason: str) -> DriverResult:
        """Take ``node`` out of service (running work may finish; nothing new starts)."""
        ...

    def release(self, node: str, reason: str) -> DriverResult:
        """Put ``node`` back into service."""
        ...


def make_cluster_driver(settings: IsolationSettings) -> ClusterDriver | None:
    """The server-side driver for ``settings.driver``.

    Returns:
        None for ``none`` and ``command`` (nothing runs on the server), otherwise a
        :class:`SlurmDriver` or :class:`KubernetesDriver`.

    Raises:
        DriverConfigError: (a ValueError) the kubernetes configuration cannot be loaded, e.g.
            ``TIERWATCH_ISOLATION__KUBECONFIG`` names a missing or invalid file, or it is unset
            outside a Kubernetes pod.
    """
    if settings.driver == "slurm":
        return SlurmDriver(settings)
    if settings.driver == "kubernetes":
        return KubernetesDriver(settings)
    return None


def _clip(head: str, body: str = "") -> str:
    """``head`` plus as much of the end of ``body`` as fits in ``OUTPUT_LIMIT`` characters."""
    body = body.strip()
    text = f"{head}\n{body}" if body else head
    if len(text) <= OUTPUT_LIMIT:
        return text
    marker = "[…]"
    if len(head) + 1 + len(marker) >= OUTPUT_LIMIT:
        return head[: OUTPUT_LIMIT - len(marker)] + marker
    room = OUTPUT_LIMIT - len(head) - 1 - len(marker)
    return f"{head}\n{marker}{body[-room:]}"


class SlurmDriver:
    """Drains and resumes Slurm nodes with ``scontrol update``.

    ``isolate`` runs ``scontrol update nodename=<node> state=drain reason=<reason>`` and
    ``release`` runs ``scontrol update nodename=<node> state=resume``. Per the scontrol(1) man
    page, DRAIN stops new jobs from starting on the node while running jobs finish, RESUME
    returns a DRAINED/DRAINING node to service, and a reason is required when a node is set to
    DRAIN (an empty reason becomes ``"tierwatch"``).

    The command is an argv list run without a shell; the reason is one argument
    (``reason=<reason>``), so quotes, ``;`` or ``$(...)`` in it are passed literally. stdout and
    stderr are captured together. On timeout the whole process group is killed.
    """

    name = "slurm"

    def __init__(self, settings: IsolationSettings) -> None:
        self._scontrol = settings.scontrol
        self._timeout_s = settings.timeout_s

    def isolate(self, node: str, reason: str) -> DriverResult:
        """Drain ``node`` (``state=drain``) with ``reason`` (``"tierwatch"`` when empty)."""
        reason = reason.strip() or DEFAULT_SLURM_REASON
        return self._run(["update", f"nodename={node}", "state=drain", f"reason={reason}"])

    def release(self, node: str, reason: str) -> DriverResult:
        """Resume ``node`` (``state=resume``); ``reason`` is only recorded by the caller."""
        del reason  # scontrol keeps no reason for RESUME
        return self._run(["update", f"nodename={node}", "state=resume"])

    def _run(self, args: list[str]) -> DriverResult:
        argv = [self._scontrol, *args]
        shown = "$ " + shlex.join(argv)
        try:
            proc = subprocess.Popen(
                argv,
                env=scrubbed_env(os.environ),  # scontrol never sees the server's secrets
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,
            )
        except FileNotFoundError:
            return DriverResult(
                False,
                None,
                _clip(
                    f"{shown}\nexecutable not found: {self._scontrol!r}; set "
                    "TIERWATCH_ISOLATION__SCONTROL to the scontrol path"
                ),
            )
        except OSError as exc:
            return DriverResult(
                False,
                None,
                _clip(
                    f"{shown}\ncannot run {self._scontrol!r}: {exc.strerror or exc}; check "
                    "TIERWATCH_ISOLATION__SCONTROL"
                ),
            )
        try:
            out, _ = proc.communicate(timeout=self._timeout_s)
        except subprocess.TimeoutExpired:
            out = _kill_group(proc)
            return DriverResult(
                False,
                None,
                _clip(f"{shown}\ntimed out after {self._timeout_s:g} s (killed)", out),
            )
        code = proc.returncode
        return DriverResult(code == 0, code, _clip(f"{shown}\nexit {code}", out))


def _kill_group(proc: subprocess.Popen[str]) -> str:
    """Kill ``proc``'s process group (it runs in its own session) and return what it wrote."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        out, _ = proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:  # a descendant left the group and holds the pipe
        proc.kill()
        if proc.stdout is not None:
            proc.stdout.close()
        proc.wait()
        return ""
    return out or ""


class _DeadlineExceeded(Exception):
    pass


class KubernetesDriver:
    """Cordons and taints Kubernetes nodes through the API server.

    ``isolate`` sets ``spec.unschedulable: true`` (what ``kubectl cordon`` does) and adds the
    taint ``<taint_key>=true:NoSchedule``; ``release`` sets ``spec.unschedulable: false`` and
    removes that taint only. Per the Kubernetes "Taints and Tolerations" docs a ``NoSchedule``
    taint keeps new pods that do not tolerate it off the node and leaves running pods alone; a
    taint is identified by its key and effect, so ours is the one with ``taint_key`` and
    ``NoSchedule`` (isolating twice does not add it twice; other taints are kept).

    Each call reads the node (``GET /api/v1/nodes/{name}``) and sends one JSON merge patch
    (RFC 7386, ``Content-Type: application/merge-patch+json``) with ``metadata.resourceVersion``
    from that read, the new ``spec.unschedulable`` and the whole new ``spec.taints`` list
    (``taints`` is an atomic list: a patch replaces it, it cannot add one item). A
    ``resourceVersion`` in a patch is a precondition (Kubernetes API conventions, "Concurrency
    Control and Consistency"): if the node changed since the read the server answers 409
    Conflict, and the driver reads again and retries, ``CONFLICT_ATTEMPTS`` rounds in all. No
    PATCH is sent when the node already is in the wanted state.

    The service account (or kubeconfig user) needs ``get`` and ``patch`` on ``nodes``.
    """

    name = "kubernetes"

    def __init__(self, settings: IsolationSettings, *, api_client: ApiClient | None = None) -> None:
        """Build the driver.

        Args:
            settings: ``taint_key``, ``timeout_s``, and (without ``api_client``)
                ``kubeconfig`` / ``kube_context``.
            api_client: a ready ``kubernetes.client.ApiClient`` (tests, embedding); the
                kubeconfig settings are then ignored.

        Raises:
            DriverConfigError: the kubeconfig or in-cluster configuration cannot be loaded.
        """
        from kubernetes.client import CoreV1Api

        self._taint_key = settings.taint_key
        self._timeout_s = settings.timeout_s
        self._api_client = api_client if api_client is not None else _load_api_client(settings)
        self._core = CoreV1Api(self._api_client)

    @property
    def host(self) -> str:
        """The API server URL in use."""
        return str(self._api_client.configuration.host)

    def close(self) -> None:
        """Release the HTTP connections."""
        self._api_client.close()

    def isolate(self, node: str, reason: str) -> DriverResult:
        """Cordon ``node`` and add the ``<taint_key>=true:NoSchedule`` taint."""
        return self._update(node, reason, isolate=True)

    def release(self, node: str, reason: str) -> DriverResult:
        """Uncordon ``node`` and remove the ``<taint_key>:NoSchedule`` taint."""
        return self._update(node, reason, isolate=False)

    def _update(self, node: str, reason: str, *, isolate: bool) -> DriverResult:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError, NewConnectionError
        from urllib3.exceptions import TimeoutError as HTTPTimeoutError

        verb = "isolate" if isolate else "release"
        head = f"kubernetes {verb} {node}" + (f" (reason: {reason})" if reason else "")
        calls: list[str] = []
        deadline = time.monotonic() + self._timeout_s
        try:
            for attempt in Retrying(
                stop=stop_after_attempt(CONFLICT_ATTEMPTS),
                retry=retry_if_exception(lambda exc: getattr(exc, "status", None) == 409),
                wait=wait_random_exponential(multiplier=0.05, max=1),
                reraise=True,
            ):
                with attempt:
                    message = self._attempt(node, isolate=isolate, deadline=deadline, calls=calls)
                    return DriverResult(True, None, _clip(head, "\n".join([*calls, message])))
        except ApiException as exc:
            status = exc.status if isinstance(exc.status, int) else None
            calls.append(_api_error(exc, node))
            return DriverResult(False, status, _clip(head, "\n".join(calls)))
        except _DeadlineExceeded:
            calls.append(f"timed out after {self._timeout_s:g} s")
        except HTTPError as exc:
            cause = _root_cause(exc)
            # urllib3's NewConnectionError (refused, no route) subclasses its TimeoutError
            if isinstance(cause, HTTPTimeoutError) and not isinstance(cause, NewConnectionError):
                calls.append(f"timed out after {self._timeout_s:g} s waiting for {self.host}")
            else:
                calls.append(f"cannot reach the Kubernetes API at {self.host}: {cause}")
        except (OSError, ValueError) as exc:  # a broken or non-JSON answer
            calls.append(f"unexpected answer from the Kubernetes API at {self.host}: {exc}")
        return DriverResult(False, None, _clip(head, "\n".join(calls)))

    def _remaining(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _DeadlineExceeded
        return left

    def _attempt(self, node: str, *, isolate: bool, deadline: float, calls: list[str]) -> str:
        """One read-modify-PATCH round; returns the closing line; raises ApiException."""
        from kubernetes.client.exceptions import ApiException

        path = f"/api/v1/nodes/{node}"
        try:
            # _preload_content=False: the raw urllib3 response (the stubs say V1Node)
            got: Any = self._core.read_node(
                node, _preload_content=False, _request_timeout=self._remaining(deadline)
            )
        except ApiException as exc:
            calls.append(f"GET {path} -> {exc.status} {exc.reason}")
            raise
        current = json.loads(got.data)
        if not isinstance(current, dict):
            raise ValueError(f"GET {path} answered {type(current).__name__}, not a Node object")
        version = (current.get("metadata") or {}).get("resourceVersion")
        spec = current.get("spec") or {}
        taints: list[dict[str, Any]] = list(spec.get("taints") or [])
        calls.append(f"GET {path} -> {got.status} (resourceVersion {version})")

        def ours(taint: dict[str, Any]) -> bool:
            return taint.get("key") == self._taint_key and taint.get("effect") == TAINT_EFFECT

        if isolate:
            mine = {"key": self._taint_key, "value": TAINT_VALUE, "effect": TAINT_EFFECT}
            new_taints = taints if any(ours(t) for t in taints) else [*taints, mine]
        else:
            new_taints = [t for t in taints if not ours(t)]
        unschedulable = isolate
        taint = f"{self._taint_key}={TAINT_VALUE}:{TAINT_EFFECT}"
        if bool(spec.get("unschedulable")) == unschedulable and new_taints == taints:
            state = "cordoned with taint" if isolate else "schedulable without taint"
            return f"already {state} {taint}: nothing to change"

        patch: dict[str, Any] = {"spec": {"unschedulable": unschedulable, "taints": new_taints}}
        if version is not None:
            patch = {"metadata": {"resourceVersion": version}, **patch}
        shown = json.dumps(patch["spec"], separators=(",", ":"))
        try:
            sent = self._core.patch_node(
                node,
                patch,
                _content_type=MERGE_PATCH,
                _preload_content=False,
                _request_timeout=self._remaining(deadline),
            )
        except ApiException as exc:
            note = " (node changed since read)" if exc.status == 409 else ""
            calls.append(f"PATCH {path} {shown} -> {exc.status} {exc.reason}{note}")
            raise
        calls.append(f"PATCH {path} {shown} -> {sent.status}")
        done = f"cordoned, taint {taint} set" if isolate else f"uncordoned, taint {taint} removed"
        return done


def _api_error(exc: Any, node: str) -> str:
    """One line for an ApiException: status, reason, the API's message and what to do."""
    message = ""
    try:
        message = json.loads(exc.body or "").get("message", "")
    except (ValueError, AttributeError):
        message = (exc.body or "").strip()[:300]
    line = f"error {exc.status} {exc.reason}" + (f": {message}" if message else "")
    if exc.status == 404:
        line += f"; no node named {node!r} in this cluster (compare `kubectl get nodes`)"
    elif exc.status in (401, 403):
        line += "; the server's Kubernetes identity needs get and patch on nodes (RBAC)"
    elif exc.status == 409:
        line += f"; the node kept changing, gave up after {CONFLICT_ATTEMPTS} attempts"
    return line


def _root_cause(exc: BaseException) -> BaseException:
    """The error inside urllib3's MaxRetryError (``reason``), else ``exc`` itself."""
    reason = getattr(exc, "reason", None)
    return reason if isinstance(reason, BaseException) else exc


def _load_api_client(settings: IsolationSettings) -> ApiClient:
    """An ApiClient from ``settings.kubeconfig`` (+ ``kube_context``) or the in-cluster config.

    Raises:
        DriverConfigError: the file is missing, unreadable or invalid, the context is unknown,
            or (without a kubeconfig) the process is not running in a Kubernetes pod.
    """
    import yaml
    from kubernetes import client, config

    if settings.kubeconfig is None:
        if settings.kube_context is not None:
            raise DriverConfigError(
                "TIERWATCH_ISOLATION__KUBE_CONTEXT is set without "
                "TIERWATCH_ISOLATION__KUBECONFIG: set the kubeconfig file that has this context"
            )
        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException as exc:
            raise DriverConfigError(
                "TIERWATCH_ISOLATION__DRIVER=kubernetes without TIERWATCH_ISOLATION__KUBECONFIG "
                f"uses the in-cluster service account, which is not available here ({exc}): "
                "run the server in a pod with a service account, or set "
                "TIERWATCH_ISOLATION__KUBECONFIG to a kubeconfig file"
            ) from exc
        return client.ApiClient(configuration)

    path = Path(settings.kubeconfig).expanduser()
    setting = f"TIERWATCH_ISOLATION__KUBECONFIG={settings.kubeconfig}"
    if not path.is_file():
        raise DriverConfigError(f"{setting}: no such file; set it to a readable kubeconfig file")
    if not os.access(path, os.R_OK):
        raise DriverConfigError(f"{setting}: file is not readable by this process")
    try:
        return config.new_client_from_config(
            config_file=str(path), context=settings.kube_context, persist_config=False
        )
    except (config.ConfigException, yaml.YAMLError, OSError, KeyError, TypeError) as exc:
        context = (
            f" (TIERWATCH_ISOLATION__KUBE_CONTEXT={settings.kube_context})"
            if settings.kube_context
            else ""
        )
        detail = " ".join(str(exc).split())
        raise DriverConfigError(f"{setting}{context}: invalid kubeconfig: {detail}") from exc
