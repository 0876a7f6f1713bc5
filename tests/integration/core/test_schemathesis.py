"""Schemathesis against a live core: generated requests (valid and invalid) for every
operation of the published OpenAPI document, as an admin and as a user. No answer may be a
5xx, and every answer must be documented and match the document."""

from __future__ import annotations

import shutil
import tempfile
import unittest
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.core.control import SkipTest
from schemathesis.core.errors import InvalidHeadersExample
from schemathesis.core.failures import FailureGroup, as_reported_failure
from schemathesis.generation.feedback import FeedbackSources
from schemathesis.generation.hypothesis.builder import (
    InvalidHeadersExampleMark,
    MissingPathParameters,
    UnserializablePayloadMark,
)
from schemathesis.generation.hypothesis.reporting import ignore_hypothesis_output
from schemathesis.pytest._test_builder import build_operation_test
from schemathesis.python._constants.orchestrator import make_constants_value_source
from schemathesis.schemas import APIOperation, BaseSchema
from schemathesis.transport.requests import ManagedCookiesSession

from libs.common.embedded import EmbeddedPostgres
from libs.common.settings import libpq_url
from services.core.app import create_app
from services.core.settings import CoreSettings
from tests.support import Core, make_token, start_core

# Bounded: 13 operations, two principals; the whole file took 125 worker-seconds with 30
# examples an operation (2026-12-06), a sixteenth of the suite's: 20 (derandomized, the
# same each run) keep each operation's bounds and kinds of input covered.
FUZZ = settings(
    max_examples=20,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


@schemathesis.check
def errors_are_problem_documents(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> bool | None:
    """Every 4xx/5xx is application/problem+json with type, title, status and detail, and
    its status is the answer's; a 401 says how to authenticate. (The OpenAPI document lists
    application/problem+json with no schema, so the schema checks cannot see this.)"""
    if response.status_code < 400:
        return None
    content_type = response.headers.get("content-type", [""])[0]
    assert content_type.startswith("application/problem+json"), (
        f"{response.status_code} answered with content-type {content_type!r}"
    )
    body = response.json()
    assert isinstance(body, dict), f"problem is not an object: {body!r}"
    for key in ("type", "title", "detail"):
        assert isinstance(body.get(key), str) and body[key], f"problem lacks {key!r}: {body}"
    assert body.get("status") == response.status_code, f"problem status mismatch: {body}"
    if response.status_code == 401:
        assert "www-authenticate" in {k.lower() for k in response.headers}, (
            "401 lacks WWW-Authenticate"
        )
    return None


CHECKS = [
    schemathesis.checks.not_a_server_error,
    schemathesis.checks.status_code_conformance,
    schemathesis.checks.content_type_conformance,
    schemathesis.checks.response_schema_conformance,
    schemathesis.checks.response_headers_conformance,
    errors_are_problem_documents,
]

# A long poll on /v1/events may be held for up to 30 s; the fuzzer need not wait that long.
# 0.05 s still holds the poll (or a worker's claim) and answers it empty at its end: the
# code a longer wait runs, and the few dozen cases that ask for a wait wait a quarter as long.
MAX_WAIT_S = 0.05


@pytest.fixture(scope="module")
def live_core(pg_server: EmbeddedPostgres, template_db: str) -> Iterator[Core]:
    """One core over one fresh database for the whole module (the fuzzer's cases share it)."""
    name = "st_" + uuid.uuid4().hex[:16]
    admin_url = libpq_url(pg_server.url)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    db_url = pg_server.url.rsplit("/", 1)[0] + "/" + name
    home = Path(tempfile.mkdtemp(prefix="cairn-st-"))
    # The service controller would start the replicas of the services the fuzzer creates
    # (up to 1,000 each): not this test's subject. The promoter looks for due work at its
    # deployed default (every 1 s), not the tests' 0.05 s: nothing the fuzzer submits waits
    # on it, and 20 passes a second took an eighth of the server's time.
    # Its token cache at the deployed default (30 s), not the tests' 0: the two principals'
    # tokens are read from the database every 30 s, not on each of ~15,000 requests; a
    # token revoked through it is evicted at once, and the fuzzer never revokes its own.
    server = start_core(
        db_url, home, services_interval_s=300, promote_interval_s=1.0, token_cache_s=30.0
    )
    server.tokens["root"] = make_token(db_url, "root", "admin")
    server.tokens["alice"] = make_token(db_url, "alice", "user")
    with psycopg.connect(libpq_url(db_url)) as conn:
        server.own_token_ids = {row[0] for row in conn.execute("SELECT id FROM core.tokens")}  # type: ignore[attr-defined]
    # Something to read, cancel and retry: a few tasks of each principal.
    for who in ("root", "alice"):
        with server.client(who) as client:
            for i in range(3):
                answer = client.post(
                    "/v1/tasks",
                    json={
                        "name": f"seed-{i}",
                        "artifact": {"uri": "file:///bin/true", "sha256": "0" * 64},
                        "labels": {"team": "x"},
                    },
                )
                assert answer.status_code == 201, answer.text
    yield server
    server.stop()
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def sessions() -> Iterator[dict[str, ManagedCookiesSession]]:
    """One HTTP session a principal for the module's cases: each case's request goes over a
    kept-alive connection instead of a new one (a connect and a new session per case), and,
    as in schemathesis' own runner, the cookies an answer sets are dropped after it, so no
    case sends what an earlier one was given."""
    made = {who: ManagedCookiesSession() for who in ("root", "alice")}
    for session in made.values():
        # No proxy, .netrc or CA bundle from the environment for a core on loopback:
        # requests would otherwise read the environment (and stat ~/.netrc) per request.
        session.trust_env = False
    yield made
    for session in made.values():
        session.close()


def _published_document() -> dict[str, Any]:
    """The document core serves at /openapi.json, built from the app without a server.
    (``schemathesis.pytest.from_fixture`` would load it from the live server, but it breaks
    on pytest 9: it writes ``request.node._nodeid``, which pytest 9 no longer has.)"""
    config = CoreSettings(database_url="postgresql://cairn@127.0.0.1/unused")
    document: dict[str, Any] = create_app(config, config.database_url or "").openapi()
    return document


DOCUMENT = _published_document()
# A service's create and change embed a whole task template, which is fuzzed through POST
# /v1/tasks already: fewer examples of them, as one principal, keep the file's time.
TEMPLATED = {"method": ["POST", "PATCH"], "path_regex": r"^/v1/services(/\{name\})?$"}
schema = schemathesis.openapi.from_dict(DOCUMENT).exclude(**TEMPLATED)
# A change's fields are a create's (the same template, replicas and rollout models): its
# coverage phase sends their positive cases only (its negatives took 8-10 s more), the
# create's sends both.
CHANGE = {"method": "PATCH", "path_regex": r"^/v1/services/\{name\}$"}
templated = schemathesis.openapi.from_dict(DOCUMENT).include(**TEMPLATED).exclude(**CHANGE)
changed = schemathesis.openapi.from_dict(
    DOCUMENT,
    config=schemathesis.config.SchemathesisConfig.from_dict(
        {"phases": {"coverage": {"generation": {"mode": "positive"}}}}
    ),
).include(**CHANGE)
# The coverage phase's negative cases (each parameter and property of the wrong type, out
# of bounds, missing or unexpected; undeclared methods; wrong content types: 4,441 of the
# 6,477 cases it makes for these operations) are refused by the router (405), the body's
# parsing or pydantic's validation (400, 422), the same code whoever calls, once the
# caller's credentials are checked (401, 403, 404 for a worker not its own): the admin's
# run sends each of them. The user's run keeps the coverage phase's positive cases, which
# reach the handlers as a user, and the fuzzing phase's positive and negative cases, so a
# user's invalid requests are still sent. A batch's coverage cases are each a task's,
# which the user's single submission covers (its positive cases made for a list of them
# took 12-15 s of generation, the file's slowest test): the user's batch keeps the
# examples and fuzzing phases, the admin's all three.
as_user = schemathesis.openapi.from_dict(
    DOCUMENT,
    config=schemathesis.config.SchemathesisConfig.from_dict(
        {
            "phases": {"coverage": {"generation": {"mode": "positive"}}},
            "operations": [
                {
                    "include-path": "/v1/tasks/batch",
                    "include-method": "POST",
                    "phases": {"coverage": {"enabled": False}},
                }
            ],
        }
    ),
).exclude(**TEMPLATED)


def _operations(of: BaseSchema) -> dict[str, APIOperation]:
    """The schema's operations by label ("GET /v1/tasks"), each test's parameter."""
    return {result.ok().label: result.ok() for result in of.get_all_operations()}


# The operations are listed when the file is collected (about a second), but each one's
# test is built (its coverage phase's cases made: about 15 s of CPU for the three tests'
# 162) only when it runs, as schemathesis's own runner does: ``schema.parametrize()``
# built all of them while collecting, in each xdist worker, whichever ran them.
OPERATIONS = _operations(schema)
TEMPLATED_OPERATIONS = {
    label: (of, operation)
    for of in (templated, changed)
    for label, operation in _operations(of).items()
}
USER_OPERATIONS = _operations(as_user)


def _call(
    case: schemathesis.Case,
    core: Core,
    principal: str,
    sessions: dict[str, ManagedCookiesSession],
) -> None:
    # Revoking the fuzzer's own tokens would leave every later case a 401.
    revokes = case.method.upper() == "DELETE" and case.path == "/v1/tokens/{token_id}"
    params = case.path_parameters if isinstance(case.path_parameters, dict) else {}
    if revokes and params.get("token_id") in core.own_token_ids:  # type: ignore[attr-defined]
        params["token_id"] = 2**40
    # Disabling the fuzzer's own principals would too (an admin disabling itself is a 409).
    disables = case.method.upper() == "POST" and case.path == "/v1/principals/{name}/disable"
    if disables and params.get("name") in core.tokens:
        params["name"] = "someone-who-left"
    if case.path == "/v1/events" and isinstance(case.query, dict):
        wait = case.query.get("wait")
        if isinstance(wait, int | float) and not isinstance(wait, bool) and wait > MAX_WAIT_S:
            case.query["wait"] = MAX_WAIT_S
    # A followed log streams until its attempt ends; the seeded tasks never start.
    if case.path == "/v1/tasks/{task_id}/logs" and isinstance(case.query, dict):
        case.query.pop("follow", None)
    # The same for a worker's claim, whose wait is in its body.
    if isinstance(case.body, dict):
        wait = case.body.get("wait")
        if isinstance(wait, int | float) and not isinstance(wait, bool) and wait > MAX_WAIT_S:
            case.body["wait"] = MAX_WAIT_S
    case.call_and_validate(
        base_url=core.url,
        session=sessions[principal],
        headers={"Authorization": f"Bearer {core.tokens[principal]}"},
        checks=CHECKS,
        timeout=15,
    )


def test_openapi_document_is_valid(live_core: Core) -> None:
    live = schemathesis.openapi.from_url(live_core.url + "/openapi.json", timeout=10)
    live.validate()  # against the OpenAPI 3.1 meta-schema
    assert live.raw_schema == DOCUMENT
    operations = [result.ok() for result in live.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} >= {
        ("POST", "/v1/tasks"),
        ("POST", "/v1/tasks/batch"),
        ("GET", "/v1/tasks"),
        ("GET", "/v1/tasks/{task_id}"),
        ("GET", "/v1/events"),
        ("POST", "/v1/queues/{name}/pause"),
    }


def test_error_answers_are_documented_as_problem_json_with_a_schema() -> None:
    """Core answers every error as application/problem+json; the document must say so with
    the Problem schema, or generated clients and the schema checks cannot read them."""
    missing = []
    for path, operations in DOCUMENT["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                if not status.startswith(("4", "5")) or path in ("/healthz", "/readyz"):
                    continue
                content = response.get("content", {})
                shape = content.get("application/problem+json", {}).get("schema", {})
                ref = shape.get("$ref", "")
                name = ref.removeprefix("#/components/schemas/")
                if not shape or (ref and name not in DOCUMENT["components"]["schemas"]):
                    missing.append(f"{method.upper()} {path} {status}")
    assert not missing, f"{len(missing)} error answers lack a problem+json schema: {missing[:5]}"


def _fuzz(
    test: str,
    of: BaseSchema,
    operation: APIOperation,
    fuzz: settings,
    core: Core,
    principal: str,
    sessions: dict[str, ManagedCookiesSession],
) -> None:
    """The operation's cases (examples, coverage and fuzzing phases, as
    ``schema.parametrize()`` makes them) sent as ``principal`` and checked."""

    def send(case: schemathesis.Case) -> None:
        _call(case, core, principal, sessions)

    # Derandomized, hypothesis seeds each test from its function: one seed a test, as when
    # each was its own function.
    send._hypothesis_internal_add_digest = test.encode()  # type: ignore[attr-defined]
    run = build_operation_test(
        config=of.config,
        operation=operation,
        test_func=send,
        given_kwargs={},
        feedback=FeedbackSources(constants_value_source=make_constants_value_source(of)),
        explicit_settings=fuzz,
    )
    # What schemathesis's pytest plugin does around a test of its own making: a failure
    # reported with its cases' reproductions; no case made, or part of the operation left
    # untested for its schema, fails the test (the plugin failed or skipped it; none does).
    try:
        with ignore_hypothesis_output():
            run()
    except FailureGroup as exc:
        raise as_reported_failure(exc) from None
    except (SkipTest, unittest.SkipTest) as exc:
        pytest.fail(f"{operation.label}: no cases made: {exc}")
    missing = MissingPathParameters.get(run)
    if missing:
        raise missing
    headers = InvalidHeadersExampleMark.get(run)
    if headers is not None:
        raise InvalidHeadersExample.from_headers(headers)
    unserializable = UnserializablePayloadMark.get(run)
    assert unserializable is None, f"{operation.label}: payloads left unsent: {unserializable}"


@pytest.mark.parametrize("label", list(OPERATIONS))
def test_admin_gets_no_server_error_and_conforming_answers(
    label: str, live_core: Core, sessions: dict[str, ManagedCookiesSession]
) -> None:
    _fuzz("admin", schema, OPERATIONS[label], FUZZ, live_core, "root", sessions)


@pytest.mark.parametrize("label", list(USER_OPERATIONS))
def test_user_gets_no_server_error_and_conforming_answers(
    label: str, live_core: Core, sessions: dict[str, ManagedCookiesSession]
) -> None:
    _fuzz("user", as_user, USER_OPERATIONS[label], FUZZ, live_core, "alice", sessions)


@pytest.mark.parametrize("label", list(TEMPLATED_OPERATIONS))
def test_service_templates_get_no_server_error_and_conforming_answers(
    label: str, live_core: Core, sessions: dict[str, ManagedCookiesSession]
) -> None:
    fuzz = settings(FUZZ, max_examples=8)
    of, operation = TEMPLATED_OPERATIONS[label]
    _fuzz("templates", of, operation, fuzz, live_core, "alice", sessions)
