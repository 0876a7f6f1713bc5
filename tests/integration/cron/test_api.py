"""The cron API over real HTTP: schedules, validation, ownership, previews."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from tests.fixtures.cron import Cron
from tests.support import spec


def schedule(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "nightly",
        "expression": "30 2 * * *",
        "timezone": "America/New_York",
        "target": {"kind": "task", "task": spec(name="nightly-report")},
    }
    body.update(overrides)
    return body


def test_create_get_list_update_delete(cron: Cron) -> None:
    with cron.client("alice") as alice:
        made = alice.post("/v1/schedules", json=schedule())
        assert made.status_code == 201, made.text
        body = made.json()
        assert body["owner"] == "alice"
        assert body["misfire_policy"] == "fire_once"
        assert body["overlap_policy"] == "allow"
        # EPOCH is 2027-01-04 12:00:30Z = 07:00:30 EST; next 02:30 EST is on the 5th.
        assert body["next_fire_at"] == "2027-01-05T07:30:00Z"
        sid = body["id"]
        assert alice.get(f"/v1/schedules/{sid}").json()["name"] == "nightly"
        assert [s["id"] for s in alice.get("/v1/schedules").json()["items"]] == [sid]
        changed = alice.patch(f"/v1/schedules/{sid}", json={"expression": "0 9 * * 1-5"})
        assert changed.status_code == 200, changed.text
        assert changed.json()["version"] == body["version"] + 1
        assert changed.json()["next_fire_at"] == "2027-01-04T14:00:00Z"  # 09:00 EST today
        assert alice.delete(f"/v1/schedules/{sid}").status_code == 204
        assert alice.get(f"/v1/schedules/{sid}").status_code == 404


def test_pause_and_resume(cron: Cron) -> None:
    with cron.client() as alice:
        sid = alice.post("/v1/schedules", json=schedule()).json()["id"]
        paused = alice.post(f"/v1/schedules/{sid}/pause").json()
        assert paused["paused"] is True
        assert paused["next_fire_at"] is None
        resumed = alice.post(f"/v1/schedules/{sid}/resume").json()
        assert resumed["paused"] is False
        assert resumed["next_fire_at"] == "2027-01-05T07:30:00Z"


def test_preview_across_next_march_dst_change(cron: Cron) -> None:
    with cron.client() as alice:
        sid = alice.post("/v1/schedules", json=schedule()).json()["id"]
        answer = alice.get(
            f"/v1/schedules/{sid}/next", params={"n": 3, "after": "2027-03-13T00:00:00Z"}
        )
        assert answer.status_code == 200, answer.text
        items = answer.json()["items"]
        assert [i["local"] for i in items] == [
            "2027-03-13T02:30:00-05:00",
            "2027-03-14T03:30:00-04:00",
            "2027-03-15T02:30:00-04:00",
        ]
        assert [i["utc"] for i in items] == [
            "2027-03-13T07:30:00Z",
            "2027-03-14T07:30:00Z",
            "2027-03-15T06:30:00Z",
        ]


def _dag_target(params: dict[str, Any]) -> dict[str, Any]:
    return {"target": {"kind": "dag", "workflow": "etl", "params": params}}


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"expression": "61 * * * *"}, "body.expression", "not a valid cron expression"),
        ({"expression": "* * * *"}, "body.expression", "has 4 fields"),
        ({"expression": "59 23 31 2 *"}, "body.expression", "never fires"),
        ({"expression": "R 3 * * *"}, "body.expression", "random"),
        ({"timezone": "Mars/Olympus"}, "body.timezone", "IANA"),
        # the host's own clock (replicas on different hosts need not agree) and no zone
        ({"timezone": "localtime"}, "body.timezone", "not a place's time zone"),
        ({"timezone": "posix/posixrules"}, "body.timezone", "not a place's time zone"),
        ({"timezone": "Factory"}, "body.timezone", "not a place's time zone"),
        ({"misfire_policy": "sometimes"}, "body.misfire_policy", ""),
        ({"catch_up_limit": 0}, "body.catch_up_limit", ""),
        (
            {"target": {"kind": "task", "task": spec(idempotency_key="x")}},
            "body.target.task",
            "idempotency_key",
        ),
        # a selector that is not one is refused when the schedule is defined, not when
        # it fires (the one parser: libs.common.selectors)
        (
            {"target": {"kind": "task", "task": spec(placement={"required": ["zone in a"]})}},
            "body.target.task.task.placement.required.0",
            "zone in a",
        ),
        # A discriminated union names its branch ("task") in the path.
        ({"target": {"kind": "task", "task": {"name": "x"}}}, "body.target.task.task.artifact", ""),
        ({"target": {"kind": "email"}}, "body.target", ""),
        (
            {"starts_at": "2027-02-01T00:00:00Z", "ends_at": "2027-01-01T00:00:00Z"},
            "body",
            "ends_at must be after starts_at",
        ),
        # the calendar's last minute: the walk to the next slot passed year 9999 (a 500)
        ({"starts_at": "9999-12-31T23:59:00Z"}, "body.expression", "never fires"),
        # a workflow's params as the DAG service takes a run's: these were stored, then
        # every fire was refused by it
        (_dag_target({"day": {"from": 1}}), "body.target.dag.params.day", ""),
        (_dag_target({"fire": "x"}), "body.target.dag.params", "reserved"),
        (_dag_target({"big": 2**70}), "body.target.dag.params", "64 bits"),
    ],
)
def test_bad_schedules_get_a_422_naming_the_field(
    cron: Cron, change: dict[str, Any], field: str, words: str
) -> None:
    with cron.client() as alice:
        answer = alice.post("/v1/schedules", json=schedule(**change))
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    problem = answer.json()
    assert any(e["field"].startswith(field) for e in problem["errors"]), problem
    assert words in problem["detail"]


def test_a_change_to_timing_that_never_fires_is_refused_as_at_create(
    cron: Cron, db: psycopg.Connection[tuple[Any, ...]]
) -> None:
    """It was stored (200): the schedule then fired no more, with no word of why."""
    with cron.client() as alice:
        sid = alice.post("/v1/schedules", json=schedule()).json()["id"]
        for change in ({"expression": "59 23 31 2 *"}, {"starts_at": "9999-12-31T23:59:00Z"}):
            answer = alice.patch(f"/v1/schedules/{sid}", json=change)
            assert answer.status_code == 422, answer.text
            assert answer.json()["errors"][0]["field"] == "body.expression"
            assert "never fires" in answer.json()["detail"]
    kept = db.execute("SELECT expression, starts_at, next_fire_at IS NOT NULL FROM cron.schedules")
    assert kept.fetchall() == [("30 2 * * *", None, True)]


def test_a_schedule_stored_under_a_host_zone_keeps_working_but_cannot_be_set_to_one(
    cron: Cron, db: psycopg.Connection[tuple[Any, ...]]
) -> None:
    """A schedule stored under ``localtime`` before such zones were refused is still
    shown, previewed and changed; only a zone given is checked."""
    with cron.client() as alice:
        sid = alice.post("/v1/schedules", json=schedule()).json()["id"]
        db.execute("UPDATE cron.schedules SET timezone = 'localtime' WHERE id = %s", (sid,))
        assert alice.get(f"/v1/schedules/{sid}").json()["timezone"] == "localtime"
        assert alice.get(f"/v1/schedules/{sid}/next").status_code == 200
        assert alice.patch(f"/v1/schedules/{sid}", json={"expression": "0 3 * * *"}).is_success
        refused = alice.patch(f"/v1/schedules/{sid}", json={"timezone": "Factory"})
        assert refused.status_code == 422, refused.text
        assert refused.json()["errors"][0]["field"] == "body.timezone"
        assert alice.patch(f"/v1/schedules/{sid}", json={"timezone": "UTC"}).is_success
    kept = db.execute("SELECT expression, timezone FROM cron.schedules WHERE id = %s", (sid,))
    assert kept.fetchall() == [("0 3 * * *", "UTC")]


def test_names_are_unique_per_owner(cron: Cron) -> None:
    with cron.client("alice") as alice, cron.client("bob") as bob:
        assert alice.post("/v1/schedules", json=schedule()).status_code == 201
        again = alice.post("/v1/schedules", json=schedule())
        assert again.status_code == 409
        assert "nightly" in again.json()["detail"]
        assert bob.post("/v1/schedules", json=schedule()).status_code == 201


def test_another_owners_schedule_is_not_found(cron: Cron) -> None:
    with cron.client("alice") as alice, cron.client("bob") as bob:
        sid = alice.post("/v1/schedules", json=schedule()).json()["id"]
        for method, path in [
            ("GET", f"/v1/schedules/{sid}"),
            ("PATCH", f"/v1/schedules/{sid}"),
            ("DELETE", f"/v1/schedules/{sid}"),
            ("POST", f"/v1/schedules/{sid}/pause"),
            ("POST", f"/v1/schedules/{sid}/trigger"),
            ("GET", f"/v1/schedules/{sid}/next"),
            ("GET", f"/v1/schedules/{sid}/fires"),
        ]:
            kwargs: dict[str, Any] = {"json": {}} if method == "PATCH" else {}
            assert bob.request(method, path, **kwargs).status_code == 404, path
        assert bob.get("/v1/schedules").json()["items"] == []
    with cron.client("root", role="admin") as admin:
        assert admin.get(f"/v1/schedules/{sid}").status_code == 200


def test_tokens_are_checked_through_core(cron: Cron) -> None:
    import httpx

    assert httpx.get(cron.url + "/v1/schedules").status_code == 401
    bad = httpx.get(cron.url + "/v1/schedules", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401
    assert bad.headers["content-type"] == "application/problem+json"
    with cron.client("w1", role="worker") as worker:
        assert worker.get("/v1/schedules").status_code == 403


def test_null_for_a_required_field_is_refused(cron: Cron) -> None:
    with cron.client() as alice:
        sid = alice.post("/v1/schedules", json=schedule()).json()["id"]
        answer = alice.patch(f"/v1/schedules/{sid}", json={"expression": None})
        assert answer.status_code == 422
        assert answer.json()["errors"][0]["field"] == "body.expression"


@pytest.mark.parametrize(
    # the last two are in range as written, not in UTC: the conversion was a 500
    "after",
    ["9999-12-31T00:00:00Z", "0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"],
)
def test_preview_refuses_an_instant_out_of_range(cron: Cron, after: str) -> None:
    with cron.client() as alice:
        sid = alice.post("/v1/schedules", json=schedule()).json()["id"]
        answer = alice.get(f"/v1/schedules/{sid}/next", params={"after": after})
        assert answer.status_code == 422, answer.text
        assert answer.json()["errors"][0]["field"] == "query.after"


@pytest.mark.parametrize(
    "params",
    [
        '{"day": NaN}',  # was a 422 naming no field
        '{"day": {"x": "\\ud800"}}',  # was a 500
        '{"day": "\\u0000"}',  # was a 422 naming no field
    ],
)
def test_a_dag_targets_params_are_refused_naming_the_field(
    cron: Cron, db: psycopg.Connection[tuple[Any, ...]], params: str
) -> None:
    body = json.dumps(schedule(**_dag_target({})))
    body = body.replace('"params": {}', f'"params": {params}')
    with cron.client() as alice:
        headers = {"content-type": "application/json"}
        answer = alice.post("/v1/schedules", content=body.encode(), headers=headers)
    assert answer.status_code == 422, answer.text
    fields = {e["field"] for e in answer.json()["errors"]}
    assert all(f.startswith("body.target.dag.params") for f in fields), fields
    assert db.execute("SELECT count(*) FROM cron.schedules").fetchone() == (0,)
