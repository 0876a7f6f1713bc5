"""compose/docker-compose.yml, run for real on a Docker engine of the test's own: images
built from Debian's packages, two core replicas, two cron replicas, the DAG service and two
workers; work of every kind done through the published ports; then one core, the leading
cron and one busy worker killed, and nothing lost, nothing doubled, the standby leading.
At the end nothing of it is left on the host."""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from tests.deploy import TIMES, images
from tests.deploy.engine import PrivateEngine
from tests.deploy.stack import EXAMPLES, Stack
from tests.support import wait_for

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(900)]

CHAOS_TASKS = 8


def artifact(script: str) -> dict[str, str]:
    digest = hashlib.sha256((images.ROOT / "cairn" / "demo" / script).read_bytes()).hexdigest()
    return {"uri": f"file://{EXAMPLES}/{script}", "sha256": digest}


def task(name: str, script: str, *args: str, **extra: Any) -> dict[str, Any]:
    # A lost attempt is retried at once, not after the default backoff.
    retry = {"base_s": 0.5, "cap_s": 1, "jitter": False}
    return {"name": name, "artifact": artifact(script), "args": list(args), "retry": retry, **extra}


def ok(response: httpx.Response) -> Any:
    assert response.is_success, f"{response.request.method} {response.url}: {response.text}"
    return response.json()


def test_the_stack_works_and_survives_losing_one_of_each(stack: Stack) -> None:
    core1, core2 = stack.client("CORE_1"), stack.client("CORE_2")
    # Every minute; its fires are checked once the leader is gone (waiting for a fire
    # before that too would add a minute to the test, not a check).
    schedule = ok(stack.client("CRON_1").post("/v1/schedules", json=every_minute()))

    a_task_runs(core1)
    a_diamond_workflow_succeeds(stack, core2)
    the_dashboard_loads(stack)
    workers_are_isolated_and_hold_no_database_url(stack)

    batch = submit_chaos_batch(core2)
    leader, standby = leading_cron(stack)
    busy_worker = wait_for(lambda: worker_running_one(stack, core2), timeout=60, interval=0.2)
    killed_at = datetime.now(UTC)
    killed = [stack.containers("core-1")[0], leader, busy_worker]
    for container in killed:
        stack.kill(container)

    # The standby leads within seconds of the leader's death, and fires the next minute.
    port = {"cron-1": "CRON_1", "cron-2": "CRON_2"}[service_of(standby)]
    wait_for(lambda: cron_status(stack, port)["leader"], timeout=30, interval=0.2)
    # Submitting the batch again through the surviving core makes nothing new.
    again = ok(core2.post("/v1/tasks/batch", json={"tasks": batch["specs"]}))
    assert sorted(t["id"] for t in again["tasks"]) == batch["ids"]
    assert not any(t["created"] for t in again["tasks"])

    nothing_lost_or_doubled(core2, batch["ids"])
    fired = wait_for(
        lambda: [f for f in fires(stack, port, schedule["id"]) if when(f) > killed_at],
        timeout=75,
        interval=1,
    )
    assert fired[0]["outcome"] == "submitted", fired
    one_task_per_slot(stack, port, core2, schedule["id"])
    # The restart policy brings the killed containers back, healthy.
    wait_for(lambda: not stack.not_healthy(), timeout=120, interval=1)
    for container in killed:
        assert stack.engine.inspect(container["Id"])["RestartCount"] >= 1, container["Name"]


# --- the steps ---


def service_of(container: dict[str, Any]) -> str:
    return str(container["Config"]["Labels"]["com.docker.compose.service"])


def every_minute() -> dict[str, Any]:
    return {
        "name": "deploy-every-minute",
        "expression": "* * * * *",
        "target": {"kind": "task", "task": task("deploy-cron", "hello.sh", "cron")},
    }


def a_task_runs(core: httpx.Client) -> None:
    made = ok(core.post("/v1/tasks", json=task("deploy-hello", "hello.sh", "world")))
    done = wait_for(lambda: finished(core, made["id"]), timeout=60, interval=0.2)
    assert done["state"] == "succeeded", done
    log = core.get(f"/v1/tasks/{made['id']}/logs").text
    assert f"hello from task {made['id']} (attempt 1): world" in log
    # As a uid of its own (no name in /etc/passwd), in a folder of its own.
    assert "running as root" not in log and " in /var/lib/cairn/attempts/" in log, log


def a_diamond_workflow_succeeds(stack: Stack, core: httpx.Client) -> None:
    dag = stack.client("DAG")
    nodes = [
        {"name": "extract", "task": task("extract", "hello.sh", "extract {{ params.day }}")},
        {"name": "clean", "depends_on": ["extract"], "task": task("clean", "sleep.sh", "1")},
        {"name": "enrich", "depends_on": ["extract"], "task": task("enrich", "hello.sh")},
        {"name": "load", "depends_on": ["clean", "enrich"], "task": task("load", "hello.sh")},
    ]
    ok(dag.post("/v1/workflows", json={"name": "diamond", "params": {"day": "x"}, "nodes": nodes}))
    run = ok(dag.post("/v1/workflows/diamond/runs", json={"params": {"day": "2026-12-01"}}))

    def ended() -> dict[str, Any] | None:
        found: dict[str, Any] = ok(dag.get(f"/v1/runs/{run['id']}"))
        return found if found["state"] in ("succeeded", "failed", "cancelled") else None

    done = wait_for(ended, timeout=90, interval=0.3)
    assert done["state"] == "succeeded", done
    assert {n["name"]: n["state"] for n in done["nodes"]} == dict.fromkeys(
        ("extract", "clean", "enrich", "load"), "succeeded"
    )
    extract = next(n for n in done["nodes"] if n["name"] == "extract")
    assert "extract 2026-12-01" in core.get(f"/v1/tasks/{extract['task_id']}/logs").text


def the_dashboard_loads(stack: Stack) -> None:
    """The page and its script from a core replica, and cron answering the page's origin
    (the browser reads cron and dag on their published ports)."""
    page = httpx.get(f"{stack.url('CORE_2')}/ui", follow_redirects=True, timeout=10)
    assert page.status_code == 200 and "<title>" in page.text, page.text[:300]
    script = httpx.get(f"{stack.url('CORE_2')}/ui/static/app.js", timeout=10)
    assert script.status_code == 200 and len(script.text) > 1000
    origin = stack.url("CORE_1")
    preflight = httpx.options(
        f"{stack.url('CRON_1')}/v1/schedules",
        headers={"Origin": origin, "Access-Control-Request-Method": "GET"},
        timeout=10,
    )
    assert preflight.headers.get("access-control-allow-origin") == origin, preflight.headers


def spawn_helper_name() -> str:
    """The file name the agent looks for: the helper of this checkout's spawn.c."""
    source = images.ROOT / "services" / "worker" / "spawn.c"
    return f"cairn-spawn-{hashlib.sha256(source.read_bytes()).hexdigest()[:16]}"


def workers_are_isolated_and_hold_no_database_url(stack: Stack) -> None:
    """Each worker's agent said at start-up that attempts get uids, cgroups (every limit)
    and a private /tmp, and that the resident spawn helper starts them (the image's
    compiled one: it runs in the container, and no compiler is there); its environment has
    neither the database URL nor a token."""
    workers = stack.containers("worker")
    assert len(workers) == 2
    for container in workers:
        names = {item.partition("=")[0] for item in container["Config"]["Env"]}
        assert "CAIRN_DATABASE_URL" not in names and "CAIRN_TOKEN" not in names
        assert "CAIRN_TOKEN_FILE" in names
        logs = stack.engine.docker("logs", container["Id"])
        said = logs.stdout + logs.stderr
        notes = [line for line in said.splitlines() if "isolation: " in line]
        assert any("attempts run as uids 20000-29999" in n for n in notes), notes
        assert any("its own /tmp" in n for n in notes), notes
        assert any("enforces cpu, memory, pids" in n for n in notes), notes
        assert not any("not enforced" in n for n in notes), notes
        assert any("egress: attempts never reach 169.254.0.0/16" in n for n in notes), notes
        assert any("attempts are started by" in n and "spawn helper" in n for n in notes), notes
        assert not any("forked from the agent" in n for n in notes), notes
        # Some /proc entries cannot be read (gone, or not ours): readlink's status is not.
        exes = stack.engine.docker(
            "exec", container["Id"], "sh", "-c", "readlink /proc/[0-9]*/exe", check=False
        ).stdout.split()
        helpers = [exe for exe in exes if exe.endswith(f"/_bin/{spawn_helper_name()}")]
        assert helpers and all("/site-packages/services/worker/" in h for h in helpers), exes
        # The helper came from the build stage: the image itself holds no compiler.
        found = stack.engine.docker(
            "exec", container["Id"], "sh", "-c", "command -v cc gcc", check=False
        )
        assert found.stdout.strip() == "", found.stdout


def submit_chaos_batch(core: httpx.Client) -> dict[str, Any]:
    specs = [
        task(f"chaos-{i}", "sleep.sh", "3", idempotency_key=f"chaos-{i}", labels={"batch": "chaos"})
        for i in range(CHAOS_TASKS)
    ]
    made = ok(core.post("/v1/tasks/batch", json={"tasks": specs}))
    return {"specs": specs, "ids": sorted(t["id"] for t in made["tasks"])}


def cron_status(stack: Stack, port: str) -> dict[str, Any]:
    """The replica's status; not leading while it cannot answer, or answers 503 (while a
    core is being killed, the token check it asks of core may meet that core's reset
    connection: "try again")."""
    try:
        response = stack.client(port).get("/v1/cron/status")
    except httpx.TransportError:
        return {"leader": False}
    if response.status_code == 503:
        return {"leader": False}
    status: dict[str, Any] = ok(response)
    return status


def leading_cron(stack: Stack) -> tuple[dict[str, Any], dict[str, Any]]:
    one, two = stack.containers("cron-1")[0], stack.containers("cron-2")[0]
    if cron_status(stack, "CRON_1")["leader"]:
        return one, two
    assert cron_status(stack, "CRON_2")["leader"], "no cron replica leads"
    return two, one


def worker_running_one(stack: Stack, core: httpx.Client) -> dict[str, Any] | None:
    """A worker container with an attempt running, found by its hostname."""
    busy = {w["hostname"] for w in ok(core.get("/v1/workers"))["items"] if w["running"]}
    for container in stack.containers("worker"):
        if container["Config"]["Hostname"] in busy:
            return container
    return None


def finished(core: httpx.Client, task_id: int) -> dict[str, Any] | None:
    found: dict[str, Any] = ok(core.get(f"/v1/tasks/{task_id}"))
    return found if found["state"] in ("succeeded", "dead", "cancelled") else None


def nothing_lost_or_doubled(core: httpx.Client, ids: list[int]) -> None:
    """Every task of the batch succeeded once; the batch's label holds no more tasks."""
    for task_id in ids:
        done = wait_for(lambda t=task_id: finished(core, t), timeout=120, interval=0.5)
        assert done["state"] == "succeeded", done
        attempts = ok(core.get(f"/v1/tasks/{task_id}/attempts"))["items"]
        assert [a["outcome"] for a in attempts].count("succeeded") == 1, attempts
    listed = ok(core.get("/v1/tasks", params={"label": "batch=chaos", "limit": 100}))["items"]
    assert sorted(t["id"] for t in listed) == ids


def when(fire: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(fire["fire_time"])


def fires(stack: Stack, port: str, schedule_id: int) -> list[dict[str, Any]]:
    try:
        page = ok(stack.client(port).get(f"/v1/schedules/{schedule_id}/fires"))
    except httpx.TransportError:
        return []
    return sorted(page["items"], key=lambda f: f["fire_time"])


def one_task_per_slot(stack: Stack, port: str, core: httpx.Client, schedule_id: int) -> None:
    made = fires(stack, port, schedule_id)
    slots = [f["fire_time"] for f in made]
    assert len(slots) == len(set(slots)), made
    assert all(f["outcome"] == "submitted" and f["task_id"] for f in made), made
    tasks = ok(core.get("/v1/tasks", params={"limit": 100}))["items"]
    from_cron = sorted(t["id"] for t in tasks if t["name"] == "deploy-cron")
    assert from_cron == sorted(f["task_id"] for f in made)
    for task_id in from_cron:
        done = wait_for(lambda t=task_id: finished(core, t), timeout=60, interval=0.5)
        assert done["state"] == "succeeded", done


@pytest.fixture
def stack(engine: PrivateEngine) -> Any:
    made = Stack(engine, engine.root / "stack", project=f"cairn{engine.tag}")
    made.write_env()
    started = time.monotonic()
    made.up(workers=2)
    TIMES["stack up, every container healthy"] = time.monotonic() - started
    TIMES.update(made.timeline())
    began = time.monotonic()
    try:
        yield made
    finally:
        made.close()
        TIMES["the checks"] = time.monotonic() - began
