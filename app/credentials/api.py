"""Job credentials REST API under /api/v1.

- ``GET /credentials/public-keys``: the server's public keys (a JWK set). Public: they are
  what agents check job credentials with, and hold nothing secret; a token sent with the
  request is not looked at.
- ``POST /jobs/{job_id}/credential``: register a job and issue its credential (operator or
  admin; agent tokens and viewers are refused).
- ``/agent/...``: the peer registry, for agent tokens (``peer_api``).
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Response

from tierwatch.server.checkpoints.api import JobIdPath
from tierwatch.server.credentials import peer_api, service
from tierwatch.server.credentials.schemas import JobCredentialIn, JobCredentialOut, JwksOut
from tierwatch.server.deps import SessionDep, SettingsDep
from tierwatch.server.security import OperatorDep, error_responses

router = APIRouter(prefix="/api/v1", tags=["credentials"])


@router.get("/credentials/public-keys", response_model=JwksOut)
def public_keys(session: SessionDep) -> dict:
    """The JWK set (RFC 7517) of the Ed25519 keys job credentials are signed with (RFC 8037:
    ``kty`` OKP, ``crv`` Ed25519, ``alg`` EdDSA). No token needed."""
    return service.public_key_set(session)


@router.post(
    "/jobs/{job_id}/credential",
    response_model=JobCredentialOut,
    responses=error_responses(401, 403, 413, 422),
)
def job_credential(
    job_id: JobIdPath,
    body: JobCredentialIn,
    principal: OperatorDep,
    session: SessionDep,
    settings: SettingsDep,
    response: Response,
) -> dict:
    """Register the job and issue its credential, before its ranks start (a Slurm
    ``PrologSlurmctld`` or the launcher).

    Pins the nodes whose agents may report for the job, and its world size and rank→node
    layout when given (else rank 0's first layout report pins the layout). Registering
    again (the job's restart) replaces them and issues a new credential with the same
    secret. Audited (without the credential); the answer is not cached.

    Raises:
        HTTPException: 403 for viewer and agent tokens.
        RequestValidationError: 422 for bad node names, a layout that names a node not in
            ``nodes`` or has another length than ``world_size``, or ``ttl_s`` outside
            60 s to 366 days.
    """
    response.headers["Cache-Control"] = "no-store"
    ttl_s = body.ttl_s if body.ttl_s is not None else settings.job_credential_ttl_s
    try:
        return service.register_job(
            session,
            job_id=job_id,
            nodes=body.nodes,
            world_size=body.world_size,
            layout=body.layout,
            ttl_s=ttl_s,
            actor=principal.actor,
            role=principal.role,
        )
    except service.RegistrationError as exc:  # (the path pattern refuses a bad id first)
        raise HTTPException(status_code=422, detail=str(exc)) from exc


router.include_router(peer_api.router)
