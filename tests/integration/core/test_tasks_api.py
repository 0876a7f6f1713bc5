from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import orjson

from libs.common.client import ON_BEHALF_OF
from tests.support import Core, spec


def test_submit_returns_201_and_the_stored_task(core: Core, db) -> None:
    with core.client() as alice:
        answer = alice.post("/v1/tasks", json=spec(args=["a", "b"], labels={"team": "x"}))
    assert answer.status_code == 201
    task = answer.json()
    assert task["owner"] == "alice"
    assert task["state"] == "waiting"
    assert answer.headers["location"] == f"/v1/tasks/{task['id']}"
    with core.client() as alice:
        read = alice.get(answer.headers["location"]).json()
    # A read also says why the task is not running; the submit answer spares that work.
    assert read.pop("pending_reason") == "no live worker serves queue default"
    assert task.pop("pending_reason") is None
    assert read == task
    row = db.execute(
        "SELECT owner, state, args FROM core.tasks WHERE id = %s", (task["id"],)
    ).fetchone()
    assert row == ("alice", "waiting", ["a", "b"])


def test_a_submission_that_fastapi_answers_is_the_same_submission(core: Core, db) -> None:
    """``SubmitRoute`` serves the plain request itself and hands the others (another
    spelling of the JSON content type, a service acting for someone) to FastAPI's handler:
    both store and answer the same task."""
    body = orjson.dumps(spec(args=["a"], labels={"team": "x"}))
    charset = {"content-type": "application/json; charset=utf-8"}
    with core.client() as alice, core.client("cron", role="service") as cron:
        plain = alice.post("/v1/tasks", content=body, headers={"content-type": "application/json"})
        other = alice.post("/v1/tasks", content=body, headers=charset)
        acting = cron.post("/v1/tasks", content=body, headers={**charset, ON_BEHALF_OF: "alice"})
    assert [a.status_code for a in (plain, other, acting)] == [201, 201, 201]
    ids = [a.json()["id"] for a in (plain, other, acting)]
    answers = [{k: v for k, v in a.json().items() if k not in VARY} for a in (plain, other, acting)]
    assert answers[0] == answers[1] == answers[2]
    rows = db.execute(
        "SELECT owner, args, labels FROM core.tasks WHERE id = ANY(%s) ORDER BY id", (ids,)
    ).fetchall()
    assert rows == [("alice", ["a"], {"team": "x"})] * 3


# What differs between two submissions of the same request.
VARY = ("id", "created_at", "updated_at", "run_at", "start_by")


def test_submit_writes_one_event_in_the_same_transaction(core: Core, db) -> None:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=spec()).json()
        events = alice.get(f"/v1/tasks/{task['id']}/events").json()["items"]
    assert [(e["op"], e["from_state"], e["to_state"], e["seq"]) for e in events] == [
        ("submit", None, "waiting", 1)
    ]


def test_future_run_at_is_ready_then_promoted_when_due(core: Core, db) -> None:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=spec(run_at="2999-01-01T00:00:00Z")).json()
        assert task["state"] == "ready"
        db.execute(
            "UPDATE core.tasks SET run_at = now() - interval '1 s' WHERE id = %s", (task["id"],)
        )
        from tests.support import wait_for

        wait_for(lambda: alice.get(f"/v1/tasks/{task['id']}").json()["state"] == "waiting")


def test_same_idempotency_key_returns_the_first_task_with_200(core: Core) -> None:
    with core.client() as alice:
        first = alice.post("/v1/tasks", json=spec(idempotency_key="nightly-2026-11-30"))
        again = alice.post("/v1/tasks", json=spec(idempotency_key="nightly-2026-11-30"))
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]


def test_same_key_with_a_different_request_is_a_409(core: Core) -> None:
    with core.client() as alice:
        alice.post("/v1/tasks", json=spec(idempotency_key="k"))
        other = alice.post("/v1/tasks", json=spec(idempotency_key="k", args=["different"]))
    assert other.status_code == 409
    assert other.headers["content-type"] == "application/problem+json"
    assert "idempotency_key" in other.json()["detail"]


def test_same_key_from_another_owner_is_another_task(core: Core) -> None:
    with core.client("alice") as alice, core.client("bob") as bob:
        a = alice.post("/v1/tasks", json=spec(idempotency_key="k")).json()
        b = bob.post("/v1/tasks", json=spec(idempotency_key="k")).json()
    assert a["id"] != b["id"]


def test_twenty_concurrent_submits_with_one_key_make_one_task(core: Core, db) -> None:
    core.client("alice").close()

    def submit(_: int) -> tuple[int, int]:
        with core.client("alice") as alice:
            answer = alice.post("/v1/tasks", json=spec(idempotency_key="once"))
            return answer.status_code, answer.json()["id"]

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(submit, range(20)))
    assert len({task_id for _, task_id in results}) == 1
    assert sorted(code for code, _ in results) == [200] * 19 + [201]
    assert db.execute("SELECT count(*) FROM core.tasks").fetchone() == (1,)
    assert db.execute("SELECT count(*) FROM core.task_events").fetchone() == (1,)


def test_batch_is_all_or_nothing(core: Core, db) -> None:
    bad = [spec(name=f"t{i}") for i in range(10)]
    bad[7]["priority"] = 1000
    with core.client() as alice:
        answer = alice.post("/v1/tasks/batch", json={"tasks": bad})
        assert answer.status_code == 422
        assert "tasks.7.priority" in answer.json()["detail"]
        assert db.execute("SELECT count(*) FROM core.tasks").fetchone() == (0,)
        good = alice.post(
            "/v1/tasks/batch", json={"tasks": [spec(name=f"t{i}") for i in range(10)]}
        )
    assert good.status_code == 201
    items = good.json()["tasks"]
    assert len(items) == 10 and all(item["created"] for item in items)
    names = db.execute("SELECT name FROM core.tasks ORDER BY id").fetchall()
    assert [n for (n,) in names] == [f"t{i}" for i in range(10)]


def test_a_batch_the_database_refuses_one_row_of_stores_none_of_it(core: Core, db) -> None:
    # A batch without idempotency keys is one statement in autocommit: a row refused by
    # the database (here a trigger) after the others were written takes them back too.
    db.execute(
        """CREATE FUNCTION core.refuse_t7() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN
               IF NEW.name = 't7' THEN RAISE EXCEPTION 'refused by the test'; END IF;
               RETURN NEW;
           END $$"""
    )
    db.execute(
        "CREATE TRIGGER refuse_t7 BEFORE INSERT ON core.tasks"
        " FOR EACH ROW EXECUTE FUNCTION core.refuse_t7()"
    )
    with core.client() as alice:
        answer = alice.post(
            "/v1/tasks/batch", json={"tasks": [spec(name=f"t{i}") for i in range(10)]}
        )
        assert answer.status_code == 500, answer.text  # not the caller's fault
        assert db.execute("SELECT count(*) FROM core.tasks").fetchone() == (0,)
        assert db.execute("SELECT count(*) FROM core.task_events").fetchone() == (0,)
        db.execute("DROP TRIGGER refuse_t7 ON core.tasks")
        again = alice.post(
            "/v1/tasks/batch", json={"tasks": [spec(name=f"t{i}") for i in range(10)]}
        )
    assert again.status_code == 201
    assert db.execute("SELECT count(*) FROM core.tasks").fetchone() == (10,)


def test_batch_conflict_rolls_back_every_task(core: Core, db) -> None:
    with core.client() as alice:
        alice.post("/v1/tasks", json=spec(idempotency_key="k"))
        batch = [spec(name="new"), spec(idempotency_key="k", args=["changed"])]
        answer = alice.post("/v1/tasks/batch", json={"tasks": batch})
    assert answer.status_code == 409
    assert db.execute("SELECT count(*) FROM core.tasks").fetchone() == (1,)


def test_batch_maps_keys_to_existing_and_repeated_tasks_in_order(core: Core) -> None:
    with core.client() as alice:
        existing = alice.post("/v1/tasks", json=spec(idempotency_key="old")).json()
        batch = [
            spec(name="a"),
            spec(idempotency_key="old"),
            spec(name="b", idempotency_key="new"),
            spec(name="b", idempotency_key="new"),
            spec(name="c"),
        ]
        items = alice.post("/v1/tasks/batch", json={"tasks": batch}).json()["tasks"]
        names = [alice.get(f"/v1/tasks/{i['id']}").json()["name"] for i in items]
    assert [i["created"] for i in items] == [True, False, True, False, True]
    assert items[1]["id"] == existing["id"]
    assert items[2]["id"] == items[3]["id"]
    assert names == ["a", "test-task", "b", "b", "c"]


def test_another_owners_task_is_a_404_like_a_missing_one(core: Core) -> None:
    with core.client("alice") as alice, core.client("bob") as bob:
        task = alice.post("/v1/tasks", json=spec()).json()
        theirs = bob.get(f"/v1/tasks/{task['id']}")
        missing = bob.get("/v1/tasks/999999")
        cancel = bob.post(f"/v1/tasks/{task['id']}/cancel")
    assert theirs.status_code == missing.status_code == cancel.status_code == 404
    assert theirs.json()["title"] == missing.json()["title"]


def test_admin_sees_every_owner(core: Core) -> None:
    with core.client("alice") as alice, core.client("root", "admin") as admin:
        task = alice.post("/v1/tasks", json=spec()).json()
        assert admin.get(f"/v1/tasks/{task['id']}").status_code == 200
        listed = admin.get("/v1/tasks", params={"owner": "alice"}).json()["items"]
    assert [t["id"] for t in listed] == [task["id"]]


def test_list_filters_and_paginates_by_cursor(core: Core) -> None:
    with core.client("alice") as alice, core.client("bob") as bob:
        bob.post("/v1/tasks", json=spec())
        ids = [
            alice.post(
                "/v1/tasks", json=spec(queue="q1" if i % 2 else "q2", labels={"n": str(i)})
            ).json()["id"]
            for i in range(7)
        ]
        seen: list[int] = []
        cursor = None
        while True:
            params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
            page = alice.get("/v1/tasks", params=params).json()
            seen += [t["id"] for t in page["items"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        q1 = alice.get("/v1/tasks", params={"queue": "q1"}).json()["items"]
        labelled = alice.get("/v1/tasks", params={"label": "n=4"}).json()["items"]
        others = alice.get("/v1/tasks", params={"owner": "bob"}).json()["items"]
    assert seen == sorted(ids, reverse=True)
    assert {t["id"] for t in q1} == {ids[i] for i in range(7) if i % 2}
    assert [t["id"] for t in labelled] == [ids[4]]
    assert others == []


def test_cancel_then_retry_then_cancel_again(core: Core, db) -> None:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=spec()).json()
        cancelled = alice.post(f"/v1/tasks/{task['id']}/cancel").json()
        assert cancelled["state"] == "cancelled" and cancelled["finished_at"]
        again = alice.post(f"/v1/tasks/{task['id']}/cancel")
        assert again.status_code == 409
        retried = alice.post(f"/v1/tasks/{task['id']}/retry").json()
        assert retried["state"] == "waiting" and retried["finished_at"] is None
        events = alice.get(f"/v1/tasks/{task['id']}/events").json()["items"]
    assert [e["op"] for e in events] == ["submit", "cancel", "retry"]
    assert [e["seq"] for e in events] == [1, 2, 3]


def test_retry_of_a_waiting_task_is_refused_and_changes_nothing(core: Core, db) -> None:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=spec()).json()
        answer = alice.post(f"/v1/tasks/{task['id']}/retry")
    assert answer.status_code == 409
    assert db.execute("SELECT state, version FROM core.tasks").fetchone() == ("waiting", 1)
    assert db.execute("SELECT count(*) FROM core.task_events").fetchone() == (1,)


def test_attempts_of_a_new_task_are_empty(core: Core) -> None:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=spec()).json()
        assert alice.get(f"/v1/tasks/{task['id']}/attempts").json() == {"items": []}
