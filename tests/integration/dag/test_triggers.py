"""Signed HTTP triggers against a real core and PostgreSQL: a delivery signed with the
trigger's secret starts a run with params from the payload (mapped, or its ``params``),
the same key answers the same run (200), a stale, unsigned or wrongly signed delivery is
refused (401, 403: problem+json, never a 500), params the workflow does not take are a 422
naming them, a body over the bound a 413; triggers are listed without their secret and
deleted. What the database holds is checked."""

from __future__ import annotations

import time

import httpx
import psycopg

from services.dag.api.triggers import sign
from tests.fixtures.dag import DagServer, Runner, node, workflow

PROBLEM = "application/problem+json"


def _deliver(
    dag: DagServer, path: str, secret: str, body: bytes, at: float | None = None, **headers: str
) -> httpx.Response:
    stamp = str(int(time.time() if at is None else at))
    signed = {
        "X-Cairn-Timestamp": stamp,
        "X-Cairn-Signature": "sha256=" + sign(secret, stamp, body),
        "Content-Type": "application/json",
        **headers,
    }
    return httpx.post(dag.url + path, content=body, headers=signed, timeout=10)


def _runs(db: psycopg.Connection) -> list[tuple]:
    return db.execute(
        "SELECT id, owner, params, idempotency_key FROM dag.runs ORDER BY id"
    ).fetchall()


def test_a_signed_delivery_starts_one_run_per_key(
    dag: DagServer, runner: Runner, db: psycopg.Connection
) -> None:
    params = {"region": "eu", "n": 1}
    runner.define(
        workflow("ingest", [node("load", args=("ok", "{{ params.region }}"))], params=params)
    )
    made = runner.http.post(
        "/v1/workflows/ingest/triggers",
        json={"params": {"region": "where.region", "n": "count"}, "key_path": "order.id"},
    )
    assert made.status_code == 201, made.text
    trigger = made.json()
    secret, path = trigger["secret"], trigger["path"]

    body = b'{"where": {"region": "us"}, "count": 7, "order": {"id": "o-1"}}'
    first = _deliver(dag, path, secret, body)
    assert first.status_code == 201, first.text
    assert first.json()["params"] == {"region": "us", "n": 7}
    again = _deliver(dag, path, secret, body.replace(b"7", b"8"))  # same key, other data
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"], again.text
    other = _deliver(dag, path, secret, b'{"order": {"id": 12}}')  # defaults fill in
    assert other.status_code == 201 and other.json()["params"] == params, other.text
    by_header = _deliver(dag, path, secret, b'{"order": {"id": 12}}', **{"Idempotency-Key": "h"})
    assert by_header.status_code == 201, by_header.text
    key = f"trigger:{trigger['id']}:"
    assert _runs(db) == [
        (first.json()["id"], "alice", {"region": "us", "n": 7}, key + "o-1"),
        (other.json()["id"], "alice", params, key + "12"),
        (by_header.json()["id"], "alice", params, key + "h"),
    ]

    listed = runner.http.get("/v1/workflows/ingest/triggers").json()["items"]
    assert [t["id"] for t in listed] == [trigger["id"]] and "secret" not in listed[0]
    assert runner.http.delete(f"/v1/workflows/ingest/triggers/{trigger['id']}").status_code == 204
    gone = _deliver(dag, path, secret, body)
    assert gone.status_code == 403, gone.text
    assert runner.http.get("/v1/workflows/ingest/triggers").json()["items"] == []


def test_bad_deliveries_are_refused_as_problems(
    dag: DagServer, runner: Runner, db: psycopg.Connection
) -> None:
    runner.define(workflow("plain", [node("a")], params={"day": "x"}))
    trigger = runner.http.post("/v1/workflows/plain/triggers", json={}).json()
    secret, path = trigger["secret"], trigger["path"]
    body = b'{"params": {"day": "mon"}}'

    stale = _deliver(dag, path, secret, body, at=time.time() - 3600)
    unsigned = httpx.post(dag.url + path, content=body, timeout=10)
    wrong = _deliver(dag, path, "not-the-secret", body)
    unknown = _deliver(dag, "/v1/triggers/999999", secret, body)
    bad_param = _deliver(dag, path, secret, b'{"params": {"dya": "mon"}}')
    not_json = _deliver(dag, path, secret, b"{")
    too_big = _deliver(dag, path, secret, b'{"x": "' + b"a" * 70_000 + b'"}')
    # "\xb2" (superscript two) passed str.isdigit and failed int(): a 500, unsigned
    odd_digit = {"X-Cairn-Timestamp": b"\xb2", "X-Cairn-Signature": "sha256=" + "0" * 64}
    odd_time = httpx.post(dag.url + path, content=body, headers=odd_digit, timeout=10)
    for answer, status in (
        (stale, 401), (unsigned, 401), (wrong, 403), (unknown, 403),
        (bad_param, 422), (not_json, 422), (too_big, 413), (odd_time, 401),
    ):  # fmt: skip
        assert answer.status_code == status, (status, answer.text)
        assert answer.headers["content-type"].startswith(PROBLEM), answer.headers
    assert "body.params.dya" in bad_param.text
    assert _runs(db) == []

    # Without a key, a replay of the very same signed request is the same run.
    stamp = str(int(time.time()))
    headers = {
        "X-Cairn-Timestamp": stamp,
        "X-Cairn-Signature": "sha256=" + sign(secret, stamp, body),
    }
    first = httpx.post(dag.url + path, content=body, headers=headers, timeout=10)
    replay = httpx.post(dag.url + path, content=body, headers=headers, timeout=10)
    assert (first.status_code, replay.status_code) == (201, 200), replay.text
    assert len(_runs(db)) == 1

    refused = runner.http.post("/v1/workflows/plain/triggers", json={"key_path": "a..b"})
    assert refused.status_code == 422 and "key_path" in refused.text, refused.text
    with dag.client("mallory") as stranger:
        assert stranger.get("/v1/workflows/plain/triggers").status_code == 404
        assert stranger.delete(f"/v1/workflows/plain/triggers/{trigger['id']}").status_code == 404
