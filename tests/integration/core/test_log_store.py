"""Logs in an S3-compatible object store (``CAIRN_LOG_STORE=s3``, docs/logs.md), against
moto's S3 server on 127.0.0.1: chunks live in PostgreSQL while the attempt runs; once it
ends they become one object, from which the whole log (or its rest, from an offset) is
read; the object is deleted when the retention purge deletes its task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg

from libs.common.settings import libpq_url
from tests.fixtures.logs import BUCKET, keys, s3_core
from tests.integration.core.test_logs import Shipper
from tests.support import spec, wait_for


def test_an_ended_attempts_log_is_one_object_read_whole_and_deleted_with_its_task(
    db_url: str, tmp_path: Path, s3: tuple[str, Any]
) -> None:
    endpoint, client = s3
    core = s3_core(db_url, tmp_path / "core", endpoint, retention_days=1, retention_interval_s=0.2)
    try:
        shipper = Shipper(core)
        with core.client() as alice:
            task_id = alice.post("/v1/tasks", json=spec()).json()["id"]
        attempt = shipper.claim()["attempt_id"]
        lines = [f"line {i} é\n" for i in range(200)]
        offset = 0
        for line in lines:
            shipper.ship((attempt, offset, line))
            offset += len(line.encode())
        with core.client() as alice:
            assert alice.get(f"/v1/tasks/{task_id}/logs").text == "".join(lines)
        assert keys(client) == []  # running: in PostgreSQL
        shipper.report(attempt)
        key = f"logs/{task_id}/{attempt}.log"
        wait_for(lambda: keys(client) == [key], timeout=20)
        with psycopg.connect(libpq_url(db_url)) as conn:
            wait_for(
                lambda: (
                    conn.execute(
                        "SELECT archived_at IS NOT NULL FROM core.attempt_logs WHERE attempt_id = %s",
                        (attempt,),
                    ).fetchone()
                    == (True,)
                )
            )
            (chunks,) = conn.execute(
                "SELECT count(*) FROM core.log_chunks WHERE attempt_id = %s", (attempt,)
            ).fetchone()
        assert chunks == 0
        stored = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        assert stored.decode() == "".join(lines)
        half = len("".join(lines[:100]).encode())
        with core.client() as alice:
            whole = alice.get(f"/v1/tasks/{task_id}/logs")
            rest = alice.get(f"/v1/tasks/{task_id}/logs", params={"offset": half})
            followed = alice.get(f"/v1/tasks/{task_id}/logs", params={"follow": "true"})
        assert whole.text == "".join(lines)
        assert whole.headers["x-cairn-log-complete"] == "true"
        assert whole.headers["x-cairn-log-offset"] == str(offset)
        assert rest.text == "".join(lines[100:])
        assert "line 199" in followed.text and "event: end" in followed.text

        # Past retention: the task goes, then its object.
        with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
            conn.execute(
                "UPDATE core.tasks SET finished_at = now() - interval '2 days' WHERE id = %s",
                (task_id,),
            )
            conn.execute("UPDATE core.log_objects SET archived_at = now() - interval '2 days'")
            wait_for(lambda: keys(client) == [], timeout=20)
            wait_for(
                lambda: conn.execute("SELECT count(*) FROM core.log_objects").fetchone() == (0,)
            )
        shipper.http.close()
    finally:
        core.stop()
