"""The peer registry (server side): POST /api/v1/agent/peer-certificate, GET
/api/v1/agent/peers and GET /api/v1/agent/jobs/{job_id}: who may call them, that a
certificate verifies with the server's public keys and names the token's node and the URL
given, that nothing in the body can name another node, what peers and jobs answer, the
audit of new keys and URLs, the bad inputs refused (nothing stored), the lifetime setting,
and migration 0007."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from alembic import command
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import func, inspect, select
from support import auth, make_batch, migrated_database, post_batch, register_job

from tierwatch.agent.credentials import CredentialVerifier, b64url, manifest_key_of
from tierwatch.agent.peer_identity import public_key_text
from tierwatch.agent.protocol import JobProgress, ReportBatch, utcnow
from tierwatch.server.actions.models import AuditEntry
from tierwatch.server.checkpoints.models import Job
from tierwatch.server.config import Settings
from tierwatch.server.credentials import peers
from tierwatch.server.credentials.models import PeerRegistration
from tierwatch.server.credentials.peer_schemas import MAX_PEER_NODES, MAX_URL_CHARS
from tierwatch.server.db import make_engine
from tierwatch.server.main import create_app
from tierwatch.server.migrate import alembic_config, upgrade

CERT = "/api/v1/agent/peer-certificate"
PEERS = "/api/v1/agent/peers"
JOB = "llm-70b"
URL = "https://gpu-1.cluster:9470"


def new_key() -> str:
    """A fresh node key's public half, as an agent sends it."""
    return public_key_text(Ed25519PrivateKey.generate())


def certify(client, token, *, url=URL, key=None, **extra):  # type: ignore[no-untyped-def]
    body = {"public_key": key or new_key(), "url": url, **extra}
    return client.post(CERT, json=body, headers=auth(token))


def verifier(client) -> CredentialVerifier:  # type: ignore[no-untyped-def]
    r = client.get("/api/v1/credentials/public-keys")
    assert r.status_code == 200, r.text
    return CredentialVerifier.from_jwks(r.json())


def list_peers(client, token, nodes):  # type: ignore[no-untyped-def]
    return client.get(PEERS, params={"node": list(nodes)}, headers=auth(token))


def stored(session) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(registry rows, peer_register audit entries)."""
    session.expire_all()
    rows = session.scalar(select(func.count()).select_from(PeerRegistration))
    audits = session.scalar(
        select(func.count()).select_from(AuditEntry).where(AuditEntry.action == "peer_register")
    )
    return rows, audits


# --- who may call -----------------------------------------------------------------------------


def _calls(client):  # type: ignore[no-untyped-def]
    """Each endpoint called with a valid request (``headers`` given per call)."""
    key = new_key()
    return {
        "certificate": lambda h: client.post(CERT, json={"public_key": key, "url": URL}, headers=h),
        "peers": lambda h: client.get(PEERS, params={"node": ["gpu-1", "gpu-2"]}, headers=h),
        "job": lambda h: client.get(f"/api/v1/agent/jobs/{JOB}", headers=h),
    }


@pytest.mark.parametrize("endpoint", ["certificate", "peers", "job"])
@pytest.mark.parametrize(
    ("role", "status"),
    [("none", 401), ("viewer", 403), ("operator", 403), ("admin", 403), ("agent", 200)],
)
def test_only_agent_tokens_may_call(client, make_token, endpoint, role, status):
    register_job(client, JOB, ["gpu-1", "gpu-2"])
    headers = {} if role == "none" else auth(make_token(role, "gpu-1" if role == "agent" else None))
    r = _calls(client)[endpoint](headers)
    assert r.status_code == status, r.text
    if status == 403:
        assert "only agent tokens" in r.json()["detail"]


def test_a_bad_token_is_refused(client):
    for endpoint in _calls(client).values():
        assert endpoint(auth("not-a-token")).status_code == 401


# --- certificates -----------------------------------------------------------------------------


def test_the_certificate_verifies_and_names_the_tokens_node_and_the_url(
    client, agent_token, session
):
    key = Ed25519PrivateKey.generate()
    r = certify(client, agent_token("gpu-1"), key=public_key_text(key))
    assert r.status_code == 200, r.text
    assert r.headers["cache-control"] == "no-store"
    out = r.json()
    assert (out["node"], out["url"]) == ("gpu-1", URL)
    cert = verifier(client).verify_node_certificate(out["certificate"])
    assert (cert.node, cert.url) == ("gpu-1", URL)
    raw = Encoding.Raw, PublicFormat.Raw
    assert cert.public_key.public_bytes(*raw) == key.public_key().public_bytes(*raw)
    # default lifetime: TIERWATCH_NODE_CERTIFICATE_TTL_S, 24 h
    assert abs(cert.expires_at - time.time() - 86400) < 60
    row = session.get(PeerRegistration, "gpu-1")
    assert row is not None
    assert (row.url, row.public_key, row.certificate) == (URL, public_key_text(key), cert.token)
    assert row.certificate_expires_at.timestamp() == cert.expires_at
    assert row.updated_by.endswith("@gpu-1")


def test_a_node_in_the_body_is_refused_whichever_node_it_names(client, agent_token, session):
    token = agent_token("gpu-1")
    for node in ("gpu-2", "gpu-1"):
        r = certify(client, token, node=node)
        assert r.status_code == 422, r.text
        assert "leave 'node' out" in r.json()["detail"]
    assert stored(session) == (0, 0)


def test_an_agent_cannot_register_another_node(client, agent_token):
    """The certificate always names the token's node: an agent for gpu-1 cannot make the
    registry hand out its key as gpu-2's, whatever URL it gives."""
    r = certify(client, agent_token("gpu-1"), url="https://gpu-2.cluster:9470")
    assert r.status_code == 200, r.text
    assert verifier(client).verify_node_certificate(r.json()["certificate"]).node == "gpu-1"
    found = list_peers(client, agent_token("gpu-3"), ["gpu-2", "gpu-1"]).json()["peers"]
    assert [p["node"] for p in found] == ["gpu-1"]


def test_asking_again_replaces_the_entry_and_audits_new_keys_and_urls(client, agent_token, session):
    token = agent_token("gpu-1")
    key = new_key()
    first = certify(client, token, key=key).json()
    [entry] = session.scalars(select(AuditEntry).where(AuditEntry.action == "peer_register"))
    assert (entry.target_kind, entry.target, entry.outcome) == ("node", "gpu-1", "ok")
    assert entry.detail["url"] == URL
    assert entry.detail["public_key"] == key
    assert entry.detail["previous"] is None
    assert first["certificate"] not in str(entry.detail)
    registered_at = session.get(PeerRegistration, "gpu-1").registered_at

    renewed = certify(client, token, key=key)
    assert renewed.status_code == 200, renewed.text
    assert stored(session) == (1, 1)  # a plain renewal is not audited

    moved = certify(client, token, key=key, url="http://10.0.0.7:9470").json()
    assert stored(session) == (1, 2)
    last = session.scalars(
        select(AuditEntry).where(AuditEntry.action == "peer_register").order_by(AuditEntry.id)
    ).all()[-1]
    assert last.detail["previous"] == {"url": URL, "public_key": key}
    [peer] = list_peers(client, token, ["gpu-1"]).json()["peers"]
    assert (peer["url"], peer["certificate"]) == ("http://10.0.0.7:9470", moved["certificate"])
    row = session.get(PeerRegistration, "gpu-1")
    assert row.registered_at == registered_at
    assert row.updated_at > registered_at

    certify(client, token, url="http://10.0.0.7:9470")  # a new key
    assert stored(session) == (1, 3)


def test_the_lifetime_comes_from_the_setting(settings, make_token):
    app = create_app(settings.model_copy(update={"node_certificate_ttl_s": 600.0}))
    with TestClient(app) as client:
        out = certify(client, make_token("agent", "gpu-1")).json()
        cert = verifier(client).verify_node_certificate(out["certificate"])
        assert abs(cert.expires_at - time.time() - 600) < 60


@pytest.mark.parametrize("ttl_s", [299.0, 30 * 86400.0 + 1, 0.0])
def test_the_lifetime_setting_is_bounded(ttl_s):
    with pytest.raises(ValidationError, match="node_certificate_ttl_s"):
        Settings(node_certificate_ttl_s=ttl_s)


def test_the_lifetime_setting_reads_its_environment_variable(monkeypatch):
    monkeypatch.setenv("TIERWATCH_NODE_CERTIFICATE_TTL_S", "3600")
    assert Settings().node_certificate_ttl_s == 3600.0
    assert Settings.model_fields["node_certificate_ttl_s"].default == 86400.0


_KEY = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
_CANONICAL = b64url(_KEY)
# the same 32 bytes with the last character's 2 unused bits set: decodes alike, not canonical
_NONCANONICAL = (
    _CANONICAL[:-1]
    + "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"[
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_".index(_CANONICAL[-1]) | 1
    ]
)


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"public_key": b64url(_KEY[:31])}, "body.public_key", "32-byte Ed25519"),
        ({"public_key": b64url(_KEY + b"\0")}, "body.public_key", "got 44 character(s)"),
        ({"public_key": _CANONICAL + "="}, "body.public_key", "drop the '='"),
        ({"public_key": "+" + _CANONICAL[1:]}, "body.public_key", "A-Z a-z 0-9 - _"),
        ({"public_key": _NONCANONICAL}, "body.public_key", "not canonical"),
        ({"public_key": ""}, "body.public_key", "32-byte Ed25519"),
        ({"url": "ftp://gpu-1:9470"}, "body.url", "http:// or https://"),
        ({"url": "gpu-1:9470"}, "body.url", "http:// or https://"),
        ({"url": "http:/gpu-1:9470"}, "body.url", "http:// or https://"),
        ({"url": "http://"}, "body.url", "must name a host"),
        ({"url": "http://:9470"}, "body.url", "must name a host"),
        ({"url": "https://agent:secret@gpu-1:9470"}, "body.url", "user name or password"),
        ({"url": "https://gpu-1:9470/?token=x"}, "body.url", "query or fragment"),
        ({"url": "https://gpu-1:9470?"}, "body.url", "query or fragment"),
        ({"url": "https://gpu-1:9470#peer"}, "body.url", "query or fragment"),
        ({"url": "https://gpu-1:99999"}, "body.url", "port must be a number"),
        ({"url": "https://gpu-1:port"}, "body.url", "port must be a number"),
        ({"url": "https://gpu 1:9470"}, "body.url", "without spaces"),
        ({"url": "https://gpü-1:9470"}, "body.url", "xn-- form"),
        ({"url": "https://gpu-1/\r\nX: y"}, "body.url", "printable ASCII"),
        (
            {"url": "https://gpu-1/" + "a" * MAX_URL_CHARS},
            "body.url",
            f"at most {MAX_URL_CHARS} characters",
        ),
        ({"url": None}, "body.url", "valid string"),
        ({"extra": 1}, "body.extra", "Extra inputs are not permitted"),
    ],
)
def test_bad_input_is_refused_saying_what_to_fix_and_nothing_is_stored(
    client, agent_token, session, body, field, message
):
    full = {"public_key": _CANONICAL, "url": URL, **body}
    r = client.post(CERT, json=full, headers=auth(agent_token("gpu-1")))
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert any(e["field"] == field and message in e["message"] for e in errors), errors
    assert message in r.json()["detail"]
    assert stored(session) == (0, 0)


@pytest.mark.parametrize("missing", ["public_key", "url"])
def test_both_fields_are_required(client, agent_token, missing):
    body = {"public_key": _CANONICAL, "url": URL}
    del body[missing]
    r = client.post(CERT, json=body, headers=auth(agent_token("gpu-1")))
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == f"body.{missing}"


@pytest.mark.parametrize(
    "url",
    [
        "http://gpu-1:9470",
        "https://gpu-1.cluster.example",
        "http://10.0.0.7:9470",
        "http://[fd00::7]:9470",
        "https://gpu-1:9470/tierwatch",
        "HTTPS://GPU-1:9470",
    ],
)
def test_good_urls_are_certified_as_given(client, agent_token, url):
    r = certify(client, agent_token("gpu-1"), url=url)
    assert r.status_code == 200, r.text
    assert verifier(client).verify_node_certificate(r.json()["certificate"]).url == url


# --- peers ------------------------------------------------------------------------------------


def test_peers_lists_the_registered_nodes_in_the_order_asked(client, agent_token):
    made = {}
    for node in ("gpu-1", "gpu-2"):
        made[node] = certify(client, agent_token(node), url=f"http://{node}:9470").json()
    r = list_peers(client, agent_token("gpu-9"), ["gpu-3", "gpu-2", "gpu-1", "gpu-2"])
    assert r.status_code == 200, r.text
    found = r.json()["peers"]
    assert [p["node"] for p in found] == ["gpu-2", "gpu-1"]
    keys = verifier(client)
    for peer in found:
        assert peer == made[peer["node"]]
        cert = keys.verify_node_certificate(peer["certificate"])
        assert (cert.node, cert.url) == (peer["node"], f"http://{peer['node']}:9470")
    assert list_peers(client, agent_token("gpu-9"), ["gpu-3"]).json() == {"peers": []}


def test_an_expired_certificate_is_left_out(app, client, agent_token):
    with app.state.sessionmaker() as s:
        peers.certify_node(
            s,
            node="gpu-1",
            url=URL,
            public_key=new_key(),
            ttl_s=3600,
            actor="test",
            now=utcnow() - timedelta(hours=2),
        )
        s.commit()
    certify(client, agent_token("gpu-2"), url="http://gpu-2:9470")
    found = list_peers(client, agent_token("gpu-2"), ["gpu-1", "gpu-2"]).json()["peers"]
    assert [p["node"] for p in found] == ["gpu-2"]


def test_peers_takes_up_to_4096_nodes(client, agent_token):
    token = agent_token("gpu-1")
    certify(client, token)
    nodes = [f"gpu-{i}" for i in range(MAX_PEER_NODES)]
    r = list_peers(client, token, nodes)
    assert r.status_code == 200, r.text
    assert [p["node"] for p in r.json()["peers"]] == ["gpu-1"]
    r = list_peers(client, token, [*nodes, "gpu-extra"])
    assert r.status_code == 422, r.text
    assert "at most 4096" in r.json()["detail"]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, "Field required"),
        ({"node": ["gpu 1"]}, "node name must be"),
        ({"node": ["gpu-1", "-x"]}, "node name must be"),
        ({"node": ["x" * 129]}, "node name must be"),
    ],
)
def test_peers_refuses_bad_node_names(client, agent_token, params, message):
    r = client.get(PEERS, params=params, headers=auth(agent_token("gpu-1")))
    assert r.status_code == 422, r.text
    assert message in r.json()["detail"], r.text
    assert r.json()["errors"][0]["field"].startswith("query.node")


# --- jobs -------------------------------------------------------------------------------------


def test_an_agent_of_the_job_reads_its_nodes_pinned_layout_and_manifest_key(client, agent_token):
    layout = ["gpu-1", "gpu-1", "gpu-2", "gpu-2"]
    issued = register_job(client, JOB, ["gpu-1", "gpu-2", "gpu-3"], world_size=4, layout=layout)
    # the key the job's ranks sign with (derived from their credential's secret)
    key = b64url(manifest_key_of(issued["credential"]))
    for node in ("gpu-1", "gpu-3"):
        r = client.get(f"/api/v1/agent/jobs/{JOB}", headers=auth(agent_token(node)))
        assert r.status_code == 200, r.text
        assert r.json() == {
            "job_id": JOB,
            "nodes": ["gpu-1", "gpu-2", "gpu-3"],
            "world_size": 4,
            "layout": layout,
            "manifest_key": key,
        }
    other = register_job(client, "other-job", ["gpu-1"])
    r = client.get("/api/v1/agent/jobs/other-job", headers=auth(agent_token("gpu-1")))
    assert r.json()["manifest_key"] == b64url(manifest_key_of(other["credential"])) != key


def test_the_layout_is_null_until_rank_0_pins_it(client, agent_token):
    register_job(client, JOB, ["gpu-1", "gpu-2"])
    token = agent_token("gpu-1")
    r = client.get(f"/api/v1/agent/jobs/{JOB}", headers=auth(token))
    assert r.json() == {
        "job_id": JOB,
        "nodes": ["gpu-1", "gpu-2"],
        "world_size": None,
        "layout": None,
        "manifest_key": r.json()["manifest_key"],
    }
    post_batch(client, token, make_batch("gpu-1", 1))
    batch = ReportBatch(
        node="gpu-1",
        epoch="epoch-1",
        seq=2,
        sent_at=utcnow(),
        progress=[
            JobProgress(
                job_id=JOB, rank=0, world_size=2, step=5, ts=utcnow(), layout=["gpu-1", "gpu-2"]
            )
        ],
    )
    assert post_batch(client, token, batch).status_code == 200
    r = client.get(f"/api/v1/agent/jobs/{JOB}", headers=auth(token))
    assert (r.json()["layout"], r.json()["world_size"]) == (["gpu-1", "gpu-2"], 2)


def test_an_agent_outside_the_job_is_refused(client, agent_token):
    register_job(client, JOB, ["gpu-1", "gpu-2"], world_size=2, layout=["gpu-1", "gpu-2"])
    r = client.get(f"/api/v1/agent/jobs/{JOB}", headers=auth(agent_token("gpu-9")))
    assert r.status_code == 403, r.text
    detail = r.json()["detail"]
    assert "only the jobs that run on its node" in detail
    assert "gpu-2" not in detail  # the layout is not told to an outsider
    assert "manifest_key" not in r.text  # nor the job's key


def test_an_unknown_or_unregistered_job_is_404(client, agent_token, session):
    token = agent_token("gpu-1")
    r = client.get("/api/v1/agent/jobs/no-such-job", headers=auth(token))
    assert r.status_code == 404, r.text
    assert "not registered" in r.json()["detail"]
    now = utcnow()
    session.add(Job(job_id="seen-only", first_seen=now, last_seen=now))
    session.commit()
    assert client.get("/api/v1/agent/jobs/seen-only", headers=auth(token)).status_code == 404
    r = client.get("/api/v1/agent/jobs/-bad", headers=auth(token))
    assert r.status_code == 422, r.text


# --- migration 0007 ---------------------------------------------------------------------------


def test_0007_downgrades_and_upgrades(request, database_url, tmp_path_factory):
    backend = request.node.callspec.params["database_url"]
    with migrated_database(backend, tmp_path_factory) as url:
        engine = make_engine(url)
        assert "peer_registry" in inspect(engine).get_table_names()
        command.downgrade(alembic_config(url), "0006")
        engine.dispose()
        engine = make_engine(url)
        assert "peer_registry" not in inspect(engine).get_table_names()
        engine.dispose()
        upgrade(url)
        engine = make_engine(url)
        assert "peer_registry" in inspect(engine).get_table_names()
        engine.dispose()


# --- revocation -------------------------------------------------------------------------------


def test_revoking_the_agent_token_removes_the_entry_it_certified(client, agent_token, session):
    from tierwatch.server.tokens import lookup_token, revoke_token

    old, other = agent_token("gpu-1"), agent_token("gpu-2")
    assert certify(client, old).status_code == 200
    assert [p["node"] for p in list_peers(client, other, ["gpu-1"]).json()["peers"]] == ["gpu-1"]

    # the node's token is rotated: the new token certifies, then the old one is revoked
    new = agent_token("gpu-1")
    assert certify(client, new, url="https://gpu-1.cluster:9471").status_code == 200
    revoke_token(session, lookup_token(session, old).id)
    session.commit()
    peers = list_peers(client, other, ["gpu-1"]).json()["peers"]
    assert [(p["node"], p["url"]) for p in peers] == [("gpu-1", "https://gpu-1.cluster:9471")]

    # revoking the token that certified the entry removes it: no peer is handed it any more
    revoke_token(session, lookup_token(session, new).id)
    session.commit()
    assert list_peers(client, other, ["gpu-1"]).json()["peers"] == []
    assert stored(session)[0] == 0
    assert certify(client, new).status_code == 401  # and it cannot certify again
