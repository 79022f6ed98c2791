"""Property-based fuzzing of the REST API with schemathesis, from its own OpenAPI schema.

Every operation of ``/openapi.json`` is called in-process (ASGI, lifespan running, real
database with node n1 and job ``job-1`` seeded) with generated parameters and bodies: an
agent token for n1 on the agent endpoint, an admin token everywhere else. Checks: no 5xx
(``not_a_server_error``), the body matches the documented response schema
(``response_schema_conformance``), the status code is documented
(``status_code_conformance``) and so is the content type (``content_type_conformance``).

Bounded for ``make test``: ``TIERWATCH_FUZZ_EXAMPLES`` examples per operation (default 10),
derandomized (the same examples every run), no example database. Full runs (numbers in
docs/benchmarks.md, "API fuzzing"; ``TIERWATCH_FUZZ_REPORT=file`` appends a line per
operation)::

    TIERWATCH_FUZZ_EXAMPLES=200 .venv/bin/pytest tests/security/test_fuzz.py
    TIERWATCH_FUZZ_EXAMPLES=1000 TIERWATCH_FUZZ_CHECKS=5xx \
        .venv/bin/pytest tests/security/test_fuzz.py
"""

from __future__ import annotations

import os
import time

import pytest
import schemathesis
from fastapi.routing import iter_route_contexts
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from security_support import JOB, seed_cluster
from support import auth

from tierwatch.server.config import Settings
from tierwatch.server.main import create_app

FUZZ_EXAMPLES = int(os.environ.get("TIERWATCH_FUZZ_EXAMPLES", "10"))
# TIERWATCH_FUZZ_CHECKS=5xx: only not_a_server_error (to keep fuzzing an operation for
# server errors while it still fails a conformance check at its first example).
CHECKS = (
    [not_a_server_error]
    if os.environ.get("TIERWATCH_FUZZ_CHECKS") == "5xx"
    else [
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
        content_type_conformance,
    ]
)
AGENT_PATHS = {"/api/v1/ingest/report"}

# One backend (PostgreSQL when configured: the stricter one, where a NUL byte or an
# out-of-range integer is a database error): the generated inputs are the same on both,
# and the bad-input tests of tests/server/test_api_validation.py run on both backends.
pytestmark = [pytest.mark.slow, pytest.mark.one_backend]


def _operation_labels() -> list[str]:
    # The schema only (what GET /openapi.json serves), with no lifespan: create_app() opens
    # no connection and starts no thread until its lifespan runs. No app thread may run
    # here: CPython 3.11.7's AST validation keeps its recursion depth per interpreter, so
    # another thread parsing while schemathesis's modules are compiled (pytest rewrites
    # them) fails collection with "AST constructor recursion depth mismatch".
    app = create_app(Settings(database_url="sqlite:///:memory:", dev=True))
    schema = schemathesis.openapi.from_dict(app.openapi())
    return [result.ok().label for result in schema.get_all_operations()]


OPERATIONS = _operation_labels()


def _known_ids(case):  # type: ignore[no-untyped-def]
    """The case aimed at the seeded node and job, so the fuzzer gets past the 404s (and an
    agent report past the token's node check)."""
    for key, value in (("name", "n1"), ("job_id", JOB)):
        if case.path_parameters and key in case.path_parameters:
            case.path_parameters[key] = value
    if case.path in AGENT_PATHS and isinstance(case.body, dict):
        case.body["node"] = "n1"
    return case


@pytest.fixture
def fuzz_app(app, client, tokens):  # type: ignore[no-untyped-def]
    """A second app on the seeded database: schemathesis runs its lifespan itself and does
    not end it, so this app runs no background work (its leader lock would otherwise outlive
    the test and keep every later server on this database from leading)."""
    seed_cluster(client, tokens)
    return create_app(app.state.settings.model_copy(update={"background_tick_s": 0}))


@pytest.mark.parametrize("label", OPERATIONS)
def test_api_fuzz(fuzz_app, tokens, label):
    operation = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app).find_operation_by_label(
        label
    )
    assert operation is not None, label
    token = tokens["agent_n1"] if operation.path in AGENT_PATHS else tokens["admin"]
    positive = operation.as_strategy(GenerationMode.POSITIVE)
    strategy = st.one_of(
        positive, positive.map(_known_ids), operation.as_strategy(GenerationMode.NEGATIVE)
    )
    seen = []

    @given(case=strategy)
    @hypothesis_settings(
        max_examples=FUZZ_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case) -> None:  # type: ignore[no-untyped-def]
        seen.append(1)
        case.call_and_validate(headers=auth(token), checks=CHECKS)

    started = time.monotonic()
    outcome = "failed"
    try:
        fuzz()
        outcome = "passed"
    finally:
        # TIERWATCH_FUZZ_REPORT=path: one line per operation (label, examples, seconds,
        # outcome), for the numbers in docs/benchmarks.md.
        if os.environ.get("TIERWATCH_FUZZ_REPORT"):
            with open(os.environ["TIERWATCH_FUZZ_REPORT"], "a") as out:
                out.write(f"{label}\t{len(seen)}\t{time.monotonic() - started:.2f}\t{outcome}\n")


def test_schema_lists_every_api_route(fuzz_app):
    """The fuzzer covers what the schema lists: every /api/v1 route must be in it."""
    with TestClient(fuzz_app) as c:
        paths = c.get("/openapi.json").json()["paths"]
    api = {
        r.path for r in iter_route_contexts(fuzz_app.routes) if (r.path or "").startswith("/api/")
    }
    assert api <= paths.keys(), sorted(api - paths.keys())
    assert len(OPERATIONS) == sum(len(methods) for methods in paths.values())
