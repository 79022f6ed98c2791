"""API shapes of job registration and the server's public keys (pydantic v2).

Units: ``ttl_s`` seconds; times are timezone-aware UTC.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tierwatch.agent.protocol import NodeName

#: Bounds of a job credential's lifetime (seconds): one minute to a year and a day.
MIN_TTL_S = 60.0
MAX_TTL_S = 366 * 24 * 3600.0
#: Most nodes one registration may name, and most ranks of a layout (as ``JobProgress``).
MAX_NODES = 16384
MAX_RANKS = 65536
MAX_WORLD_SIZE = 2**31 - 1
NODES_SHOWN = 5


class JobCredentialIn(BaseModel):
    """``POST /api/v1/jobs/{job_id}/credential``: register (or re-register) a job.

    Attributes:
        nodes: the nodes the job runs on (node names; duplicates are dropped, order kept).
            Only their agents' reports are accepted for the job.
        world_size: number of ranks, when known (pins it: reports of another world size
            are refused until the job registers again).
        layout: node of every rank (index = rank), when known; every entry must be one of
            ``nodes`` and, with ``world_size``, there must be ``world_size`` of them. None:
            rank 0's first layout report pins it.
        ttl_s: lifetime of the credential (seconds, 60 s to 366 days; default
            ``TIERWATCH_JOB_CREDENTIAL_TTL_S``, 30 days).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    nodes: Annotated[list[NodeName], Field(min_length=1, max_length=MAX_NODES)]
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)] | None = None
    layout: Annotated[list[NodeName], Field(min_length=1, max_length=MAX_RANKS)] | None = None
    ttl_s: Annotated[float, Field(ge=MIN_TTL_S, le=MAX_TTL_S)] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> JobCredentialIn:
        """Drop duplicate nodes; the layout names registered nodes only and, with a world
        size, one per rank."""
        self.nodes = list(dict.fromkeys(self.nodes))
        if self.layout is None:
            return self
        if self.world_size is not None and len(self.layout) != self.world_size:
            raise ValueError(
                f"layout names {len(self.layout)} node(s) but world_size is {self.world_size}: "
                "give one node per rank (or leave one of them out)"
            )
        registered = set(self.nodes)
        unknown = sorted({n for n in self.layout if n not in registered})
        if unknown:
            shown = ", ".join(unknown[:NODES_SHOWN])
            more = f" and {len(unknown) - NODES_SHOWN} more" if len(unknown) > NODES_SHOWN else ""
            raise ValueError(
                f"layout names node(s) {shown}{more}, which are not in nodes: every rank's "
                "node must be one of the job's nodes"
            )
        return self

    @property
    def effective_world_size(self) -> int | None:
        """``world_size``, else the layout's length, else None."""
        if self.world_size is not None:
            return self.world_size
        return len(self.layout) if self.layout is not None else None


class JobCredentialOut(BaseModel):
    """A registered job and its new credential.

    ``credential`` is ``<statement>~<secret>`` (``tierwatch.agent.credentials``): give it to
    the job's ranks (``TIERWATCH_JOB_CREDENTIAL_FILE``), never log it. Every credential of
    one job carries the same secret, so a re-registered job keeps its manifest key.
    """

    job_id: str
    credential: str
    expires_at: datetime
    nodes: list[str]
    world_size: int | None
    layout: list[str] | None


class JwkOut(BaseModel):
    """One Ed25519 public key as a JWK (RFC 8037 section 2)."""

    kty: Literal["OKP"]
    crv: Literal["Ed25519"]
    x: str
    kid: str
    alg: Literal["EdDSA"]
    use: Literal["sig"]


class JwksOut(BaseModel):
    """``GET /api/v1/credentials/public-keys``: the keys job credentials are signed with."""

    keys: list[JwkOut]
