"""Peer registry REST API under /api/v1/agent (agent tokens only; docs/api.md).

- ``POST /agent/peer-certificate``: certify this agent's node key and URL (the node is the
  token's).
- ``GET /agent/peers?node=a&node=b``: the certificates of registered nodes.
- ``GET /agent/jobs/{job_id}``: a job's registered nodes and pinned layout, for the agents
  of those nodes.

Viewer, operator and admin tokens are refused with 403: these are what agents call.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Response

from tierwatch.agent.protocol import NodeName
from tierwatch.server.checkpoints.api import JobIdPath
from tierwatch.server.credentials import peers
from tierwatch.server.credentials.peer_schemas import (
    MAX_PEER_NODES,
    AgentJobOut,
    PeerCertificateIn,
    PeerOut,
    PeersOut,
)
from tierwatch.server.deps import SessionDep, SettingsDep
from tierwatch.server.security import AgentDep, Principal, error_responses

router = APIRouter(prefix="/agent", tags=["peers"], responses=error_responses(401, 403, 422))

NodesQuery = Annotated[
    list[NodeName],
    Query(
        alias="node",
        min_length=1,
        max_length=MAX_PEER_NODES,
        description=f"node names, 1 to {MAX_PEER_NODES} (repeat the parameter: ?node=a&node=b)",
    ),
]


def _node(principal: Principal) -> str:
    """The agent token's node (agent tokens are always bound to one)."""
    if not principal.node:  # (tokens.create_token refuses an agent token without a node)
        raise HTTPException(status_code=403, detail="this agent token is bound to no node")
    return principal.node


@router.post("/peer-certificate", response_model=PeerOut, responses=error_responses(400, 413))
def peer_certificate(
    body: PeerCertificateIn,
    principal: AgentDep,
    session: SessionDep,
    settings: SettingsDep,
    response: Response,
) -> dict:
    """Certify this agent's node key and advertised URL, and register them as the token's
    node's peer entry (replacing the node's previous one).

    The certificate names the agent token's node (the body has no ``node``: an agent can
    only certify its own node) and lives ``TIERWATCH_NODE_CERTIFICATE_TTL_S`` (default
    24 h); ask again to renew it, well before ``expires_at``. A new node, key or URL is
    audited (``peer_register``). Not cached.

    Raises:
        HTTPException: 403 for viewer, operator and admin tokens.
        RequestValidationError: 422 for a key that is not 32 bytes of base64url, a URL that
            is not ``http(s)://host[:port]`` (no user info, query or fragment; at most 2,048
            characters), or a ``node`` field.
    """
    response.headers["Cache-Control"] = "no-store"
    return peers.certify_node(
        session,
        node=_node(principal),
        url=body.url,
        public_key=body.public_key,
        ttl_s=settings.node_certificate_ttl_s,
        actor=principal.actor,
        role=principal.role,
    )


@router.get("/peers", response_model=PeersOut)
def peer_list(node: NodesQuery, principal: AgentDep, session: SessionDep) -> dict:
    """The URL and node certificate of each named node that registered and whose
    certificate is still valid, in the order asked; the others are absent.

    Raises:
        HTTPException: 403 for viewer, operator and admin tokens.
        RequestValidationError: 422 for no ``node``, more than 4,096, or a malformed name.
    """
    _node(principal)
    return {"peers": peers.registered_peers(session, nodes=node)}


@router.get("/jobs/{job_id}", response_model=AgentJobOut, responses=error_responses(404))
def agent_job(job_id: JobIdPath, principal: AgentDep, session: SessionDep) -> dict:
    """A registered job's nodes, pinned world size and pinned layout (node per rank; null
    until pinned), for the agents of the job's own nodes.

    Raises:
        HTTPException: 403 for people's tokens and for an agent whose node is not one of
            the job's registered nodes; 404 for an unknown or unregistered job.
    """
    try:
        return peers.agent_job(session, job_id=job_id, node=_node(principal))
    except peers.UnknownJobError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from exc
    except peers.NotInJobError as exc:
        raise HTTPException(status_code=403, detail=str(exc)) from exc
