"""Bad input is refused with a clear 4xx problem+json that names the field and the reason,
never a 500, and a refused submission stores nothing."""

from __future__ import annotations

import gzip
import json
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from libs.common.embedded import EmbeddedPostgres
from libs.common.settings import libpq_url
from tests.support import TRUE_SHA, Core, spec, start_core

PROBLEM_JSON = "application/problem+json"
MAX_BODY = 8 * 1024 * 1024
HUGE_ID = "99999999999999999999"  # over 2**63 - 1


def tasks_in(db: psycopg.Connection[tuple[Any, ...]]) -> int:
    row = db.execute("SELECT count(*) FROM core.tasks").fetchone()
    assert row is not None
    return int(row[0])


def problem(answer: httpx.Response, status: int, *fields: str) -> dict[str, Any]:
    """Assert ``answer`` is a ``status`` problem+json document naming each of ``fields``
    (in its detail or its ``errors``) with a reason; return the document."""
    assert answer.status_code == status, f"{answer.status_code}: {answer.text[:500]}"
    content_type = answer.headers.get("content-type", "")
    assert content_type.startswith(PROBLEM_JSON), content_type
    body = answer.json()
    assert body["status"] == status
    for key in ("type", "title", "detail"):
        assert isinstance(body.get(key), str) and body[key], body
    named = [body["detail"]]
    for error in body.get("errors") or []:
        assert error.get("reason"), body
        named.append(f"{error['field']}: {error['reason']}")
    for field in fields:
        assert any(field in text for text in named), f"{field!r} not named in {body}"
    return dict(body)


@pytest.fixture
def alice(core: Core) -> Iterator[httpx.Client]:
    with core.client("alice", "user") as client:
        yield client


@dataclass
class Shared:
    user: httpx.Client
    admin: httpx.Client
    db: psycopg.Connection[tuple[Any, ...]]


@pytest.fixture(scope="module")
def shared(pg_server: EmbeddedPostgres, template_db: str) -> Iterator[Shared]:
    """One core over one database for the many table-driven refusals below: a server per
    case would cost a second each. Each case checks the task count did not move."""
    name = "bi_" + uuid.uuid4().hex[:16]
    admin_url = libpq_url(pg_server.url)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    home = Path(tempfile.mkdtemp(prefix="cairn-bi-"))
    db_url = pg_server.url.rsplit("/", 1)[0] + "/" + name
    server = start_core(db_url, home)
    with (
        server.client("bob", "user") as user,
        server.client("root", "admin") as admin,
        psycopg.connect(libpq_url(db_url), autocommit=True) as db,
    ):
        yield Shared(user, admin, db)
    server.stop()
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    shutil.rmtree(home, ignore_errors=True)


# --- one submission ----------------------------------------------------------------------


def _raw(**numbers: dict[str, str]) -> bytes:
    """A submission as raw JSON whose ``numbers`` are spelled as given (e.g. NaN)."""
    body = spec()
    text = httpx.Request("POST", "/", json=body).read().decode()[:-1]
    for key, fields in numbers.items():
        inner = ", ".join(f'"{name}": {value}' for name, value in fields.items())
        text += f', "{key}": {{{inner}}}'
    return (text + "}").encode()


BAD_SUBMISSIONS: dict[str, tuple[dict[str, Any] | bytes, str, str]] = {
    # id: (body, field that must be named, words the reason must contain)
    "owner-set-by-hand": (spec(owner="mallory"), "owner", "not permitted"),
    "state-set-by-hand": (spec(state="succeeded"), "state", "not permitted"),
    "attempts-set-by-hand": (spec(attempts=0), "attempts", "not permitted"),
    "unknown-nested-field": (
        spec(artifact={"uri": "file:///bin/true", "sha256": TRUE_SHA, "size": 1}),
        "artifact.size",
        "not permitted",
    ),
    "name-missing": ({"artifact": spec()["artifact"]}, "name", "required"),
    "artifact-missing": ({"name": "x"}, "artifact", "required"),
    "name-not-a-string": (spec(name=123), "name", "string"),
    "args-not-a-list": (spec(args="ls -l"), "args", "list"),
    "arg-not-a-string": (spec(args=[1]), "args.0", "string"),
    "env-not-a-map": (spec(env=["A=1"]), "env", "dictionary"),
    "priority-not-an-int": (spec(priority="high"), "priority", "integer"),
    "priority-fractional": (spec(priority=1.5), "priority", "integer"),
    "preemptible-not-a-bool": (spec(preemptible="maybe"), "preemptible", "boolean"),
    "resources-not-an-object": (spec(resources=4), "resources", ""),
    "name-empty": (spec(name=""), "name", "at least 1"),
    "name-over-200": (spec(name="n" * 201), "name", "at most 200"),
    "name-with-newline": (spec(name="a\nb"), "name", "pattern"),
    "args-over-256": (spec(args=["a"] * 257), "args", "at most 256"),
    "arg-over-8192": (spec(args=["a" * 8193]), "args.0", "at most 8192"),
    "env-over-128": (spec(env={f"K{i}": "v" for i in range(129)}), "env", "at most 128"),
    "env-bad-name": (spec(env={"1BAD": "v"}), "env.1BAD", "pattern"),
    "labels-over-32": (spec(labels={f"k{i}": "v" for i in range(33)}), "labels", "at most 32"),
    "label-key-bad": (spec(labels={"-x": "v"}), "labels.-x", "pattern"),
    "sha256-short": (spec(artifact={"uri": "file:///bin/true", "sha256": "abc"}), "sha256", ""),
    "sha256-uppercase": (
        spec(artifact={"uri": "file:///bin/true", "sha256": TRUE_SHA.upper()}),
        "artifact.sha256",
        "pattern",
    ),
    "uri-ftp-scheme": (
        spec(artifact={"uri": "ftp://host/bin/true", "sha256": TRUE_SHA}),
        "artifact.uri",
        "pattern",
    ),
    "uri-no-slashes": (
        spec(artifact={"uri": "file:/bin/true", "sha256": TRUE_SHA}),
        "artifact.uri",
        "",
    ),
    "uri-http-scheme": (
        spec(artifact={"uri": "http://host/bin/true", "sha256": TRUE_SHA}),
        "artifact.uri",
        "pattern",
    ),
    "reserved-env-name": (spec(env={"CAIRN_TOKEN": "x"}), "env", "CAIRN_"),
    "naive-run-at": (spec(run_at="2030-01-01T00:00:00"), "run_at", "timezone"),
    "run-at-not-a-date": (spec(run_at="tomorrow"), "run_at", ""),
    "priority-over-100": (spec(priority=101), "priority", "less than or equal to 100"),
    "priority-under-minus-100": (spec(priority=-101), "priority", "greater than or equal"),
    "queue-bad-name": (spec(queue="Not A Queue"), "queue", "pattern"),
    "kind-unknown": (spec(kind="daemon"), "kind", ""),
    "timeout-zero": (spec(timeout_s=0), "timeout_s", "greater than or equal to 1"),
    "retry-attempts-zero": (spec(retry={"max_attempts": 0}), "retry.max_attempts", ""),
    "memory-huge-int": (spec(resources={"memory_mb": 10**30}), "resources.memory_mb", ""),
    "cpu-zero": (spec(resources={"cpu": 0}), "resources.cpu", "greater than 0"),
    # Python's json reads the non-standard NaN and Infinity; they must not get through.
    "cpu-nan": (_raw(resources={"cpu": "NaN"}), "resources.cpu", ""),
    "backoff-infinite": (_raw(retry={"base_s": "Infinity"}), "retry.base_s", ""),
    "run-at-before-year-1-in-utc": (spec(run_at="0001-01-01T00:00:00+01:00"), "run_at", ""),
    "idempotency-key-empty": (spec(idempotency_key=""), "idempotency_key", ""),
    # Values Python accepts but PostgreSQL cannot store: they must be refused up front,
    # not reach the database and come back as a 500.
    "uri-with-nul": (
        spec(artifact={"uri": "file:///bin/tr\x00ue", "sha256": TRUE_SHA}),
        "artifact.uri",
        "",
    ),
    "run-at-offset-beyond-postgres": (spec(run_at="2030-01-01T00:00:00-18:01"), "run_at", ""),
}


@pytest.mark.parametrize(
    ("body", "field", "reason"),
    list(BAD_SUBMISSIONS.values()),
    ids=list(BAD_SUBMISSIONS),
)
def test_a_bad_submission_is_a_422_naming_the_field(
    shared: Shared, body: Any, field: str, reason: str
) -> None:
    before = tasks_in(shared.db)
    if isinstance(body, bytes):
        answer = shared.user.post(
            "/v1/tasks", content=body, headers={"content-type": "application/json"}
        )
    else:
        answer = shared.user.post("/v1/tasks", json=body)
    found = problem(answer, 422, field)
    if reason:
        assert reason.lower() in str(found).lower(), found
    assert found["type"].endswith("/invalid-input")
    assert tasks_in(shared.db) == before


@pytest.mark.parametrize(
    "raw",
    [
        b'{"name": "x", "artifact": ',  # cut short
        b"{'name': 'x'}",  # not JSON
        b'{"name": "x",}',
        b"",
    ],
    ids=["truncated", "single-quotes", "trailing-comma", "empty"],
)
def test_invalid_json_is_a_422(shared: Shared, raw: bytes) -> None:
    before = tasks_in(shared.db)
    answer = shared.user.post(
        "/v1/tasks", content=raw, headers={"content-type": "application/json"}
    )
    found = problem(answer, 422, "body")
    assert found["type"].endswith("/invalid-input")
    assert tasks_in(shared.db) == before


@pytest.mark.parametrize(
    "raw",
    [b"[1, 2]", b'"a task"', b"42", b"null", b"true"],
    ids=["array", "string", "number", "null", "bool"],
)
def test_json_that_is_not_an_object_is_a_422(shared: Shared, raw: bytes) -> None:
    before = tasks_in(shared.db)
    answer = shared.user.post(
        "/v1/tasks", content=raw, headers={"content-type": "application/json"}
    )
    problem(answer, 422, "body")
    assert tasks_in(shared.db) == before


def test_a_body_that_is_not_utf8_is_a_422(shared: Shared) -> None:
    """Found by schemathesis: FastAPI raises a bare 400 for an undecodable body, which core
    turns into an undocumented 400 of type .../internal."""
    raw = b'{"name": "\xff\xfe", "artifact": {}}'
    before = tasks_in(shared.db)
    answer = shared.user.post(
        "/v1/tasks", content=raw, headers={"content-type": "application/json"}
    )
    found = problem(answer, 422, "body")
    assert found["type"].endswith("/invalid-input")
    assert tasks_in(shared.db) == before


def test_a_lone_surrogate_is_refused_not_a_500(shared: Shared) -> None:
    """JSON may spell a lone UTF-16 surrogate ("\\ud800"); Python keeps it, PostgreSQL's
    jsonb cannot."""
    raw = (
        b'{"name": "x\\ud800", "artifact": {"uri": "file:///bin/true", "sha256": "'
        + TRUE_SHA.encode()
        + b'"}}'
    )
    before = tasks_in(shared.db)
    answer = shared.user.post(
        "/v1/tasks", content=raw, headers={"content-type": "application/json"}
    )
    problem(answer, 422, "name")
    assert tasks_in(shared.db) == before


def test_a_body_with_another_content_type_is_refused_not_a_500(shared: Shared) -> None:
    before = tasks_in(shared.db)
    answer = shared.user.post(
        "/v1/tasks", content=b"name=x", headers={"content-type": "text/plain"}
    )
    assert 400 <= answer.status_code < 500, answer.text
    assert answer.headers["content-type"].startswith(PROBLEM_JSON)
    assert tasks_in(shared.db) == before


@pytest.mark.parametrize("coding", ["gzip", "br", "deflate, gzip"])
def test_a_coded_body_is_a_415_naming_the_coding_not_a_422(shared: Shared, coding: str) -> None:
    """No service decodes a coded body: it was read as JSON and refused as malformed."""
    before = tasks_in(shared.db)
    answer = shared.user.post(
        "/v1/tasks",
        content=gzip.compress(json.dumps(spec()).encode()),
        headers={"content-type": "application/json", "content-encoding": coding},
    )
    found = problem(answer, 415, "header.Content-Encoding", repr(coding))
    assert found["type"] == "about:blank"
    assert answer.headers["accept-encoding"] == "identity"
    assert tasks_in(shared.db) == before
    plain = shared.user.post("/v1/tasks", json=spec(), headers={"content-encoding": "identity"})
    assert plain.status_code == 201, plain.text


# --- batches -----------------------------------------------------------------------------


def test_a_batch_of_1001_is_a_422_and_stores_none(
    alice: httpx.Client, db: psycopg.Connection[tuple[Any, ...]]
) -> None:
    answer = alice.post("/v1/tasks/batch", json={"tasks": [spec()] * 1001})
    problem(answer, 422, "tasks", "at most 1000")
    assert tasks_in(db) == 0


def test_an_empty_batch_is_a_422(
    alice: httpx.Client, db: psycopg.Connection[tuple[Any, ...]]
) -> None:
    problem(alice.post("/v1/tasks/batch", json={"tasks": []}), 422, "tasks", "at least 1")
    problem(alice.post("/v1/tasks/batch", json={}), 422, "tasks", "required")
    problem(alice.post("/v1/tasks/batch", json=[spec()]), 422, "body")
    assert tasks_in(db) == 0


def test_one_bad_task_refuses_the_whole_batch_naming_its_index(
    alice: httpx.Client, db: psycopg.Connection[tuple[Any, ...]]
) -> None:
    tasks = [spec() for _ in range(10)]
    tasks[7] = spec(priority=500)
    answer = alice.post("/v1/tasks/batch", json={"tasks": tasks})
    problem(answer, 422, "tasks.7.priority")
    assert tasks_in(db) == 0


def test_a_batch_with_an_unknown_field_is_a_422(
    alice: httpx.Client, db: psycopg.Connection[tuple[Any, ...]]
) -> None:
    answer = alice.post("/v1/tasks/batch", json={"tasks": [spec()], "owner": "mallory"})
    problem(answer, 422, "owner", "not permitted")
    assert tasks_in(db) == 0


# --- size limit --------------------------------------------------------------------------


def _oversize_body() -> bytes:
    filler = "a" * 8000
    args = [filler] * (MAX_BODY // 8000 + 16)  # over the limit; the model would refuse too
    return httpx.Request("POST", "/", json=spec(args=args)).read()


def test_a_body_over_the_limit_with_content_length_is_a_413(
    alice: httpx.Client, db: psycopg.Connection[tuple[Any, ...]]
) -> None:
    body = _oversize_body()
    assert len(body) > MAX_BODY
    answer = alice.post("/v1/tasks", content=body, headers={"content-type": "application/json"})
    found = problem(answer, 413)
    assert found["type"].endswith("/payload-too-large")
    assert tasks_in(db) == 0


def test_a_content_length_over_the_limit_is_a_413_before_the_body_is_read(core: Core) -> None:
    """The header alone is enough: core answers without waiting for 8 MiB it will not read."""
    import socket

    host, port = core.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {MAX_BODY + 1}\r\n\r\n".encode()
            + b'{"name": '
        )
        head = sock.recv(65536).decode("latin-1")
    assert head.startswith("HTTP/1.1 413"), head[:200]
    assert PROBLEM_JSON in head


@pytest.mark.parametrize("path", ["/v1/tasks", "/v1/tasks/batch"])
def test_a_caller_gone_mid_body_is_let_go_without_a_traceback(
    core: Core,
    alice: httpx.Client,
    db: psycopg.Connection[tuple[Any, ...]],
    caplog: pytest.LogCaptureFixture,
    path: str,
) -> None:
    """A client that sends half its body and goes (a killed agent, a cut network, the
    cron leader killed mid-batch): starlette's ClientDisconnect reached uvicorn, which
    logged it as an exception in the application, from the hot paths' own reads
    (``deps.PlainRoute``) and from every endpoint that reads its body itself (the batch);
    ``problems.install`` lets it go (an agent's turn goes the same way); nothing is
    done."""
    import socket

    host, port = core.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: {alice.headers['Authorization']}\r\n"
            "Content-Length: 200\r\n\r\n".encode()
            + b'{"name": "half'
        )
    assert alice.get("/v1/tasks").status_code == 200  # served on, after the one that went
    time.sleep(0.2)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert tasks_in(db) == 0


def test_a_chunked_body_over_the_limit_is_a_413(
    alice: httpx.Client, db: psycopg.Connection[tuple[Any, ...]]
) -> None:
    body = _oversize_body()

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(body), 64 * 1024):
            yield body[start : start + 64 * 1024]

    try:
        answer = alice.post(
            "/v1/tasks", content=chunks(), headers={"content-type": "application/json"}
        )
    except httpx.WriteError:
        pytest.fail("core closed the connection instead of answering 413")
    assert "content-length" not in answer.request.headers
    assert answer.request.headers["transfer-encoding"] == "chunked"
    found = problem(answer, 413)
    assert found["type"].endswith("/payload-too-large")
    assert tasks_in(db) == 0


def test_a_body_just_under_the_limit_is_judged_on_its_content(
    alice: httpx.Client, db: psycopg.Connection[tuple[Any, ...]]
) -> None:
    """Under the limit the model decides: 256 args of 8,192 characters is 2 MiB, valid."""
    answer = alice.post("/v1/tasks", json=spec(args=["a" * 8192] * 256))
    assert answer.status_code == 201, answer.text[:300]
    assert tasks_in(db) == 1


# --- ids in paths ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "template"),
    [
        ("GET", "/v1/tasks/{}"),
        ("POST", "/v1/tasks/{}/cancel"),
        ("POST", "/v1/tasks/{}/retry"),
        ("GET", "/v1/tasks/{}/attempts"),
        ("GET", "/v1/tasks/{}/events"),
    ],
    ids=["get", "cancel", "retry", "attempts", "events"],
)
@pytest.mark.parametrize("task_id", [HUGE_ID, "0", "-1", "abc", "1.5", "9223372036854775808"])
def test_a_bad_task_id_in_the_path_is_a_422(
    shared: Shared, method: str, template: str, task_id: str
) -> None:
    answer = shared.user.request(method, template.format(task_id))
    problem(answer, 422, "task_id")


def test_the_largest_task_id_is_a_plain_404(shared: Shared) -> None:
    answer = shared.user.get(f"/v1/tasks/{2**63 - 1}")
    found = problem(answer, 404)
    assert found["type"].endswith("/not-found")


# --- queries -----------------------------------------------------------------------------

BAD_QUERIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "tasks-cursor-garbage": ("/v1/tasks", {"cursor": "garbage"}, "cursor"),
    "tasks-cursor-not-base64-int": ("/v1/tasks", {"cursor": "AAAA"}, "cursor"),
    "tasks-cursor-zero": ("/v1/tasks", {"cursor": "MA"}, "cursor"),
    "tasks-cursor-negative": ("/v1/tasks", {"cursor": "LTE"}, "cursor"),
    "tasks-cursor-huge": ("/v1/tasks", {"cursor": "OTk5OTk5OTk5OTk5OTk5OTk5OTk"}, "cursor"),
    "tasks-cursor-too-long": ("/v1/tasks", {"cursor": "A" * 41}, "cursor"),
    "tasks-limit-zero": ("/v1/tasks", {"limit": 0}, "limit"),
    "tasks-limit-1001": ("/v1/tasks", {"limit": 1001}, "limit"),
    "tasks-limit-not-int": ("/v1/tasks", {"limit": "ten"}, "limit"),
    "tasks-limit-huge": ("/v1/tasks", {"limit": HUGE_ID}, "limit"),
    "tasks-label-without-equals": ("/v1/tasks", {"label": "team"}, "label"),
    "tasks-label-without-key": ("/v1/tasks", {"label": "=x"}, "label"),
    "tasks-label-bad-key": ("/v1/tasks", {"label": "-x=1"}, "label"),
    "tasks-too-many-labels": ("/v1/tasks", {"label": [f"k{i}=v" for i in range(17)]}, "label"),
    "tasks-owner-over-100": ("/v1/tasks", {"owner": "o" * 101}, "owner"),
    "tasks-state-unknown": ("/v1/tasks", {"state": "sleeping"}, "state"),
    "tasks-queue-bad": ("/v1/tasks", {"queue": "Bad Queue"}, "queue"),
    "events-after-garbage": ("/v1/events", {"after": "garbage"}, "after"),
    "events-after-one-part": ("/v1/events", {"after": "12"}, "after"),
    "events-after-negative": ("/v1/events", {"after": "-1.0"}, "after"),
    "events-after-over-int64": ("/v1/events", {"after": "9999999999999999999.0"}, "after"),
    "events-after-20-digits": ("/v1/events", {"after": f"1.{HUGE_ID}"}, "after"),
    "events-after-too-long": ("/v1/events", {"after": "1." + "0" * 40}, "after"),
    "events-limit-zero": ("/v1/events", {"limit": 0}, "limit"),
    "events-limit-1001": ("/v1/events", {"limit": 1001}, "limit"),
    "events-wait-31": ("/v1/events", {"wait": 31}, "wait"),
    "events-wait-negative": ("/v1/events", {"wait": -1}, "wait"),
    "events-wait-inf": ("/v1/events", {"wait": "inf"}, "wait"),
    "events-wait-nan": ("/v1/events", {"wait": "nan"}, "wait"),
    "events-wait-not-a-number": ("/v1/events", {"wait": "soon"}, "wait"),
    "events-hold-31": ("/v1/events", {"hold": 31}, "hold"),
    "events-hold-negative": ("/v1/events", {"hold": -1}, "hold"),
    "events-hold-not-a-number": ("/v1/events", {"hold": "1e1x"}, "hold"),
}


@pytest.mark.parametrize(
    ("path", "params", "field"), list(BAD_QUERIES.values()), ids=list(BAD_QUERIES)
)
def test_a_bad_query_is_a_422_naming_the_parameter(
    shared: Shared, path: str, params: dict[str, Any], field: str
) -> None:
    answer = shared.user.get(path, params=params, timeout=5)
    found = problem(answer, 422, field)
    assert found["type"].endswith("/invalid-input")


@pytest.mark.parametrize(
    ("query", "field"),
    [("owner=al%00ice", "owner"), ("label=team%3Da%00b", "label")],
    ids=["owner-nul", "label-value-nul"],
)
def test_a_nul_in_a_query_value_is_a_422_not_a_500(shared: Shared, query: str, field: str) -> None:
    """An admin's ``owner`` filter and label values go to PostgreSQL as text, which
    cannot hold NUL. (A user's foreign ``owner`` never reaches the database.)"""
    problem(shared.admin.get(f"/v1/tasks?{query}"), 422, field)


@pytest.mark.parametrize(
    "query",
    ["label=team%3D%FF%FE", "owner=%ED%A0%80", "state=%FF", "cursor=%00"],
    ids=["label-not-utf8", "owner-encoded-surrogate", "state-not-utf8", "cursor-nul"],
)
def test_an_odd_query_value_is_never_a_500(shared: Shared, query: str) -> None:
    answer = shared.admin.get(f"/v1/tasks?{query}")
    assert answer.status_code < 500, answer.text
    if answer.status_code >= 400:
        problem(answer, answer.status_code)


@pytest.mark.parametrize("last_event_id", [b"\xb2:0", b"1:\xb3", b"x:0", b"1"])
def test_a_bad_last_event_id_is_a_422_not_a_500(shared: Shared, last_event_id: bytes) -> None:
    """A superscript digit (latin-1 in a header) passed str.isdigit and failed int()."""
    made = shared.user.post("/v1/tasks", json=spec())
    assert made.status_code == 201, made.text
    headers = {"Last-Event-ID": last_event_id}
    answer = shared.user.get(f"/v1/tasks/{made.json()['id']}/logs?follow=true", headers=headers)
    assert "Last-Event-ID" in problem(answer, 422)["detail"]


def test_a_bad_queue_name_in_the_path_is_a_422(shared: Shared) -> None:
    problem(shared.admin.post("/v1/queues/Not%20A%20Queue/pause"), 422, "name")
    problem(shared.admin.post(f"/v1/queues/{'q' * 65}/resume"), 422, "name")


# --- who may call ------------------------------------------------------------------------


def test_no_token_is_a_401_with_www_authenticate(
    core: Core, db: psycopg.Connection[tuple[Any, ...]]
) -> None:
    with httpx.Client(base_url=core.url) as anonymous:
        for method, path, body in [
            ("POST", "/v1/tasks", spec()),
            ("POST", "/v1/tasks/batch", {"tasks": [spec()]}),
            ("GET", "/v1/tasks", None),
            ("GET", "/v1/events", None),
            ("POST", "/v1/queues/default/pause", None),
        ]:
            answer = anonymous.request(method, path, json=body)
            found = problem(answer, 401)
            assert found["type"].endswith("/unauthorized")
            assert answer.headers["www-authenticate"].lower().startswith("bearer"), path
    assert tasks_in(db) == 0


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer not-a-token",
        "Bearer " + "x" * 500,
        "Basic YWxpY2U6c2VjcmV0",
        "Bearer",
        "",
    ],
    ids=["unknown", "oversize", "basic-scheme", "no-credentials", "empty"],
)
def test_a_bad_token_is_a_401(
    core: Core, db: psycopg.Connection[tuple[Any, ...]], authorization: str
) -> None:
    with httpx.Client(base_url=core.url, headers={"authorization": authorization}) as client:
        answer = client.post("/v1/tasks", json=spec())
    problem(answer, 401)
    assert answer.headers["www-authenticate"].lower().startswith("bearer")
    assert tasks_in(db) == 0


def test_a_worker_may_not_submit(core: Core, db: psycopg.Connection[tuple[Any, ...]]) -> None:
    with core.client("w1", "worker") as worker:
        problem(worker.post("/v1/tasks", json=spec()), 403, "worker")
        problem(worker.post("/v1/tasks/batch", json={"tasks": [spec()]}), 403, "worker")
        problem(worker.get("/v1/tasks"), 403)
    assert tasks_in(db) == 0


def test_a_user_may_not_pause_or_resume_a_queue(
    alice: httpx.Client, db: psycopg.Connection[tuple[Any, ...]]
) -> None:
    for verb in ("pause", "resume"):
        found = problem(alice.post(f"/v1/queues/default/{verb}"), 403, "user")
        assert found["type"].endswith("/forbidden")
    assert db.execute("SELECT count(*) FROM core.queues WHERE paused").fetchone() == (0,)
    assert tasks_in(db) == 0


def test_a_method_a_path_does_not_take_is_a_405_of_its_own_type_not_internal(
    shared: Shared,
) -> None:
    """Starlette's 405 (and any status without a problem type of Cairn's) was answered as
    the ``internal`` type titled "Something went wrong."; it is RFC 9457's about:blank,
    titled by its status, with the methods the path takes."""
    answer = shared.user.delete("/v1/tasks")
    body = problem(answer, 405)
    assert body["type"] == "about:blank"
    assert body["title"] == "Method Not Allowed"
    assert answer.headers.get("allow")


def test_an_idempotency_key_header_is_the_bodys_key(shared: Shared) -> None:
    """The header (the common convention) was ignored: two POSTs with the same
    ``Idempotency-Key`` made two tasks. It is the body's ``idempotency_key``; a bad one,
    or one that differs from the body's, is a 422 naming the header, storing nothing."""
    key = f"hdr-{uuid.uuid4()}"
    first = shared.user.post("/v1/tasks", json=spec(), headers={"Idempotency-Key": key})
    again = shared.user.post("/v1/tasks", json=spec(), headers={"Idempotency-Key": key})
    body = shared.user.post("/v1/tasks", json=spec(idempotency_key=key))
    assert (first.status_code, again.status_code, body.status_code) == (201, 200, 200)
    assert first.json()["id"] == again.json()["id"] == body.json()["id"]
    assert first.json()["idempotency_key"] == key
    same = shared.user.post(
        "/v1/tasks", json=spec(idempotency_key=key), headers={"Idempotency-Key": key}
    )
    assert same.status_code == 200 and same.json()["id"] == first.json()["id"]
    before = tasks_in(shared.db)
    differs = {"Idempotency-Key": f"other-{uuid.uuid4()}"}
    problem(
        shared.user.post("/v1/tasks", json=spec(idempotency_key=key), headers=differs),
        422,
        "Idempotency-Key",
    )
    problem(
        shared.user.post("/v1/tasks", json=spec(), headers={"Idempotency-Key": "k" * 201}),
        422,
        "Idempotency-Key",
    )
    assert tasks_in(shared.db) == before
