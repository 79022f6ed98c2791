"""Job registration and credentials: POST /api/v1/jobs/{job_id}/credential (who may, what
the body must hold), GET /api/v1/credentials/public-keys (a JWK set the agents' verifier
takes), the secret kept across registrations, the audit entry, and one signing key when two
server processes make it at once."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select
from support import auth

from tierwatch.agent.credentials import CredentialError, CredentialVerifier
from tierwatch.agent.protocol import utcnow
from tierwatch.server.actions.models import AuditEntry
from tierwatch.server.checkpoints.models import Job
from tierwatch.server.config import Settings
from tierwatch.server.credentials import service
from tierwatch.server.credentials.models import SigningKey
from tierwatch.server.main import create_app

JOB = "llm-70b"
BODY = {"nodes": ["gpu-1", "gpu-2"], "world_size": 4, "layout": ["gpu-1"] * 2 + ["gpu-2"] * 2}


def register(client, token, body=None, job=JOB):
    return client.post(
        f"/api/v1/jobs/{job}/credential", json=BODY if body is None else body, headers=auth(token)
    )


def verifier(client, headers=None) -> CredentialVerifier:
    r = client.get("/api/v1/credentials/public-keys", headers=headers or {})
    assert r.status_code == 200, r.text
    return CredentialVerifier.from_jwks(r.json())


@pytest.mark.parametrize(
    ("role", "status"),
    [("viewer", 403), ("agent", 403), ("operator", 200), ("admin", 200)],
)
def test_who_may_register_a_job(client, make_token, role, status):
    token = make_token(role, "gpu-1" if role == "agent" else None)
    r = register(client, token)
    assert r.status_code == status, r.text
    if status == 403:
        assert "operator" in r.json()["detail"]


def test_registering_needs_a_token(client):
    r = client.post(f"/api/v1/jobs/{JOB}/credential", json=BODY)
    assert r.status_code == 401


def test_the_credential_verifies_with_the_public_keys_and_names_the_job(
    client, make_token, session
):
    r = register(client, make_token("operator"))
    out = r.json()
    assert out["job_id"] == JOB
    assert out["nodes"] == ["gpu-1", "gpu-2"]
    assert out["world_size"] == 4
    assert r.headers["cache-control"] == "no-store"
    checked = verifier(client).verify_job(out["credential"])
    assert checked.job_id == JOB
    # default lifetime: TIERWATCH_JOB_CREDENTIAL_TTL_S, 30 days
    assert abs(checked.expires_at - checked.issued_at - 30 * 86400) <= 1
    assert abs(checked.expires_at - utcnow().timestamp() - 30 * 86400) < 60
    job = session.scalar(select(Job).where(Job.job_id == JOB))
    assert job.registered_nodes == ["gpu-1", "gpu-2"]
    assert job.layout == BODY["layout"]
    assert (job.world_size, job.registered_world_size) == (4, 4)
    assert job.credential_expires_at.timestamp() == checked.expires_at


def test_the_public_keys_need_no_token_and_ignore_any(client, make_token):
    anonymous = client.get("/api/v1/credentials/public-keys").json()
    [key] = anonymous["keys"]
    assert (key["kty"], key["crv"], key["alg"], key["use"]) == ("OKP", "Ed25519", "EdDSA", "sig")
    for headers in (auth(make_token("agent", "gpu-1")), auth("not-a-token")):
        assert client.get("/api/v1/credentials/public-keys", headers=headers).json() == anonymous


def test_a_credential_of_another_server_or_job_is_refused(client, make_token):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from tierwatch.agent.credentials import jwks

    operator = make_token("operator")
    credential = register(client, operator).json()["credential"]
    [kid] = verifier(client).keys
    impostor = CredentialVerifier.from_jwks(
        jwks([(kid, Ed25519PrivateKey.generate().public_key())])
    )
    with pytest.raises(CredentialError, match="refused"):
        impostor.verify_job(credential)
    # a credential whose secret was swapped for another job's does not verify either
    second = register(client, operator, job="other").json()["credential"]
    forged = credential.split("~")[0] + "~" + second.split("~")[1]
    with pytest.raises(CredentialError, match="secret does not match"):
        verifier(client).verify_job(forged)


def test_registering_again_keeps_the_secret_and_replaces_nodes_and_layout(
    client, make_token, session
):
    operator = make_token("operator")
    first = register(client, operator).json()
    second = register(client, operator, {"nodes": ["gpu-3"], "ttl_s": 3600}).json()
    keys = verifier(client)
    a, b = keys.verify_job(first["credential"]), keys.verify_job(second["credential"])
    assert a.manifest_key == b.manifest_key
    assert first["credential"] != second["credential"]
    assert abs(b.expires_at - b.issued_at - 3600) <= 1
    session.expire_all()
    job = session.scalar(select(Job).where(Job.job_id == JOB))
    assert job.registered_nodes == ["gpu-3"]
    assert job.layout is None
    assert job.registered_world_size is None
    assert job.world_size == 4  # kept, unpinned, until rank 0's first layout report
    # another job has another secret
    other = keys.verify_job(register(client, operator, job="other-job").json()["credential"])
    assert other.manifest_key != a.manifest_key


def test_registration_is_audited_without_the_credential(client, make_token, session):
    out = register(client, make_token("operator")).json()
    [entry] = session.scalars(select(AuditEntry).where(AuditEntry.action == "job_register"))
    assert (entry.target_kind, entry.target, entry.outcome) == ("job", JOB, "ok")
    assert entry.actor.startswith("token:")
    assert entry.detail["nodes"] == ["gpu-1", "gpu-2"]
    assert entry.detail["world_size"] == 4
    secret = out["credential"].split("~")[1]
    assert secret not in str(entry.detail)
    assert out["credential"].split("~")[0] not in str(entry.detail)


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"nodes": []}, "body.nodes", "at least 1"),
        ({"nodes": ["bad node"]}, "body.nodes.0", "node name must be"),
        ({"nodes": ["-x"]}, "body.nodes.0", "node name must be"),
        ({}, "body.nodes", "Field required"),
        (
            {"nodes": ["a", "b"], "world_size": 3, "layout": ["a", "b"]},
            "body",
            "layout names 2 node(s) but world_size is 3",
        ),
        (
            {"nodes": ["a"], "layout": ["a", "b"]},
            "body",
            "layout names node(s) b, which are not in nodes",
        ),
        ({"nodes": ["a"], "world_size": 0}, "body.world_size", "greater than or equal to 1"),
        ({"nodes": ["a"], "ttl_s": 59}, "body.ttl_s", "greater than or equal to 60"),
        ({"nodes": ["a"], "ttl_s": 366 * 86400 + 1}, "body.ttl_s", "less than or equal to"),
        ({"nodes": ["a"], "token": "x"}, "body.token", "Extra inputs are not permitted"),
    ],
)
def test_invalid_bodies_say_what_to_fix(client, make_token, body, field, message):
    r = register(client, make_token("operator"), body)
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert any(e["field"] == field and message in e["message"] for e in errors), errors


def test_an_invalid_job_id_is_refused(client, make_token):
    r = register(client, make_token("operator"), job="-bad")
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == "path.job_id"


def test_duplicate_nodes_are_dropped_in_order(client, make_token):
    out = register(client, make_token("operator"), {"nodes": ["b", "a", "b"]}).json()
    assert out["nodes"] == ["b", "a"]


def test_the_default_lifetime_is_a_setting(db_url, make_token):
    from fastapi.testclient import TestClient

    settings = Settings(database_url=db_url, dev=True, job_credential_ttl_s=120)
    with TestClient(create_app(settings)) as c:
        out = register(c, make_token("operator"), {"nodes": ["a"]}).json()
        checked = verifier(c).verify_job(out["credential"])
    assert abs(checked.expires_at - checked.issued_at - 120) <= 1


def test_two_processes_making_the_key_at_once_agree_on_one(app):
    """The second insert of the key row conflicts (fixed id) and reads the first's row."""
    factory = app.state.sessionmaker
    seen: dict[str, SigningKey] = {}
    # The first session holds the row's lock until it ends: it must end whatever happens,
    # or every later test of this worker that makes the key waits on it.
    with factory() as first:
        mine = service.signing_key(first)  # inserted, not committed yet

        def other() -> None:
            with factory() as s:
                seen["key"] = service.signing_key(s)  # waits for the first's transaction
                s.commit()

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(timeout=0.5)
        assert thread.is_alive()  # blocked on the row the first process holds
        first.commit()
        made = (mine.kid, mine.job_secret)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert (seen["key"].kid, seen["key"].job_secret) == made
    with factory() as s:
        assert len(list(s.scalars(select(SigningKey)))) == 1


def test_a_registered_job_without_reports_is_listed_and_shown(client, make_token, viewer):
    register(client, make_token("operator"))
    reader = auth(make_token("viewer"))
    [job] = client.get("/api/v1/jobs", headers=reader).json()
    assert (job["job_id"], job["step"], job["world_size"]) == (JOB, None, 4)
    one = client.get(f"/api/v1/jobs/{JOB}", headers=reader).json()
    assert one["layout"] == BODY["layout"]
    assert one["tiers"]["memory"]["newest_step"] is None
    assert viewer.get(f"/jobs/{JOB}").status_code == 200
    assert viewer.get("/").status_code == 200
