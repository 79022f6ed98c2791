"""Helpers shared by tests: migrated databases, headers and realistic agent batches."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Connection, text
from sqlalchemy.engine import make_url

from tierwatch.agent.protocol import GpuInfo, GpuSample, ReportBatch, XidEvent, utcnow
from tierwatch.server.db import make_engine
from tierwatch.server.migrate import upgrade

PG_URL = os.environ.get("TIERWATCH_TEST_DATABASE_URL")


def _pg_schema_url(base: str, schema: str) -> str:
    return (
        make_url(base)
        .update_query_dict({"options": f"-csearch_path={schema}"})
        .render_as_string(hide_password=False)
    )


@contextmanager
def migrated_database(backend: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A freshly migrated database URL: a SQLite file, or a PostgreSQL schema of its own
    (dropped afterwards). Each pytest-xdist worker is its own session, so each gets its own.
    """
    if backend == "sqlite":
        path = tmp_path_factory.mktemp("db") / "tierwatch.db"
        url = f"sqlite:///{path}"
        upgrade(url)
        yield url
        return
    assert PG_URL
    schema = f"tw_test_{uuid.uuid4().hex[:12]}"
    admin = make_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = _pg_schema_url(PG_URL, schema)
    try:
        upgrade(url)
        yield url
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def schema_diff(conn: Connection) -> list[Any]:
    """Alembic's differences between the migrated schema on ``conn`` and the models, leaving
    out the partitions of ``gpu_samples`` (the models know only the parent table)."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from tierwatch.server.db import Base
    from tierwatch.server.fleet.partitions import include_in_autogenerate

    ctx = MigrationContext.configure(conn, opts={"include_object": include_in_autogenerate})
    return list(compare_metadata(ctx, Base.metadata))


def auth(token: str) -> dict[str, str]:
    """The Authorization header for a bearer token."""
    return {"Authorization": f"Bearer {token}"}


def make_batch(
    node: str,
    seq: int,
    *,
    epoch: str = "epoch-1",
    gpus: int = 2,
    offset_s: float = 0.0,
    xids: list[tuple[int, int]] | None = None,
    interval_s: float = 5.0,
    **metrics: object,
) -> ReportBatch:
    """A realistic batch: ``gpus`` GPUs, one sample each, optional (gpu, xid) events.

    ``metrics`` override sample fields on every GPU (e.g. ``temperature_c=95``);
    ``offset_s`` shifts all times (to build a series of reports).
    """
    now = utcnow() + timedelta(seconds=offset_s)
    base = {
        "temperature_c": 55.0,
        "slowdown_temp_c": 90.0,
        "shutdown_temp_c": 95.0,
        "power_w": 400.0,
        "power_limit_w": 700.0,
        "utilization_pct": 90.0,
        "memory_used_mib": 40000.0,
        "memory_total_mib": 81559.0,
        "ecc_sbe_volatile": 0,
        "ecc_dbe_volatile": 0,
        "ecc_sbe_aggregate": 0,
        "ecc_dbe_aggregate": 0,
        "remapped_rows_correctable": 0,
        "remapped_rows_uncorrectable": 0,
        "row_remap_pending": False,
        "row_remap_failure": False,
        "pcie_replay_count": 0,
        "throttle_reasons": 0,
        "nvlink_crc_errors": 0,
        "nvlink_replay_errors": 0,
        "nvlink_recovery_errors": 0,
    }
    base.update(metrics)
    return ReportBatch(
        node=node,
        epoch=epoch,
        seq=seq,
        sent_at=now,
        collector="simulated",
        simulated=True,
        interval_s=interval_s,
        gpus=[GpuInfo(index=i, uuid=f"GPU-{node}-{i}", name="Test GPU") for i in range(gpus)],
        samples=[GpuSample(index=i, ts=now, **base) for i in range(gpus)],  # type: ignore[arg-type]
        xids=[XidEvent(gpu=g, xid=x, ts=now) for g, x in (xids or [])],
    )


def register_job(  # type: ignore[no-untyped-def]
    target,
    job_id: str,
    nodes: list[str] | tuple[str, ...],
    *,
    world_size: int | None = None,
    layout: list[str] | None = None,
    ttl_s: float = 3600.0,
    token: str | None = None,
) -> dict:
    """Register a job as its launcher would before its ranks start: only the agents of
    ``nodes`` may then report for it (``checkpoints.scoping``).

    Args:
        target: a ``TestClient``, the app, a ``Session`` or a session factory (the service is
            called directly and committed, actor ``test``), or a server's base URL (``str``)
            with an operator or admin ``token`` (``POST /api/v1/jobs/{job_id}/credential``).
        job_id, nodes, world_size, layout, ttl_s: as the endpoint takes them.

    Returns:
        The endpoint's answer (``job_id``, ``credential``, ``expires_at``, ``nodes``,
        ``world_size``, ``layout``).
    """
    if isinstance(target, str):
        import httpx

        assert token, "registering through a server URL needs an operator or admin token"
        r = httpx.post(
            f"{target.rstrip('/')}/api/v1/jobs/{job_id}/credential",
            json={"nodes": list(nodes), "world_size": world_size, "layout": layout, "ttl_s": ttl_s},
            headers=auth(token),
            timeout=30,
        )
        assert r.status_code == 200, r.text
        return r.json()
    from sqlalchemy.orm import Session

    from tierwatch.server.credentials.service import register_job as register

    if isinstance(target, TestClient):
        target = target.app
    if hasattr(target, "state"):  # the app
        target = target.state.sessionmaker
    session = target if isinstance(target, Session) else target()
    try:
        result = register(
            session,
            job_id=job_id,
            nodes=list(nodes),
            world_size=world_size,
            layout=layout,
            ttl_s=ttl_s,
            actor="test",
        )
        session.commit()
    finally:
        if session is not target:
            session.close()
    return result


def post_batch(client: TestClient, token: str, batch: ReportBatch):  # type: ignore[no-untyped-def]
    """POST a batch as its agent would."""
    return client.post(
        "/api/v1/ingest/report",
        content=batch.model_dump_json(),
        headers={**auth(token), "Content-Type": "application/json"},
    )
