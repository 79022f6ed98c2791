"""Who may call the agent's local API: the node's own agent token, or a job's credential.

Loopback grants nothing (docs/security.md, "The agent's local API"): on a Slurm node every
user's processes are local, and in Kubernetes every trainer pod can reach the node's agent.

Principals:

- **node** — ``Authorization: Bearer <agent token>``: the node's administrator (the agent's
  own token, which trainers never get). May call every control endpoint, for every job.
- **job** — ``Authorization: Bearer <job credential>`` (:mod:`tierwatch.agent.credentials`,
  issued by the server when the job registers): the job's ranks. May call the job-scoped
  endpoints of its own job only (events, notify, available, stage, restore requests,
  rollback), ``GET /v1/ckpt/info`` and ``POST /v1/trainer/latency`` for its own job.

Answers: 401 with ``WWW-Authenticate: Bearer`` when no usable credential is sent (the detail
says which one to send), 403 when the credential is valid but not for this job or action.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from fastapi import HTTPException, Request

from tierwatch.agent.credential_keys import ServerKeys
from tierwatch.agent.credentials import CredentialError, JobCredential


@dataclass(frozen=True)
class Caller:
    """An authenticated caller of the local API.

    Attributes:
        kind: ``node`` (the agent token) or ``job`` (a job credential).
        job: The checked credential for ``kind == "job"``.
    """

    kind: Literal["node", "job"]
    job: JobCredential | None = None

    def may_act_for(self, job_id: str) -> bool:
        """True for the node principal, and for the job's own credential."""
        return self.kind == "node" or (self.job is not None and self.job.job_id == job_id)

    @property
    def name(self) -> str:
        """How logs and refusals name the caller."""
        return "the agent token" if self.job is None else f"the credential of job {self.job.job_id}"


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(status_code=401, detail=detail, headers={"WWW-Authenticate": "Bearer"})


class LocalAccess:
    """Authenticates local API callers (FastAPI dependencies).

    Args:
        agent_token: The agent's own token (None: only job credentials are accepted).
        keys: The server's public keys (checks job credentials).
    """

    def __init__(self, agent_token: str | None, keys: ServerKeys) -> None:
        self.agent_token = agent_token
        self.keys = keys

    def caller(self, request: Request) -> Caller:
        """The caller of ``request``.

        Raises:
            HTTPException: 401 with no bearer credential, or one that is neither the agent
                token nor a valid job credential (the detail says why).
        """
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        given = given.strip()
        if not header or scheme.lower() != "bearer" or not given:
            raise _unauthorized(
                "send 'Authorization: Bearer <job credential>' (TIERWATCH_JOB_CREDENTIAL of "
                "the job, issued by the server when the job registers); loopback alone grants "
                "nothing"
            )
        if self.agent_token and hmac.compare_digest(given.encode(), self.agent_token.encode()):
            return Caller("node")
        try:
            return Caller("job", self.keys.verify_job(given))
        except CredentialError as exc:
            raise _unauthorized(f"credential refused: {exc}") from None

    def node(self) -> Callable[[Request], Caller]:
        """Dependency: the agent token only."""

        def dependency(request: Request) -> Caller:
            who = self.caller(request)
            if who.kind != "node":
                raise HTTPException(
                    status_code=403, detail="this endpoint needs the agent token of the node"
                )
            return who

        return dependency

    def any(self) -> Callable[[Request], Caller]:
        """Dependency: the agent token or any valid job credential."""
        return self.caller

    def job(self) -> Callable[[Request, str], Caller]:
        """Dependency for ``/v1/ckpt/jobs/{job_id}/...``: the agent token or that job's
        credential."""

        def dependency(request: Request, job_id: str) -> Caller:
            who = self.caller(request)
            require_jobs(who, [job_id])
            return who

        return dependency


def require_jobs(caller: Caller, job_ids: Iterable[str]) -> None:
    """Refuse a call that names a job other than the caller's own.

    Raises:
        HTTPException: 403 naming the first such job.
    """
    for job_id in job_ids:
        if not caller.may_act_for(job_id):
            raise HTTPException(
                status_code=403,
                detail=f"{caller.name} may not act for job {job_id!r}: each job uses its own "
                "credential",
            )
