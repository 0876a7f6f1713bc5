"""Notifications over real HTTP: subscriptions per owner, the matcher following core's feed,
the deadline scan, events posted by services, and webhook delivery to a real receiver on
127.0.0.1 that fails the first tries (signed, retried, logged, disabled, never doubled)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result

from services.core.identity.crypto import new_key
from tests.support import Core, cairn_cli, spec, start_core, wait_for
from tests.webhooks import Receiver, subscribe

FAST = {
    "notify_interval_s": 0.05,
    "notify_backoff_base_s": 0.05,
    "notify_backoff_cap_s": 0.2,
    "notify_timeout_s": 2.0,
}


pytestmark = pytest.mark.core(**FAST)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    hook = Receiver(fail_first=2)
    yield hook
    hook.close()


# Each registered worker's lease secret, by its id: its calls must carry it.
LEASES: dict[int, str] = {}


def bury(core: Core, count: int, owner: str = "alice", **fields: Any) -> list[int]:
    """Submit ``count`` tasks and make them dead as a worker would: a failure that is not
    retryable, reported through the dispatch API."""
    with core.client(owner) as client:
        ids = [client.post("/v1/tasks", json=spec(**fields)).json()["id"] for _ in range(count)]
    with core.client(f"worker-{owner}", "worker") as worker:
        offer = {"hostname": "w.test", "queues": [fields.get("queue", "default")], "cpu": 64}
        registered = worker.post("/v1/workers", json={**offer, "memory_mb": 65536}).json()
        worker_id = registered["worker"]["id"]
        LEASES[worker_id] = registered["lease"]
        worker.headers["X-Cairn-Worker-Lease"] = registered["lease"]
        claimed: list[dict[str, Any]] = []
        while len(claimed) < count:
            room = {"cpu": 64, "memory_mb": 65536, "max": count}
            claimed += worker.post(f"/v1/workers/{worker_id}/claim", json=room).json()["attempts"]
        for attempt in claimed:
            answer = worker.post(
                f"/v1/workers/{worker_id}/attempts/{attempt['attempt_id']}/report",
                json={"outcome": "failed", "retryable": False, "error": "boom"},
            )
            assert answer.json()["state"] == "dead", answer.text
    return ids


def delivered(db, count: int) -> bool:
    """Whether the outbox holds ``count`` rows, every one of them delivered."""
    row = db.execute(
        "SELECT count(*), count(*) FILTER (WHERE state = 'delivered') FROM core.notifications"
    ).fetchone()
    return row == (count, count)


def matcher_passed(db, task_ids: list[int]) -> bool:
    """Whether the matcher's cursor is past every event of these tasks. The cursor moves
    to the deaths it reads: pass tasks whose last event is their death."""
    row = db.execute(
        "SELECT count(*) FROM core.task_events e, core.notify_cursors c "
        "WHERE c.name = 'matcher' AND e.task_id = ANY(%s) AND (e.xid, e.id) > (c.feed_xid, c.feed_id)",
        (task_ids,),
    ).fetchone()
    return row == (0,)


def test_an_idle_matcher_does_not_rewrite_its_cursor_and_still_matches_the_next_death(
    core: Core, receiver: Receiver, db
) -> None:
    """The cursor moves when a death is read, not on every pass: each move is a write,
    whose transaction id moved the feed's horizon, so an idle core wrote for ever."""
    with core.client() as alice:
        subscribe(alice, receiver.url)
    first = bury(core, 1)
    wait_for(lambda: matcher_passed(db, first))
    query = "SELECT xmin::text FROM core.notify_cursors WHERE name = 'matcher'"
    [written] = db.execute(query).fetchone()
    # Twenty passes a second (FAST), while these transactions move the horizon.
    for _ in range(15):
        db.execute("SELECT pg_current_xact_id()")
        time.sleep(0.1)
    assert db.execute(query).fetchone() == (written,)
    second = bury(core, 1)
    wait_for(lambda: matcher_passed(db, second))
    assert db.execute(query).fetchone() != (written,)
    wait_for(lambda: delivered(db, 2), timeout=20)


def test_a_dead_task_reaches_the_webhook_signed_after_two_failed_tries(
    core: Core, receiver: Receiver, db
) -> None:
    with core.client() as alice:
        made = subscribe(alice, receiver.url, filter={"labels": {"team": "a"}})
        [dead] = bury(core, 1, labels={"team": "a", "x": "1"})
        [other] = bury(core, 1, labels={"team": "b"})
        wait_for(lambda: matcher_passed(db, [dead, other]))
        wait_for(lambda: delivered(db, 1), timeout=20)
        deliveries = alice.get(f"/v1/subscriptions/{made['id']}/deliveries").json()["items"]
        answers = alice.get(f"/v1/subscriptions/{made['id']}/answers").json()["items"]
        shown = alice.get(f"/v1/subscriptions/{made['id']}").json()
    got = receiver.all()
    assert [r.answered for r in got] == [500, 500, 200]
    assert len({r.delivery_id for r in got}) == 1
    assert all(r.signed_by(made["secret"]) for r in got)
    assert all(r.headers["x-cairn-event"] == "task.dead" for r in got)
    assert all(int(r.headers["x-cairn-timestamp"]) > 0 for r in got)
    assert len({r.body for r in got}) == 1, "every try carries the same body"
    doc = got[0].doc
    assert doc["id"] == got[0].delivery_id
    assert doc["event"] == "task.dead"
    assert doc["owner"] == "alice"
    assert doc["data"]["task"]["id"] == dead
    assert doc["data"]["task"]["labels"] == {"team": "a", "x": "1"}
    assert doc["data"]["task"]["last_error"] == "boom"
    assert [(d["state"], d["tries"], d["last_status"]) for d in deliveries] == [
        ("delivered", 3, 200)
    ]
    assert [(a["try"], a["status"]) for a in answers] == [(3, 200), (2, 500), (1, 500)]
    assert shown["failures"] == 0
    assert shown["enabled"] is True
    assert "secret" not in shown


def test_retried_and_dead_again_is_a_new_notification(core: Core, db) -> None:
    hook = Receiver()
    try:
        with core.client() as alice:
            subscribe(alice, hook.url)
            [task] = bury(core, 1)
            wait_for(lambda: delivered(db, 1), timeout=20)
            assert alice.post(f"/v1/tasks/{task}/retry").status_code == 200
        bury_again = db.execute(
            "SELECT count(*) FROM core.tasks WHERE id = %s AND state = 'waiting'", (task,)
        ).fetchone()
        assert bury_again == (1,)
        with core.client("worker-alice", "worker") as worker:
            worker_id = db.execute("SELECT max(id) FROM core.workers").fetchone()[0]
            worker.headers["X-Cairn-Worker-Lease"] = LEASES[worker_id]
            room = {"cpu": 64, "memory_mb": 65536, "max": 1}
            [attempt] = worker.post(f"/v1/workers/{worker_id}/claim", json=room).json()["attempts"]
            worker.post(
                f"/v1/workers/{worker_id}/attempts/{attempt['attempt_id']}/report",
                json={"outcome": "failed", "retryable": False, "error": "again"},
            )
        wait_for(lambda: matcher_passed(db, [task]))
        wait_for(lambda: delivered(db, 2), timeout=20)
        ids = [r.delivery_id for r in hook.all()]
        assert len(set(ids)) == 2
        assert [r.doc["data"]["task"]["last_error"] for r in hook.all()] == ["boom", "again"]
    finally:
        hook.close()


def test_a_deadline_passed_while_not_finished_is_notified_once(core: Core, db) -> None:
    hook = Receiver()
    try:
        with core.client() as alice:
            subscribe(alice, hook.url, events=["task.deadline_missed"], filter={"queue": "etl"})
            later = "2999-01-01T00:00:00Z"
            late = alice.post("/v1/tasks", json=spec(queue="etl", deadline=later)).json()["id"]
            other = alice.post("/v1/tasks", json=spec(queue="web", deadline=later)).json()["id"]
            done = alice.post("/v1/tasks", json=spec(queue="etl", deadline=later)).json()["id"]
            alice.post(f"/v1/tasks/{done}/cancel")
            # Backdated in SQL: the cancelled one finished before its deadline.
            db.execute(
                "UPDATE core.tasks SET deadline = now() - interval '1 second', finished_at = "
                "CASE WHEN id = %s THEN now() - interval '1 minute' END WHERE id = ANY(%s)",
                (done, [late, other, done]),
            )
            wait_for(
                lambda: db.execute(
                    "SELECT deadline_id >= %s FROM core.notify_cursors WHERE name = 'deadlines'",
                    (max(late, other, done),),
                ).fetchone()[0]
            )
            wait_for(lambda: delivered(db, 1), timeout=20)
        [got] = hook.all()
        assert got.doc["event"] == "task.deadline_missed"
        assert got.doc["data"]["task"]["id"] == late
        assert got.doc["data"]["task"]["state"] == "waiting"
    finally:
        hook.close()


def test_services_post_fire_and_run_events_for_an_owner_once(core: Core, db) -> None:
    hook = Receiver()
    try:
        with core.client() as alice, core.client("bob") as bob:
            made = subscribe(alice, hook.url, events=["fire.failed", "run.failed"])
            subscribe(bob, hook.url, name="bob's", events=["fire.failed"])
            event = {
                "event": "fire.failed",
                "owner": "alice",
                "key": "schedule 7 at 2026-12-01T00:00:00Z",
                "summary": "schedule nightly: core refused the submission",
                "subject": {"schedule_id": "7", "fire_time": "2026-12-01T00:00:00Z"},
            }
            with core.client("cron", "service") as cron:
                first = cron.post("/v1/notifications/events", json=event)
                again = cron.post("/v1/notifications/events", json=event)
                missed = cron.post(
                    "/v1/notifications/events", json={**event, "event": "fire.missed"}
                )
            assert (first.status_code, first.json()) == (202, {"queued": 1})
            assert again.json() == {"queued": 0}
            assert missed.json() == {"queued": 0}
            assert alice.post("/v1/notifications/events", json=event).status_code == 403
            wait_for(lambda: delivered(db, 1), timeout=20)
        [got] = hook.all()
        assert got.signed_by(made["secret"])
        assert got.doc["event"] == "fire.failed"
        assert got.doc["data"]["subject"]["schedule_id"] == "7"
        assert got.doc["subscription"] == {"id": made["id"], "name": "hook"}
    finally:
        hook.close()


def test_after_repeated_failure_a_subscription_is_disabled_with_its_reason(
    db_url: str, tmp_path: Path, db
) -> None:
    hook = Receiver(fail_first=None, status=503)
    server = start_core(db_url, tmp_path, **FAST, notify_disable_after=3)
    try:
        with server.client() as alice:
            made = subscribe(alice, hook.url)
            bury(server, 1)

            def disabled() -> Any:
                found = alice.get(f"/v1/subscriptions/{made['id']}").json()
                return found if not found["enabled"] else None

            shown = wait_for(disabled, timeout=20)
            assert shown["disabled_reason"] == (
                "disabled after 3 failed deliveries in a row; last: HTTP 503"
            )
            assert shown["failures"] == 3
            [delivery] = alice.get(f"/v1/subscriptions/{made['id']}/deliveries").json()["items"]
            assert (delivery["state"], delivery["tries"]) == ("pending", 3)
            assert len(hook.all()) == 3
            # Healed and enabled again: the pending delivery goes out.
            hook.fail_first = 0
            enabled = alice.post(f"/v1/subscriptions/{made['id']}/enable").json()
            assert (enabled["enabled"], enabled["failures"]) == (True, 0)
            wait_for(lambda: delivered(db, 1), timeout=20)
        assert [r.answered for r in hook.all()] == [503, 503, 503, 200]
    finally:
        server.stop()
        hook.close()


def test_a_test_event_is_delivered_and_logged(core: Core, db) -> None:
    hook = Receiver()
    try:
        with core.client() as alice:
            made = subscribe(alice, hook.url)
            queued = alice.post(f"/v1/subscriptions/{made['id']}/test")
            assert queued.status_code == 202
            wait_for(lambda: delivered(db, 1), timeout=20)
            answers = alice.get(f"/v1/subscriptions/{made['id']}/answers").json()["items"]
        assert [a["status"] for a in answers] == [200]
        assert all(r.doc["event"] == "test" for r in hook.all())
        assert hook.all()[0].delivery_id == queued.json()["delivery_id"]
    finally:
        hook.close()


def _settled(db, subscription_id: int) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT state, tries FROM core.notifications WHERE subscription_id = %s "
        "AND state <> 'pending' ORDER BY id",
        (subscription_id,),
    ).fetchall()


def test_test_deliveries_are_rate_limited_and_never_retried_even_when_disabled(
    db_url: str, tmp_path: Path, db
) -> None:
    """300 test calls made 1,739 requests in a minute: each was retried up to 12 times,
    also to a disabled subscription. Now: one test per interval (429 with Retry-After
    after it, nothing queued), each tried once."""
    hook = Receiver(fail_first=None, status=500)
    server = start_core(db_url, tmp_path, **FAST, notify_test_interval_s=60.0)
    try:
        with server.client() as alice:
            made = subscribe(alice, hook.url, events=["run.failed"])
            base = f"/v1/subscriptions/{made['id']}"
            assert alice.post(f"{base}/test").status_code == 202
            # Another subscription of the same owner is not another allowance.
            other = subscribe(alice, hook.url, events=["run.failed"], name="other")
            burst = [alice.post(f"/v1/subscriptions/{other['id']}/test")]
            burst += [alice.post(f"{base}/test") for _ in range(20)]
            assert {r.status_code for r in burst} == {429}
            assert all(55 <= int(r.headers["Retry-After"]) <= 60 for r in burst)
            assert burst[0].json()["quota"] == "test_deliveries"
            wait_for(lambda: _settled(db, made["id"]) == [("failed", 1)], timeout=20)
            # Disabled, and the last test backdated past the interval: one try, no retry.
            db.execute(
                "UPDATE core.subscriptions SET enabled = false, disabled_reason = 'x', "
                "tested_at = now() - interval '1 minute' WHERE id = %s",
                (made["id"],),
            )
            again = alice.post(f"{base}/test")
            assert again.status_code == 202
            wait_for(lambda: len(_settled(db, made["id"])) == 2, timeout=20)
            time.sleep(1.0)  # twenty delivery turns and more backoffs than that: none retries
        assert _settled(db, made["id"]) == [("failed", 1), ("failed", 1)]
        assert [r.delivery_id for r in hook.all()][-1] == again.json()["delivery_id"]
        assert len(hook.all()) == 2
        assert db.execute("SELECT count(*) FROM core.notifications").fetchone() == (2,)
    finally:
        server.stop()
        hook.close()


def test_two_replicas_deliver_every_notification_exactly_once(
    db_url: str, tmp_path: Path, db
) -> None:
    hook = Receiver(fail_first=1)
    # Replicas share their secrets keys, as production requires: each home would make a
    # key of its own, and a replica could not open the signing secret the other sealed.
    key = new_key()
    one = start_core(db_url, tmp_path / "one", secrets_key=key, **FAST)
    two = start_core(db_url, tmp_path / "two", secrets_key=key, **FAST)
    try:
        with one.client() as alice:
            subscribe(alice, hook.url)
        ids = bury(two, 20)
        wait_for(lambda: matcher_passed(db, ids))
        wait_for(lambda: delivered(db, 20), timeout=30)
    finally:
        one.stop()
        two.stop()
        hook.close()
    tries = Counter(r.delivery_id for r in hook.all())
    accepted = Counter(r.delivery_id for r in hook.accepted())
    assert len(tries) == 20
    assert set(tries.values()) == {2}, "one failure, one success each, no double sends"
    assert set(accepted.values()) == {1}
    assert sorted(r.doc["data"]["task"]["id"] for r in hook.accepted()) == sorted(ids)


def test_another_owners_subscription_is_not_found(core: Core) -> None:
    with core.client() as alice, core.client("bob") as bob:
        made = subscribe(alice, "https://hooks.example.com/x")
        base = f"/v1/subscriptions/{made['id']}"
        assert bob.get(base).status_code == 404
        assert bob.delete(base).status_code == 404
        assert bob.post(f"{base}/test").status_code == 404
        assert bob.post(f"{base}/enable").status_code == 404
        assert bob.get(f"{base}/deliveries").status_code == 404
        assert bob.get(f"{base}/answers").status_code == 404
        assert bob.get("/v1/subscriptions").json() == {"items": []}
        assert [s["id"] for s in alice.get("/v1/subscriptions").json()["items"]] == [made["id"]]
        assert alice.delete(base).status_code == 204
        assert alice.get(base).status_code == 404


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "ftp://example.com/x"}, "body.url"),
        ({"url": "https://user:pw@example.com/x"}, "body.url"),
        ({"url": "https://example.com/" + "x" * 3000}, "body.url"),
        ({"url": "https://example.com:99999/x"}, "body.url"),
        ({"events": ["task.succeeded"]}, "body.events.0"),
        ({"events": []}, "body.events"),
        ({"owner": "mallory"}, "body.owner"),
        ({"filter": {"queue": "Bad Queue"}}, "body.filter.queue"),
        ({"name": "x" * 300}, "body.name"),
    ],
)
def test_bad_subscriptions_are_refused_naming_the_field(
    core: Core, body: dict[str, Any], field: str
) -> None:
    full = {"name": "hook", "events": ["task.dead"], "url": "https://example.com/x", **body}
    with core.client() as alice:
        answer = alice.post("/v1/subscriptions", json=full)
    assert answer.status_code == 422, answer.text
    assert answer.json()["errors"][0]["field"] == field


def test_a_name_is_used_once_per_owner(core: Core) -> None:
    with core.client() as alice, core.client("bob") as bob:
        subscribe(alice, "https://example.com/a")
        again = alice.post(
            "/v1/subscriptions",
            json={"name": "hook", "events": ["task.dead"], "url": "https://example.com/b"},
        )
        assert again.status_code == 409
        assert "name" in again.json()["detail"]
        subscribe(bob, "https://example.com/a")


def test_production_takes_https_webhooks_only(db_url: str, tmp_path: Path) -> None:
    server = start_core(
        db_url,
        tmp_path,
        env="production",
        secrets_key=base64.urlsafe_b64encode(os.urandom(32)).decode(),
        artifact_sources="file:///",
    )
    try:
        with server.client() as alice:
            plain = alice.post(
                "/v1/subscriptions",
                json={"name": "h", "events": ["task.dead"], "url": "http://example.com/x"},
            )
            assert plain.status_code == 422
            assert plain.json()["errors"][0]["field"] == "body.url"
            subscribe(alice, "https://example.com/x")
    finally:
        server.stop()


def test_the_client_manages_subscriptions(core: Core) -> None:
    from libs.common.client import CoreClient
    from libs.common.models import SubscriptionCreate

    async def go() -> None:
        async with CoreClient(core.url, core.tokens["alice"]) as client:
            made = await client.create_subscription(
                SubscriptionCreate(name="c", events=["run.failed"], url="http://127.0.0.1:9/h")
            )
            assert made.secret.startswith("whsec_")
            assert [s.id for s in await client.subscriptions()] == [made.id]
            queued = await client.test_subscription(made.id)
            assert queued.event == "test"
            await client.delete_subscription(made.id)
            assert await client.subscriptions() == []

    core.client().close()  # makes alice's token
    asyncio.run(go())


def test_a_receiver_can_check_the_signature_over_the_timestamp_and_body() -> None:
    from services.core.domain.notify import signature, verify

    body, at = b'{"id":"x"}', 1_764_547_200
    header = signature("whsec_k", at, body)
    assert header.startswith("v1=") and len(header) == 3 + 64
    assert verify("whsec_k", body, str(at), header, now=at + 10)
    assert not verify("whsec_other", body, str(at), header, now=at)
    assert not verify("whsec_k", body + b" ", str(at), header, now=at)
    # The same body under a fresh timestamp is not what was signed...
    assert not verify("whsec_k", body, str(at + 600), header, now=at + 600)
    # ... and the request itself, sent again later, is too old.
    assert not verify("whsec_k", body, str(at), header, now=at + 301)
    assert not verify("whsec_k", body, "-1", header, now=at)


def _cairn(core: Core, token: str, *args: str) -> Result:
    env = {"CAIRN_URL": core.url, "CAIRN_TOKEN": token, "COLUMNS": "200"}
    return cairn_cli("notify", *args, env=env)


def test_the_cli_adds_lists_tests_and_removes(core: Core, db) -> None:
    hook = Receiver()
    try:
        core.client().close()
        token = core.tokens["alice"]
        made = _cairn(core, token, "add", "nightly", hook.url, "-e", "task.dead", "-l", "team=a")
        assert made.exit_code == 0, made.stderr
        assert "whsec_" in made.stdout
        [sub] = json.loads(_cairn(core, token, "ls", "--json").stdout)
        assert (sub["name"], sub["filter"]["labels"]) == ("nightly", {"team": "a"})
        assert _cairn(core, token, "test", str(sub["id"])).exit_code == 0
        wait_for(lambda: delivered(db, 1), timeout=20)
        [got] = hook.all()
        secret = made.stdout.split("with it): ")[1].split()[0]
        assert got.signed_by(secret)
        log = _cairn(core, token, "log", str(sub["id"]))
        assert "200" in log.stdout and "test" in log.stdout
        bad = _cairn(core, token, "add", "x", "ftp://nope", "-e", "task.dead")
        assert bad.exit_code == 2 and "url" in bad.stderr
        assert _cairn(core, token, "rm", str(sub["id"])).exit_code == 0
        assert json.loads(_cairn(core, token, "ls", "--json").stdout) == []
        assert _cairn(core, token, "rm", str(sub["id"])).exit_code == 1
    finally:
        hook.close()


def test_deleting_a_subscription_while_its_delivery_is_recorded_does_not_deadlock(
    core: Core, db
) -> None:
    """A delivery locks its outbox row, then updates its subscription; a delete that took
    the subscription first and the outbox rows by cascade deadlocked with it (a 503)."""
    import threading

    import psycopg

    with core.client("alice") as alice:
        made = subscribe(alice, "http://127.0.0.1:9/h", events=["run.failed"])
        assert alice.post(f"/v1/subscriptions/{made['id']}/test").status_code == 202
        [(outbox,)] = db.execute(
            "SELECT id FROM core.notifications WHERE subscription_id = %s", (made["id"],)
        ).fetchall()
        answers: list[int] = []
        with psycopg.connect(db.info.dsn, password=db.info.password) as delivery:
            # The delivery's transaction: its row first...
            delivery.execute("SELECT 1 FROM core.notifications WHERE id = %s FOR UPDATE", (outbox,))
            remover = threading.Thread(
                target=lambda: answers.append(
                    alice.delete(f"/v1/subscriptions/{made['id']}").status_code
                )
            )
            remover.start()
            wait_for(
                lambda: (
                    db.execute(
                        "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'transactionid'"
                    ).fetchone()[0]
                    > 0
                )
            )
            # ... then its subscription's failures, while the delete waits.
            delivery.execute(
                "UPDATE core.subscriptions SET failures = failures + 1 WHERE id = %s",
                (made["id"],),
            )
            delivery.commit()
            remover.join(30)
        assert answers == [204]
    assert db.execute("SELECT count(*) FROM core.subscriptions").fetchone()[0] == 0
    assert db.execute("SELECT count(*) FROM core.notifications").fetchone()[0] == 0


def test_a_try_that_fails_inside_core_is_recorded_retried_and_counted(
    db_url: str, tmp_path: Path, db
) -> None:
    """A try that fails inside core before any answer (here a stored secret whose nonce
    AES-GCM refuses: a ValueError, not the Unreadable a wrong key gives) is a failed try
    like any other: its answer recorded, retried on the curve, counted toward disabling.
    It ended the delivery's task unseen (an exception never retrieved), nothing recorded:
    the delivery went out again at each lease's end, for ever, never counted."""
    hook = Receiver()
    server = start_core(db_url, tmp_path, **FAST, notify_disable_after=2)
    try:
        with server.client() as alice:
            made = subscribe(alice, hook.url)
            db.execute(
                "UPDATE core.subscriptions SET secret_nonce = '\\x00'::bytea WHERE id = %s",
                (made["id"],),
            )
            bury(server, 1)

            def disabled() -> Any:
                found = alice.get(f"/v1/subscriptions/{made['id']}").json()
                return found if not found["enabled"] else None

            shown = wait_for(disabled, timeout=20)
            answers = alice.get(f"/v1/subscriptions/{made['id']}/answers").json()["items"]
            [delivery] = alice.get(f"/v1/subscriptions/{made['id']}/deliveries").json()["items"]
        assert "ValueError" in shown["disabled_reason"], shown
        assert [(a["try"], a["status"]) for a in answers] == [(2, None), (1, None)]
        assert all("ValueError" in a["error"] for a in answers), answers
        assert (delivery["state"], delivery["tries"]) == ("pending", 2)
        assert hook.all() == []
    finally:
        server.stop()
        hook.close()
