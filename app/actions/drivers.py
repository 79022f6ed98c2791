"""Cluster isolation drivers: take a sick node out of the scheduler's service and put it back.

The server records an isolation; the configured driver (``TIERWATCH_ISOLATION__DRIVER``)
applies it to the cluster scheduler:

- ``none`` (default): record only, nothing is applied.
- ``command``: node-local, run by the node's agent (``tierwatch.agent.commands``), not here.
- ``slurm``: ``scontrol update nodename=<node> state=drain reason="tierwatch: <reason>"`` /
  ``state=resume``, run on the server (:class:`SlurmDriver`), in the server's environment
  less its secrets (:func:`tierwatch.agent.envsafe.scrubbed_env`).
- ``kubernetes``: cordon + a ``NoSchedule`` taint + a mark annotation through the API server,
  run on the server (:class:`KubernetesDriver`).

Both cluster drivers mark what they do and release only their own overlay: a drain or cordon
that someone else made (an admin, NHC, a pending reboot, the GPU Operator) is left in place,
and the result says so (:mod:`~tierwatch.server.actions.slurm_state`,
:mod:`~tierwatch.server.actions.kube_state`). ``observe`` reads the scheduler's view of a node
for corroborating a finding.

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
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol

from pydantic import BaseModel, Field, ValidationInfo, field_validator
from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from tierwatch.agent.envsafe import scrubbed_env
from tierwatch.server.actions import kube_state, slurm_state
from tierwatch.server.actions.slurm_state import SlurmNode

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

OUTPUT_LIMIT = 4000
"""Most characters of ``DriverResult.output`` (the tail of a command's output is kept)."""

CONFLICT_ATTEMPTS = 5
"""Read-modify-PATCH rounds before a Kubernetes update that keeps hitting 409 gives up."""

MERGE_PATCH = "application/merge-patch+json"
TAINT_EFFECT = kube_state.TAINT_EFFECT
TAINT_VALUE = kube_state.TAINT_VALUE

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
        annotation_key: key of the annotation that marks tierwatch's isolation on a Node
            (whether tierwatch made the cordon; :mod:`~tierwatch.server.actions.kube_state`).
    """

    driver: Literal["none", "command", "slurm", "kubernetes"] = "none"
    timeout_s: Annotated[float, Field(gt=0)] = 60.0
    scontrol: Annotated[str, Field(min_length=1)] = "scontrol"
    kubeconfig: str | None = None
    kube_context: str | None = None
    taint_key: str = "tierwatch.io/isolated"
    annotation_key: str = "tierwatch.io/isolation"

    @field_validator("kubeconfig", "kube_context")
    @classmethod
    def _empty_is_unset(cls, value: str | None) -> str | None:
        return value or None

    @field_validator("taint_key", "annotation_key")
    @classmethod
    def _qualified_name(cls, value: str, info: ValidationInfo) -> str:
        if not _QUALIFIED_NAME.match(value):
            what, example = {
                "taint_key": ("taint key", "tierwatch.io/isolated"),
                "annotation_key": ("annotation key", "tierwatch.io/isolation"),
            }[str(info.field_name)]
            raise ValueError(
                f"{value!r} is not a Kubernetes {what}: use [prefix/]name, e.g. "
                f"{example} (name: at most 63 of A-Z a-z 0-9 - _ .)"
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
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerView:
    """What the cluster scheduler says of a node, to corroborate a finding.

    Attributes:
        ok: the scheduler answered; when False, ``text`` says why not.
        text: one line for the reason and the audit entry, e.g. ``slurm: IDLE+NOT_RESPONDING``.
        responding: the scheduler hears from the node (Slurm: not DOWN or NOT_RESPONDING;
            Kubernetes: the ``Ready`` condition is ``True``); None when unknown.
        marked: the node carries tierwatch's own drain or cordon mark.
        detail: the state as plain JSON for the audit log.
    """

    ok: bool
    text: str
    responding: bool | None = None
    marked: bool = False
    detail: dict[str, Any] = field(default_factory=dict)


class ClusterDriver(Protocol):
    """A driver that applies isolations to the cluster scheduler from the server."""

    name: str

    def observe(self, node: str) -> SchedulerView:
        """The scheduler's view of ``node`` (reads only)."""
        ...

    def isolate(self, node: str, reason: str) -> DriverResult:
        """Take ``node`` out of service (running work may finish; nothing new starts)."""
        ...

    def release(self, node: str, reason: str) -> DriverResult:
        """Put ``node`` back into service, undoing only what this driver did."""
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
    """Drains and resumes Slurm nodes with ``scontrol``, undoing only its own drains.

    Each call first reads the node (``scontrol -o show node <node>``, parsed by
    :func:`~tierwatch.server.actions.slurm_state.parse_show_node`), then decides with
    :func:`~tierwatch.server.actions.slurm_state.plan_isolate` /
    :func:`~tierwatch.server.actions.slurm_state.plan_release`:

    - ``isolate`` runs ``scontrol update nodename=<node> state=drain reason="tierwatch: <reason>"``
      unless the node is already drained; someone else's drain (an admin, NHC, a reboot ASAP)
      keeps its reason, so release will leave it alone.
    - ``release`` runs ``scontrol update nodename=<node> state=resume`` only when the drain
      still carries tierwatch's mark and no reboot is pending; otherwise it changes nothing and
      says what it left in place.

    Per scontrol(1), DRAIN stops new jobs from starting while running jobs finish, and RESUME
    returns a drained node to service. Between the read and the update an admin could change
    the node; scontrol offers no compare-and-set, so that window (milliseconds) remains.

    The commands are argv lists run without a shell; the reason is one argument, so quotes,
    ``;`` or ``$(...)`` in it are passed literally. stdout and stderr are captured together.
    On timeout the whole process group is killed. Every result carries the node's Slurm state
    before the change in ``detail["scheduler"]`` for the audit log.
    """

    name = "slurm"

    def __init__(self, settings: IsolationSettings) -> None:
        self._scontrol = settings.scontrol
        self._timeout_s = settings.timeout_s

    def observe(self, node: str) -> SchedulerView:
        """The node's state in Slurm (for corroborating a finding; changes nothing)."""
        lines: list[str] = []
        state, failed = self._show(node, lines)
        if state is None:
            return SchedulerView(ok=False, text=failed.output if failed else "")
        return SchedulerView(
            ok=True,
            text=f"slurm: {state.describe()}",
            responding=state.responding,
            marked=state.marked,
            detail=state.as_detail(),
        )

    def isolate(self, node: str, reason: str) -> DriverResult:
        """Drain ``node`` with ``tierwatch: <reason>`` unless it is already drained."""
        return self._apply(node, reason, isolate=True)

    def release(self, node: str, reason: str) -> DriverResult:
        """Resume ``node`` if tierwatch's drain is still in place and no reboot is pending."""
        del reason  # scontrol keeps no reason for RESUME; the caller records it
        return self._apply(node, "", isolate=False)

    def _apply(self, node: str, reason: str, *, isolate: bool) -> DriverResult:
        lines: list[str] = []
        state, failed = self._show(node, lines)
        if state is None:
            assert failed is not None
            return failed
        plan = slurm_state.plan_isolate(state) if isolate else slurm_state.plan_release(state)
        detail: dict[str, Any] = {
            "scheduler": {"driver": "slurm", "before": state.as_detail(), "action": plan.action}
        }
        lines.append(f"slurm: {plan.note}")
        if plan.action == "none":
            detail["scheduler"]["left_in_place"] = plan.note
            return DriverResult(True, None, _clip("\n".join(lines)), detail)
        if plan.action == "drain":
            args = [
                "update",
                f"nodename={node}",
                "state=drain",
                f"reason={slurm_state.drain_reason(reason)}",
            ]
        else:
            args = ["update", f"nodename={node}", "state=resume"]
        code, out, head = self._run(args)
        lines.append(head)
        ok = code == 0
        text = "\n".join(lines) + ("" if code is None else f"\nexit {code}")
        if not ok:
            text += _slurm_hint(out, node)
        return DriverResult(ok, code, _clip(text, out), detail)

    def _show(self, node: str, lines: list[str]) -> tuple[SlurmNode | None, DriverResult | None]:
        """Read the node; on failure the DriverResult saying why (and None)."""
        code, out, head = self._run(["-o", "show", "node", node])
        lines.append(head)
        if code != 0:
            text = "\n".join(lines) + ("" if code is None else f"\nexit {code}")
            return None, DriverResult(False, code, _clip(text + _slurm_hint(out, node), out))
        try:
            return slurm_state.parse_show_node(out), None
        except slurm_state.SlurmParseError as exc:
            text = "\n".join(lines) + f"\ncannot read the node's state: {exc}"
            return None, DriverResult(False, code, _clip(text))

    def _run(self, args: list[str]) -> tuple[int | None, str, str]:
        """Run scontrol; returns (exit code or None, output, the command line shown).

        A failure to start or a timeout gives None and the explanation as the output.
        """
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
            return (
                None,
                "",
                f"{shown}\nexecutable not found: {self._scontrol!r}; set "
                "TIERWATCH_ISOLATION__SCONTROL to the scontrol path",
            )
        except OSError as exc:
            return (
                None,
                "",
                f"{shown}\ncannot run {self._scontrol!r}: {exc.strerror or exc}; check "
                "TIERWATCH_ISOLATION__SCONTROL",
            )
        try:
            out, _ = proc.communicate(timeout=self._timeout_s)
        except subprocess.TimeoutExpired:
            out = _kill_group(proc)
            return None, out, f"{shown}\ntimed out after {self._timeout_s:g} s (killed)"
        return proc.returncode, out, shown


def _slurm_hint(out: str, node: str) -> str:
    """A line saying what to fix for scontrol errors an operator meets first ("" if none)."""
    low = out.lower()
    if "munge" in low or "authentication" in low or "zero bytes were transmitted" in low:
        return (
            "\nscontrol could not authenticate to slurmctld through munge: run munged on the "
            "server with the cluster's munge.key (and AuthInfo's socket, if slurm.conf sets one)"
        )
    if "unable to contact slurm controller" in low or "connection refused" in low:
        return (
            "\nslurmctld is not reachable from the server: check SlurmctldHost/SlurmctldPort in "
            "the slurm.conf scontrol reads (SLURM_CONF)"
        )
    if "not found" in low or "invalid node name" in low:
        return (
            f"\nSlurm has no node named {node!r}: tierwatch's node name must be the Slurm "
            "NodeName (the agent's --node)"
        )
    return ""


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
        self._annotation_key = settings.annotation_key
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

    def observe(self, node: str) -> SchedulerView:
        """The node's ``Ready`` condition, cordon and tierwatch mark (one GET)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        calls: list[str] = []
        try:
            current = self._read(node, deadline=time.monotonic() + self._timeout_s, calls=calls)
        except ApiException as exc:
            return SchedulerView(ok=False, text=f"kubernetes: {_api_error(exc, node)}")
        except (_DeadlineExceeded, HTTPError, OSError, ValueError) as exc:
            return SchedulerView(
                ok=False, text=f"kubernetes: cannot read node {node!r} at {self.host}: {exc!r}"
            )
        facts = _node_detail(current, self)
        ready = facts["ready"]
        state = {True: "Ready", False: "NotReady", None: "Ready unknown"}[ready]
        if facts["unschedulable"]:
            state += ", cordoned"
        return SchedulerView(
            ok=True,
            text=f"kubernetes: {state}",
            responding=ready,
            marked=facts["marked"],
            detail=facts,
        )

    def isolate(self, node: str, reason: str) -> DriverResult:
        """Cordon ``node`` (unless already cordoned), add the ``<taint_key>=true:NoSchedule``
        taint and the ``<annotation_key>`` mark."""
        return self._update(node, reason, isolate=True)

    def release(self, node: str, reason: str) -> DriverResult:
        """Remove tierwatch's taint and mark; uncordon only if tierwatch made the cordon."""
        return self._update(node, reason, isolate=False)

    def _update(self, node: str, reason: str, *, isolate: bool) -> DriverResult:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError, NewConnectionError
        from urllib3.exceptions import TimeoutError as HTTPTimeoutError

        verb = "isolate" if isolate else "release"
        head = f"kubernetes {verb} {node}" + (f" (reason: {reason})" if reason else "")
        calls: list[str] = []
        detail: dict[str, Any] = {}
        deadline = time.monotonic() + self._timeout_s
        try:
            for attempt in Retrying(
                stop=stop_after_attempt(CONFLICT_ATTEMPTS),
                retry=retry_if_exception(lambda exc: getattr(exc, "status", None) == 409),
                wait=wait_random_exponential(multiplier=0.05, max=1),
                reraise=True,
            ):
                with attempt:
                    message = self._attempt(
                        node,
                        reason,
                        isolate=isolate,
                        deadline=deadline,
                        calls=calls,
                        detail=detail,
                    )
                    return DriverResult(
                        True, None, _clip(head, "\n".join([*calls, message])), detail
                    )
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

    def _read(self, node: str, *, deadline: float, calls: list[str]) -> dict[str, Any]:
        """GET the node as plain JSON; raises ApiException (recorded in ``calls``)."""
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
        calls.append(f"GET {path} -> {got.status} (resourceVersion {version})")
        return current

    def _attempt(
        self,
        node: str,
        reason: str,
        *,
        isolate: bool,
        deadline: float,
        calls: list[str],
        detail: dict[str, Any],
    ) -> str:
        """One read-modify-PATCH round; returns the closing line; raises ApiException."""
        from kubernetes.client.exceptions import ApiException

        path = f"/api/v1/nodes/{node}"
        current = self._read(node, deadline=deadline, calls=calls)
        version = (current.get("metadata") or {}).get("resourceVersion")
        detail["scheduler"] = {"driver": "kubernetes", "before": _node_detail(current, self)}
        change = kube_state.plan(
            current,
            isolate=isolate,
            taint_key=self._taint_key,
            annotation_key=self._annotation_key,
            reason=reason,
            now_rfc3339=datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        )
        detail["scheduler"]["action"] = "none" if change.patch is None else "patch"
        if change.patch is None:
            detail["scheduler"]["left_in_place"] = change.note
            return f"{change.note}: nothing to change"
        patch = dict(change.patch)
        if version is not None:
            patch["metadata"] = {**patch.get("metadata", {}), "resourceVersion": version}
        shown = json.dumps(change.patch, separators=(",", ":"))
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
        if "left" in change.note or "someone else" in change.note:
            detail["scheduler"]["left_in_place"] = change.note
        return change.note


def _node_detail(node: dict[str, Any], driver: KubernetesDriver) -> dict[str, Any]:
    """A Node's scheduling state as plain JSON for the audit log."""
    spec = node.get("spec") or {}
    mark = kube_state.our_mark(node, driver._annotation_key)
    return {
        "unschedulable": bool(spec.get("unschedulable")),
        "taints": [
            f"{t.get('key')}={t.get('value', '')}:{t.get('effect')}"
            for t in spec.get("taints") or []
            if isinstance(t, dict)
        ],
        "ready": kube_state.ready(node),
        "marked": mark is not None,
        "cordoned_by_tierwatch": bool(mark and mark.get("cordoned")),
    }


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
