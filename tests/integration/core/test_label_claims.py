"""Placement by label over real HTTP and the real claim SQL, with several workers' labels:
a worker leases only the tasks whose required selectors its labels meet; a task no live
worker can take says which selector; preferences order, spreads and anti-affinity admit;
bad selectors are 422s naming the field (docs/placement.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from cairn.cli import app
from services.core.domain import selectors
from tests.support import Core, cli_as, register_worker, spec

LABELS = {
    "ssd-a": {"disk": "ssd", "zone": "a"},
    "hdd-b": {"disk": "hdd", "zone": "b"},
    "gpu-c": {"zone": "c", "gpu": "1"},
    "bare": {},
}
REQUIRED = {
    "ssd": ["disk=ssd"],
    "zone": ["zone in (a, b)"],
    "gpu": ["gpu exists"],
    "notc": ["zone!=c"],
    "nogpu": ["!gpu", "zone notin (a,b)"],
    "plain": [],
}
# By hand, as Kubernetes reads them: != and notin hold for a worker without the label.
TAKES = {
    "ssd-a": {"ssd", "zone", "notc", "plain"},
    "hdd-b": {"zone", "notc", "plain"},
    "gpu-c": {"gpu", "plain"},
    "bare": {"notc", "nogpu", "plain"},
}


class Fleet:
    """Workers registered with labels, each claiming over HTTP."""

    def __init__(self, core: Core, stack: ExitStack) -> None:
        self.core, self.stack, self.ids = core, stack, {}
        self.http: dict[str, httpx.Client] = {}

    def add(self, name: str, labels: dict[str, str], hostname: str | None = None) -> None:
        http = self.stack.enter_context(self.core.client(f"agent-{name}", "worker"))
        offer = {
            "hostname": hostname or name,
            "queues": ["default"],
            "labels": labels,
            "cpu": 64,
            "memory_mb": 65536,
        }
        self.ids[name] = register_worker(http, offer)
        self.http[name] = http

    def claim(self, name: str, most: int = 64) -> list[int]:
        room = {"cpu": 64, "memory_mb": 65536, "max": most}
        answer = self.http[name].post(f"/v1/workers/{self.ids[name]}/claim", json=room)
        assert answer.status_code == 200, answer.text
        return [a["task_id"] for a in answer.json()["attempts"]]


def placed(required: list[str] | None = None, **more: Any) -> dict[str, Any]:
    return {"required": required or [], **more}


@pytest.fixture
def fleet(core: Core) -> Iterator[Fleet]:
    with ExitStack() as stack:
        yield Fleet(core, stack)


def test_a_worker_leases_only_the_tasks_whose_required_selectors_its_labels_meet(
    core: Core, fleet: Fleet
) -> None:
    for name, labels in LABELS.items():
        fleet.add(name, labels)
    with core.client() as alice:
        for worker, labels in LABELS.items():
            ids = {}
            for case, required in REQUIRED.items():
                body = spec(name=case, placement=placed(required))
                ids[alice.post("/v1/tasks", json=body).raise_for_status().json()["id"]] = case
            taken = {ids[t] for t in fleet.claim(worker)}
            parsed = {c: [selectors.parse(s) for s in r] for c, r in REQUIRED.items()}
            assert taken == TAKES[worker]
            assert taken == {c for c, s in parsed.items() if selectors.matches(s, labels)}
            for task_id, case in ids.items():
                task = alice.get(f"/v1/tasks/{task_id}").json()
                assert task["state"] == ("running" if case in taken else "waiting"), case
                assert task["placement"]["required"] == REQUIRED[case]
                if task["state"] == "waiting":
                    alice.post(f"/v1/tasks/{task_id}/cancel").raise_for_status()


def test_a_task_no_live_worker_can_take_names_the_unmatched_selector(
    core: Core, fleet: Fleet
) -> None:
    fleet.add("ssd-a", LABELS["ssd-a"])
    fleet.add("hdd-b", LABELS["hdd-b"])
    with core.client() as alice:

        def reason(required: list[str]) -> str:
            body = spec(placement=placed(required))
            task = alice.post("/v1/tasks", json=body).raise_for_status().json()
            return str(alice.get(f"/v1/tasks/{task['id']}").json()["pending_reason"])

        assert reason(["disk=nvme"]) == "no live worker matches disk=nvme (queue default)"
        assert reason(["disk=ssd", "zone=b"]) == (
            "no live worker matches all of disk=ssd, zone=b (queue default)"
        )
        assert reason(["disk in (ssd,hdd)"]) == "fits a worker; waiting for its next claim"


def test_bad_selectors_are_refused_naming_the_field(core: Core) -> None:
    with core.client() as alice:
        bad = alice.post("/v1/tasks", json=spec(placement=placed(["disk=ssd", "zone in a"])))
        assert bad.status_code == 422, bad.text
        assert bad.json()["errors"][0]["field"] == "body.placement.required.1"
        assert "zone in a" in bad.json()["detail"]
        body = spec(placement={"preferred": [{"selector": "=x", "weight": 5}]})
        batch = alice.post("/v1/tasks/batch", json={"tasks": [spec(), body]})
        assert batch.status_code == 422, batch.text
        assert batch.json()["errors"][0]["field"] == "body.tasks.1.placement.preferred.0.selector"
        both = placed(spread={"by": "zone"}, anti_affinity="host")
        answer = alice.post("/v1/tasks", json=spec(placement=both))
        assert answer.status_code == 422
        assert answer.json()["errors"][0]["field"] == "body.placement.anti_affinity"
        many = placed([f"k{i}=v" for i in range(17)])
        assert alice.post("/v1/tasks", json=spec(placement=many)).status_code == 422
        assert alice.get("/v1/tasks").json()["items"] == []


def test_preferred_selectors_order_work_of_one_priority(core: Core, fleet: Fleet) -> None:
    fleet.add("a", {"zone": "a"})
    fleet.add("b", {"zone": "b"})
    with core.client() as alice:
        first = alice.post("/v1/tasks", json=spec()).json()["id"]
        prefer = {"preferred": [{"selector": "zone=b", "weight": 10}]}
        second = alice.post("/v1/tasks", json=spec(placement=prefer)).json()["id"]
        assert fleet.claim("b", most=1) == [second]
        assert fleet.claim("a", most=1) == [first]


def test_replicas_spread_across_a_label_and_apart_by_host(core: Core, fleet: Fleet) -> None:
    fleet.add("a1", {"zone": "a"})
    fleet.add("a2", {"zone": "a"})
    fleet.add("b1", {"zone": "b"})
    fleet.add("b1-again", {"zone": "b"}, hostname="b1")
    fleet.add("none", {})
    with core.client() as alice:
        spread = placed(spread={"by": "zone"})
        body = spec(name="web", kind="service", placement=spread)
        for _ in range(4):
            alice.post("/v1/tasks", json=body).raise_for_status()
        assert len(fleet.claim("a1")) == 1  # zone a 1, b 0: another in a is a skew of 2
        assert fleet.claim("a2") == []
        assert fleet.claim("none") == []  # no zone label: no domain of the spread
        assert len(fleet.claim("b1")) == 2  # b 1 (a 1), then b 2: a skew of 1
        assert len(fleet.claim("a2")) == 1  # a 2, b 2

        apart = spec(name="db", kind="service", placement=placed(anti_affinity="host"))
        for _ in range(2):
            alice.post("/v1/tasks", json=apart).raise_for_status()
        assert len(fleet.claim("b1")) == 1
        assert fleet.claim("b1-again") == []  # the same host
        assert len(fleet.claim("none")) == 1


def test_the_cli_submits_a_placement_and_shows_it(
    core: Core, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cli = cli_as(core, monkeypatch, tmp_path)
    flags = ["--select", "disk=ssd", "--select", "zone in (a,b)", "--prefer", "5:zone=b"]
    flags += ["--prefer", "gpu exists", "--spread-by", "zone"]
    done = cli.invoke(app, ["--json", "submit", "t", "--artifact", "file:///bin/true", *flags])
    assert done.exit_code == 0, done.output
    task = json.loads(done.output)
    assert task["placement"] == {
        "required": ["disk=ssd", "zone in (a,b)"],
        "preferred": [{"selector": "zone=b", "weight": 5}, {"selector": "gpu exists", "weight": 1}],
        "spread": {"by": "zone", "max_skew": 1},
        "anti_affinity": None,
    }
    shown = cli.invoke(app, ["show", str(task["id"])])
    assert "requires disk=ssd, zone in (a,b); prefers zone=b (5)" in shown.output
    refused = cli.invoke(app, ["submit", "t", "--artifact", "file:///bin/true", "--select", "a b"])
    assert refused.exit_code != 0
    assert "placement.required.0" in refused.output
