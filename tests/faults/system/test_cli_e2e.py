"""A newcomer's first minutes, end to end: `cairn up --demo` as a process, then the CLI
submits a task, registers a schedule, runs a workflow, reads them back, and Ctrl-C stops
it all. Real processes, real HTTP, the embedded PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from cairn.demo import HERE as DEMO
from tests.faults.system.test_cairn_up import _reap, _up, _wait_up, cron_port, dag_port, own_tmp
from tests.support import free_port, wait_for

pytestmark = pytest.mark.slow
__all__ = ["own_tmp"]  # the fixture, used by name below

HELLO = f"file://{DEMO / 'hello.sh'}"


def cli(home: Path, port: int, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "CAIRN_HOME": str(home),  # the admin token `cairn up` keeps there is used
        "CAIRN_URL": f"http://127.0.0.1:{port}",
        "CAIRN_CRON_URL": f"http://127.0.0.1:{cron_port(port)}",
        "CAIRN_DAG_URL": f"http://127.0.0.1:{dag_port(port)}",
        "CAIRN_CONFIG": str(home / "no-config.toml"),
    }
    env.pop("CAIRN_TOKEN", None)
    done = subprocess.run(
        [sys.executable, "-m", "cairn", *args], env=env, capture_output=True, text=True, timeout=120
    )
    if check:
        assert done.returncode == 0, f"cairn {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


def as_json(home: Path, port: int, *args: str) -> Any:
    return json.loads(cli(home, port, "--json", *args).stdout)


# About 35 s alone; three times that beside the rest of the suite on 2 cores (CI took
# 119.7 s): some 30 CLI processes and two starts of the whole system.
@pytest.mark.timeout(300)
def test_up_demo_then_the_cli_drives_tasks_schedules_and_workflows(own_tmp: Path) -> None:
    home, port = own_tmp / "home", free_port()
    proc = _up(home, port, "--demo")
    try:
        banner = _wait_up(proc)
        assert "demo loaded" in banner
        demo_run = int(banner.split("workflow run ")[1].split()[0])

        # A task, from flags, waited for.
        task = as_json(home, port, "submit", "greet", "--artifact", HELLO, "-a", "cli", "--wait")
        assert task["state"] == "succeeded"
        assert task["owner"] == "admin"
        assert "hello from task" in cli(home, port, "logs", str(task["id"])).stdout
        listed = {t["name"] for t in as_json(home, port, "ls", "--limit", "100")}
        assert {"greet", "demo-hello", "demo-sleep"} <= listed
        demo_ids = [str(t["id"]) for t in as_json(home, port, "ls", "--label", "demo=yes")]
        assert demo_ids
        assert cli(home, port, "wait", *demo_ids).returncode == 0
        assert "oldest waiting" in cli(home, port, "queues").stdout  # (no live work: no rows)
        stuck = as_json(home, port, "submit", "stuck", "--artifact", HELLO, "--queue", "nowhere")
        assert "no live worker" in cli(home, port, "why", str(stuck["id"])).stdout
        assert as_json(home, port, "cancel", str(stuck["id"]))[0]["state"] == "cancelled"
        assert as_json(home, port, "retry", str(stuck["id"]))[0]["state"] == "waiting"
        cli(home, port, "cancel", str(stuck["id"]))
        workers = as_json(home, port, "workers")
        assert [w["state"] for w in workers] == ["live"]
        assert workers[0]["last_turn_at"] is not None
        assert "turn" in cli(home, port, "workers").stdout  # the column of the last turn

        # A schedule, and a preview across next March's DST change.
        made = as_json(
            home, port, "cron", "add", "nightly", "30 2 * * *", "--tz", "America/New_York",
            "--artifact", HELLO,
        )  # fmt: skip
        nxt = as_json(
            home,
            port,
            "cron",
            "next",
            str(made["id"]),
            "-n",
            "2",
            "--after",
            "2027-03-13T00:00:00Z",
        )
        assert [i["local"] for i in nxt["items"]] == [
            "2027-03-13T02:30:00-05:00",
            "2027-03-14T03:30:00-04:00",
        ]
        assert "nightly" in cli(home, port, "cron", "ls").stdout
        assert as_json(home, port, "cron", "pause", str(made["id"]))["paused"] is True
        fired = as_json(home, port, "cron", "trigger", str(made["id"]))
        assert fired["outcome"] == "submitted"
        bad = cli(home, port, "cron", "add", "bad", "61 * * * *", "--artifact", HELLO, check=False)
        assert bad.returncode == 1
        assert "body.expression" in bad.stderr

        # A workflow from YAML, run to the end; the demo's diamond finished too.
        definition = own_tmp / "flow.yaml"
        definition.write_text(
            textwrap.dedent(
                f"""\
                name: cli-flow
                nodes:
                  - name: first
                    task: {{artifact: {{uri: "{HELLO}", sha256: "{_sha(DEMO / "hello.sh")}"}}}}
                  - name: second
                    depends_on: [first]
                    task: {{artifact: {{uri: "{HELLO}", sha256: "{_sha(DEMO / "hello.sh")}"}},
                            args: ["{{{{ params.who }}}}"]}}
                """
            )
        )
        assert "version 1 stored" in cli(home, port, "dag", "submit", str(definition)).stdout
        run = as_json(home, port, "dag", "run", "cli-flow", "--param", "who=cli", "--wait")
        assert run["state"] == "succeeded"
        assert {n["name"]: n["state"] for n in run["nodes"]} == {
            "first": "succeeded",
            "second": "succeeded",
        }
        tree = cli(home, port, "dag", "status", str(run["id"])).stdout
        assert "first" in tree and "second" in tree
        wait_for(
            lambda: as_json(home, port, "dag", "status", str(demo_run))["state"] == "succeeded",
            timeout=60,
            interval=1,
        )
        mermaid = cli(home, port, "dag", "graph", str(demo_run), "--mermaid").stdout
        assert "extract" in mermaid and "load" in mermaid

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        _reap(proc)

    # A second start with --demo finds the demo's work instead of adding to it.
    before = as_json_after_restart = None
    again = _up(home, port, "--demo")
    try:
        banner = _wait_up(again)
        assert f"workflow run {demo_run}" in banner
        before = len(as_json(home, port, "ls", "--label", "demo=yes"))
        as_json_after_restart = len(
            [t for t in as_json(home, port, "ls", "--limit", "1000") if t["name"] == "demo-hello"]
        )
        assert (before, as_json_after_restart) == (1, 1)
        again.send_signal(signal.SIGINT)
        assert again.wait(timeout=60) == 0
    finally:
        _reap(again)


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
