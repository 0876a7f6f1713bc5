"""The end of a log that reaches core after its attempt's report (docs/logs.md, "When
core is slow"): a report that says the output was longer than what core holds
(``log_bytes``) keeps the log open to its worker for ``CAIRN_LOG_LATE_S``; a follower's
stream and the archive wait for the rest; whatever else comes late is refused, chunk by
chunk, with a reason, and never stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg

from libs.common.settings import libpq_url
from tests.fixtures.logs import BUCKET, follow_log, keys, s3_core
from tests.integration.core.test_logs import OFFER, Shipper, _running, shipper  # noqa: F401
from tests.support import Core, register_worker, wait_for

WHOLE = ["one\n", "two\n", "three é\n"]
SIZE = len("".join(WHOLE).encode())


def _statuses(answer: Any) -> list[tuple[int, str | None]]:
    assert answer.status_code == 200, answer.text
    return [(a["status"], a["detail"]) for a in answer.json()["items"]]


def test_the_rest_of_a_log_after_the_report_is_taken_and_the_follower_waits_for_it(
    core: Core,
    shipper: Shipper,  # noqa: F811 (the fixture)
) -> None:
    task_id, attempt = _running(core, shipper)
    assert _statuses(shipper.ship((attempt, 0, WHOLE[0]))) == [(200, None)]
    shipper.report(attempt, log_bytes=SIZE)  # the rest is still on its way
    events: list[tuple[str, dict]] = []
    reader = follow_log(core, task_id, events)
    wait_for(lambda: len(events) == 1, timeout=10)
    with core.client() as alice:
        early = alice.get(f"/v1/tasks/{task_id}/logs")
    assert early.text == WHOLE[0] and early.headers["x-cairn-log-complete"] == "false"
    assert reader.is_alive()  # ended, but its log is not whole: no `end` yet

    late = shipper.ship((attempt, 4, WHOLE[1]), (attempt, 8, WHOLE[2]))
    assert _statuses(late) == [(200, None), (200, None)]
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert "".join(e["text"] for name, e in events if name == "log") == "".join(WHOLE)
    end = {"attempt_id": attempt, "outcome": "succeeded", "next_offset": SIZE}
    assert events[-1] == ("end", {**end, "task_state": "succeeded"})
    with core.client() as alice:
        whole = alice.get(f"/v1/tasks/{task_id}/logs")
    assert whole.text == "".join(WHOLE) and whole.headers["x-cairn-log-complete"] == "true"

    # Sent again (its answer lost): already held. Past the end the report gave: refused.
    again, past = _statuses(shipper.ship((attempt, 8, WHOLE[2]), (attempt, SIZE, "more\n")))
    assert again == (200, None)
    assert past[0] == 422 and f"its output was {SIZE} bytes" in str(past[1])
    with core.client() as alice:
        assert alice.get(f"/v1/tasks/{task_id}/logs").text == "".join(WHOLE)


def test_late_chunks_are_refused_with_a_reason_unless_their_report_declared_them(
    core: Core,
    shipper: Shipper,  # noqa: F811 (the fixture)
) -> None:
    _, plain = _running(core, shipper)
    shipper.report(plain)  # core had it all: nothing more is taken
    task_id, late = _running(core, shipper)
    shipper.report(late, log_bytes=SIZE)
    with core.client("intruder", "worker") as http:
        intruder = register_worker(http, OFFER)
        forged = http.post(
            f"/v1/workers/{intruder}/logs",
            json={"chunks": [{"attempt_id": late, "offset": 0, "length": 4, "text": "bad\n"}]},
        )
        # One attempt's chunks overlapping in one batch: the whole batch is refused.
        overlap = http.post(
            f"/v1/workers/{intruder}/logs",
            json={
                "chunks": [
                    {"attempt_id": late, "offset": 0, "length": 4, "text": "one\n"},
                    {"attempt_id": late, "offset": 2, "length": 4, "text": "two\n"},
                ]
            },
        )
    [(status, why)] = _statuses(forged)
    assert status == 409 and why == f"attempt {late} is not open on worker {intruder}"
    assert overlap.status_code == 422
    assert overlap.headers["content-type"].startswith("application/problem+json")
    assert "overlaps an earlier one" in overlap.text and "chunks" in overlap.text
    [(status, why)] = _statuses(shipper.ship((plain, 0, "after\n")))
    assert status == 409 and why == f"attempt {plain} has ended (succeeded): its log is closed"

    # The wait is over (the attempt ended long ago): refused, and the log is complete
    # with what came.
    with psycopg.connect(libpq_url(core.db_url), autocommit=True) as conn:
        conn.execute(
            "UPDATE core.attempts SET ended_at = now() - interval '1 hour' WHERE id = %s", (late,)
        )
        [(status, why)] = _statuses(shipper.ship((late, 0, WHOLE[0])))
        assert status == 409 and "more than CAIRN_LOG_LATE_S (60 s)" in str(why)
        stored = "SELECT count(*) FROM core.log_chunks WHERE attempt_id = ANY(%s)"
        assert conn.execute(stored, ([plain, late],)).fetchone() == (0,)
    with core.client() as alice:
        log = alice.get(f"/v1/tasks/{task_id}/logs")
    assert log.text == "" and log.headers["x-cairn-log-complete"] == "true"


def test_a_late_log_is_archived_once_whole(
    db_url: str,
    tmp_path: Path,
    s3: tuple[str, Any],
) -> None:
    endpoint, client = s3
    core = s3_core(db_url, tmp_path / "core", endpoint)
    try:
        shipper = Shipper(core)
        task_id, attempt = _running(core, shipper)
        shipper.ship((attempt, 0, WHOLE[0]))
        shipper.report(attempt, log_bytes=SIZE)
        # A plain attempt's log, reported after it, is archived while this one waits.
        _, plain = _running(core, shipper)
        shipper.ship((plain, 0, "plain\n"))
        shipper.report(plain)
        wait_for(lambda: any(k.endswith(f"/{plain}.log") for k in keys(client)), timeout=20)
        key = f"logs/{task_id}/{attempt}.log"
        assert key not in keys(client)
        shipper.ship((attempt, 4, WHOLE[1]), (attempt, 8, WHOLE[2]))
        wait_for(lambda: key in keys(client), timeout=20)
        stored = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        assert stored.decode() == "".join(WHOLE)
        [(status, why)] = _statuses(shipper.ship((attempt, 8, WHOLE[2])))
        assert status == 409 and why == f"attempt {attempt}'s log is archived: it is closed"
        shipper.http.close()
    finally:
        core.stop()
