"""What `cairn up --demo` loads: a few tasks, a cron schedule and a diamond workflow, all
running the small scripts shipped beside this file."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

from libs.common.client import CoreClient
from libs.common.cron_client import CronClient
from libs.common.cron_models import ScheduleCreate
from libs.common.dag_client import DagClient
from libs.common.dag_models import WorkflowCreate
from libs.common.errors import Conflict
from libs.common.models import TaskCreate

HERE = Path(__file__).resolve().parent


def artifact(script: str) -> dict[str, str]:
    path = HERE / script
    return {"uri": f"file://{path}", "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def task(name: str, script: str, *args: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "artifact": artifact(script), "args": list(args), **extra}


def diamond() -> WorkflowCreate:
    return WorkflowCreate.model_validate(
        {
            "name": "demo-diamond",
            "description": "extract, two transforms in parallel, then load",
            "params": {"day": "today"},
            "nodes": [
                {
                    "name": "extract",
                    "task": task("extract", "hello.sh", "extract {{ params.day }}"),
                },
                {
                    "name": "clean",
                    "depends_on": ["extract"],
                    "task": task("clean", "sleep.sh", "2"),
                },
                {
                    "name": "enrich",
                    "depends_on": ["extract"],
                    "task": task("enrich", "sleep.sh", "1"),
                },
                {
                    "name": "load",
                    "depends_on": ["clean", "enrich"],
                    "task": task("load", "hello.sh", "load run {{ run.id }}"),
                },
            ],
        }
    )


async def load(urls: dict[str, str], token: str) -> dict[str, Any]:
    """Submit the demo's work; return what was made."""
    async with (
        CoreClient(urls["core"], token) as core,
        CronClient(urls["cron"], token) as cron,
        DagClient(urls["dag"], token) as dag,
    ):
        plain = [
            task("demo-hello", "hello.sh", "world"),
            task("demo-sleep", "sleep.sh", "3"),
            task("demo-labelled", "hello.sh", "with a label", labels={"demo": "yes"}),
        ]
        # Keys make the demo load once: a later `cairn up --demo` finds the same work.
        tasks = [
            TaskCreate.model_validate({**t, "idempotency_key": f"demo:{t['name']}"}) for t in plain
        ]
        made = [item.id for item in await core.submit_batch(tasks)]
        schedule = ScheduleCreate.model_validate(
            {
                "name": "demo-every-minute",
                "expression": "* * * * *",
                "target": {"kind": "task", "task": task("demo-cron", "hello.sh", "cron")},
            }
        )
        try:
            schedule_id = (await cron.create(schedule)).id
        except Conflict:  # there from an earlier --demo: find it
            page = await cron.list_page()
            schedule_id = next(s.id for s in page.items if s.name == "demo-every-minute")
        await dag.put_workflow(diamond())
        run, _ = await dag.start_run("demo-diamond", {"day": "demo"}, idempotency_key="demo")
        return {"tasks": made, "schedule": schedule_id, "run": run.id}


def load_sync(urls: dict[str, str], token: str) -> dict[str, Any]:
    return asyncio.run(load(urls, token))
