"""Manifest signatures and SHA-256 digests (no torch), and the rank's verifier."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
from agent_helpers import AUTHORITY

from tierwatch.agent.checkpoint.format.agreement import StepView
from tierwatch.agent.checkpoint.format.manifest import (
    canonical_bytes,
    digest_file,
    mac_problem,
    make_manifest,
    read_manifest,
    xxh3_file,
)
from tierwatch.agent.checkpoint.training.verify import StepVerifier
from tierwatch.agent.credentials import CredentialError, CredentialVerifier, manifest_key_of

KEY = manifest_key_of(AUTHORITY.job_credential("sign-job"))


def write_step(d: Path, key: bytes | None = KEY):
    (d / ".metadata").write_bytes(b"metadata bytes")
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 40000)
    return make_manifest(
        job_id="sign-job",
        step=3,
        rank=0,
        world_size=1,
        node="n1",
        directory=d,
        names=[".metadata", "__0_0.distcp"],
        signature="sig",
        created_at="2026-01-01T00:00:00+00:00",
        fences=[(2, 1)],
        save_id="0" * 32,
        key=key,
    )


def test_manifest_key_of_is_the_verified_credentials_key() -> None:
    credential = AUTHORITY.job_credential("sign-job")
    checked = CredentialVerifier.from_jwks(AUTHORITY.jwks()).verify_job(credential)
    assert manifest_key_of(credential) == checked.manifest_key
    assert manifest_key_of(AUTHORITY.job_credential("sign-job", ttl_s=60.0)) == KEY
    assert manifest_key_of(AUTHORITY.job_credential("another-job")) != KEY
    for bad in ("no separator", "a~b~c", "statement~" + "A" * 10):
        with pytest.raises(CredentialError):
            manifest_key_of(bad)


def test_digests_are_computed_in_one_read_with_xxh3(tmp_path: Path) -> None:
    m = write_step(tmp_path)
    for f in m.files:
        data = (tmp_path / f.name).read_bytes()
        assert f.sha256 == hashlib.sha256(data).hexdigest()
        assert (f.size, f.xxh3) == xxh3_file(tmp_path / f.name)
        assert digest_file(tmp_path / f.name) == (f.size, f.xxh3, f.sha256)


def test_a_signature_survives_json_and_covers_every_field(tmp_path: Path) -> None:
    m = write_step(tmp_path)
    assert m.mac
    again = read_manifest(m.model_dump_json())  # as the agent carries it
    assert mac_problem(again, KEY) is None
    assert b'"mac"' not in canonical_bytes(again)
    for change in (
        {"step": 4},
        {"job_id": "other"},
        {"fences": []},
        {"files": [m.files[0].model_copy(update={"sha256": "0" * 64}), m.files[1]]},
    ):
        problem = mac_problem(again.model_copy(update=change), KEY)
        assert problem is not None
        assert "signature" in problem
        assert "step" in problem
    other = manifest_key_of(AUTHORITY.job_credential("another-job"))
    assert "signature does not match" in (mac_problem(again, other) or "")
    unsigned = write_step(tmp_path, key=None)
    assert unsigned.mac == ""
    assert "unsigned" in (mac_problem(unsigned, KEY) or "")


def test_the_verifier_checks_signatures_and_digests(tmp_path: Path) -> None:
    m = write_step(tmp_path)
    view = StepView(step=3, manifests={0: m})
    verifier = StepVerifier(KEY)
    assert verifier.manifests_problem(view) is None
    names = [".metadata", "__0_0.distcp"]
    assert verifier.files_problem(view, tmp_path, names) is None
    data = bytearray((tmp_path / "__0_0.distcp").read_bytes())
    data[7] ^= 1
    (tmp_path / "__0_0.distcp").write_bytes(bytes(data))
    problem = verifier.files_problem(view, tmp_path, names)
    assert problem is not None
    assert "step 3: __0_0.distcp" in problem
    assert "digest" in problem
    assert "listed by no manifest" in (verifier.files_problem(view, tmp_path, ["x"]) or "")
    (tmp_path / "link").symlink_to(tmp_path / ".metadata")
    entry = m.files[0].model_copy(update={"name": "link"})
    linked = StepView(step=3, manifests={0: m.model_copy(update={"files": [entry]})})
    assert "cannot be read" in (verifier.files_problem(linked, tmp_path, ["link"]) or "")


def test_without_a_key_nothing_is_refused_for_lacking_a_signature(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    unsigned = write_step(tmp_path, key=None)
    view = StepView(step=3, manifests={0: unsigned})
    assert StepVerifier(KEY).manifests_problem(view) is not None
    verifier = StepVerifier(None)
    with caplog.at_level(logging.WARNING):
        assert verifier.manifests_problem(view) is None
        assert verifier.manifests_problem(view) is None
    assert len([r for r in caplog.records if "not checked for a signature" in r.message]) == 1
    # digests a manifest lists are still checked; an entry without one is let through
    assert verifier.files_problem(view, tmp_path, [".metadata"]) is None
    (tmp_path / ".metadata").write_bytes(b"changed bytes!")
    assert "digest" in (verifier.files_problem(view, tmp_path, [".metadata"]) or "")
    legacy = unsigned.model_copy(
        update={"files": [f.model_copy(update={"sha256": ""}) for f in unsigned.files]}
    )
    legacy_view = StepView(step=3, manifests={0: legacy})
    assert verifier.files_problem(legacy_view, tmp_path, [".metadata"]) is None
    assert "no SHA-256" in (
        StepVerifier(KEY).files_problem(legacy_view, tmp_path, [".metadata"]) or ""
    )


def test_commit_markers_are_signed_over_every_field_and_never_pass_for_a_manifest() -> None:
    from tierwatch.agent.checkpoint.format.manifest import (
        CommitMarker,
        read_commit,
        sign_commit,
        sign_manifest,
    )

    assert AUTHORITY.manifest_key("sign-job") == KEY  # what the server gives the job's agents
    marker = CommitMarker(
        job_id="sign-job",
        step=3,
        rank=0,
        world_size=1,
        persist=True,
        retain={"memory": [3], "peer": [3], "persistent": [1, 3]},
        layout=["n1"],
        save_id="0" * 32,
    )
    signed = read_commit(sign_commit(marker, KEY).model_dump_json())
    assert mac_problem(signed, KEY) is None
    unsigned = mac_problem(marker, KEY)
    assert unsigned is not None
    assert "step 3: commit-0.json is unsigned" in unsigned
    for change in (
        {"retain": {"memory": [3], "peer": [3], "persistent": [3]}},
        {"persist": False},
        {"layout": ["n2"]},
        {"step": 4},
    ):
        problem = mac_problem(signed.model_copy(update=change), KEY)
        assert problem is not None
        assert "signature does not match" in problem
    assert mac_problem(signed, manifest_key_of(AUTHORITY.job_credential("other"))) is not None
    # the same key signs manifests: a manifest's signature is no marker's
    assert (
        sign_commit(marker, KEY).mac
        != sign_manifest(
            make_manifest(
                job_id="sign-job",
                step=3,
                rank=0,
                world_size=1,
                node="n1",
                directory=Path("."),
                names=[],
                signature="",
                created_at="",
            ),
            KEY,
        ).mac
    )
    assert canonical_bytes(marker).startswith(b"tierwatch commit marker\n")
