"""Cron targets and DAG nodes refer to secrets like tasks do: each service stores the
reference, core fills in the value for the worker only."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

from libs.common.embedded import binaries
from libs.common.settings import libpq_url
from tests.fixtures.cron import start_cron
from tests.fixtures.dag import start_dag
from tests.support import TRUE_SHA, Core, register_worker, wait_for

ARTIFACT = {"uri": "file:///bin/true", "sha256": TRUE_SHA}


def _claim_one(core: Core) -> dict:
    with core.client("w1", "worker") as agent:
        offer = {"hostname": "w", "queues": ["default"], "cpu": 8, "memory_mb": 16384}
        worker_id = register_worker(agent, offer)
        room = {"cpu": 8, "memory_mb": 16384, "max": 1}

        def claimed() -> list[dict]:
            return agent.post(f"/v1/workers/{worker_id}/claim", json=room).json()["attempts"]

        [leased] = wait_for(claimed, timeout=30)
        return leased


def _dump(db_url: str) -> bytes:
    command = [str(binaries() / "pg_dump"), "--data-only", libpq_url(db_url)]
    return subprocess.run(command, capture_output=True, check=True, timeout=60).stdout


def test_a_cron_target_refers_to_a_secret(core: Core, tmp_path: Path) -> None:
    value = f"cron-secret-{uuid.uuid4().hex}"
    cron = start_cron(core, tmp_path / "cron")
    try:
        with core.client("alice") as alice, cron.client("alice") as schedules:
            assert alice.post("/v1/secrets", json={"name": "db", "value": value}).status_code == 201
            task = {"name": "nightly", "artifact": ARTIFACT, "env": {"DB": {"secret": "db"}}}
            body = {"name": "n", "expression": "@daily", "target": {"kind": "task", "task": task}}
            made = schedules.post("/v1/schedules", json=body)
            assert made.status_code == 201, made.text
            assert value not in made.text
            fired = schedules.post(f"/v1/schedules/{made.json()['id']}/trigger")
            assert fired.status_code == 201, fired.text
            leased = _claim_one(core)
            # Beside the secret, only the slot cron sets on every fire's task.
            assert leased["env"].pop("DB") == value
            assert set(leased["env"]) <= {"CAIRN_CRON_SLOT", "CAIRN_CRON_SCHEDULE_ID"}
    finally:
        cron.stop()
    assert value.encode() not in _dump(core.db_url)


def test_a_dag_node_refers_to_a_secret(core: Core, tmp_path: Path) -> None:
    value = f"dag-secret-{uuid.uuid4().hex}"
    dag = start_dag(core, tmp_path / "dag")
    try:
        with core.client("alice") as alice, dag.client("alice") as flows:
            assert alice.post("/v1/secrets", json={"name": "db", "value": value}).status_code == 201
            node = {
                "name": "load",
                "task": {
                    "artifact": ARTIFACT,
                    "env": {"DB": {"secret": "db"}, "DAY": "{{ params.day }}"},
                },
            }
            body = {"name": "flow", "params": {"day": "x"}, "nodes": [node]}
            assert flows.post("/v1/workflows", json=body).status_code in (200, 201)
            run = flows.post("/v1/workflows/flow/runs", json={"params": {"day": "monday"}})
            assert run.status_code == 201, run.text
            leased = _claim_one(core)
            assert leased["env"] == {"DB": value, "DAY": "monday"}
    finally:
        dag.stop()
    assert value.encode() not in _dump(core.db_url)
