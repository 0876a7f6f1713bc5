"""A real Prometheus on 127.0.0.1 scraping a real `cairn up`, with deploy/prometheus/'s
rules: a task that keeps dying makes CairnDeadTasksGrowing fire (read through
Prometheus's HTTP API) and it resolves once no more die; every query of the rules, the
Grafana dashboard and the KEDA trigger evaluates; the docs' metric tables match what the
services export.

The rules run with their time windows scaled down 60 times (15m becomes 15s) so the test
takes seconds; the expressions and thresholds are the shipped ones."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.faults.system.test_cairn_up import _reap, _up, _wait_up, cron_port, dag_port
from tests.support import free_port, spec, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "cairn.json"
KEDA = ROOT / "deploy" / "keda" / "scaledobject.yaml"
DOCS = ROOT / "docs" / "observability.md"
FALSE = Path("/bin/false")

# Label names a Cairn metric may carry: bounded sets, never an id or an owner.
BOUNDED_LABELS = {"queue", "state", "outcome", "pool", "le", "quota", "reason", "when", "kind"}


def scaled(duration: str) -> str:
    """A Prometheus duration divided by 60 (at least a second)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    seconds = sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([smhd])", duration))
    return f"{max(1, seconds // 60)}s"


def scale_rules(text: str) -> dict[str, Any]:
    doc = yaml.safe_load(text)
    window = re.compile(r"(\[|offset )(\d+[smhd])")
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule["expr"] = window.sub(lambda m: m.group(1) + scaled(m.group(2)), rule["expr"])
            if "for" in rule:
                rule["for"] = scaled(rule["for"])
    return dict(doc)


@dataclass
class Stack:
    core: str
    cron: str
    dag: str
    prometheus: str
    headers: dict[str, str]

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = httpx.get(self.prometheus + "/api/v1/query", params={"query": expr}, timeout=10)
        body = answer.json()
        assert answer.status_code == 200 and body["status"] == "success", (expr, body)
        return list(body["data"]["result"])

    def alerts(self, name: str) -> list[dict[str, Any]]:
        body = httpx.get(self.prometheus + "/api/v1/alerts", timeout=10).json()
        return [a for a in body["data"]["alerts"] if a["labels"]["alertname"] == name]

    def firing(self, name: str) -> bool:
        return any(a["state"] == "firing" for a in self.alerts(name))


def prometheus_config(stack_ports: dict[str, int], rules: Path) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": f"cairn-{name}", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
            for name, port in stack_ports.items()
        ],
    }


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    root = Path(tempfile.mkdtemp(prefix="cairn-prom-test-"))
    port = free_port()
    up = _up(root / "home", port)
    prometheus: subprocess.Popen[bytes] | None = None
    log = (root / "prometheus.log").open("wb")
    try:
        _wait_up(up)
        token = (root / "home" / "admin-token").read_text().strip()
        ports = {"core": port, "cron": cron_port(port), "dag": dag_port(port)}
        rules = root / "rules.yml"
        rules.write_text(yaml.safe_dump(scale_rules(RULES.read_text())))
        config = root / "prometheus.yml"
        config.write_text(yaml.safe_dump(prometheus_config(ports, rules)))
        web = free_port()
        prometheus = subprocess.Popen(
            [
                shutil.which("prometheus") or "prometheus is missing: apt-get install prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={root / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{web}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        stack = Stack(
            core=f"http://127.0.0.1:{port}",
            cron=f"http://127.0.0.1:{ports['cron']}",
            dag=f"http://127.0.0.1:{ports['dag']}",
            prometheus=f"http://127.0.0.1:{web}",
            headers={"Authorization": f"Bearer {token}"},
        )
        wait_for(lambda: _ready(stack.prometheus), timeout=30, interval=0.2)
        yield stack
    finally:
        if prometheus is not None:
            prometheus.terminate()
            try:
                prometheus.wait(timeout=30)
            except subprocess.TimeoutExpired:
                prometheus.kill()
                prometheus.wait()
        log.close()
        _reap(up)
        shutil.rmtree(root, ignore_errors=True)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/-/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def targets_up(stack: Stack) -> bool:
    targets = httpx.get(stack.prometheus + "/api/v1/targets", timeout=10).json()
    active = targets["data"]["activeTargets"]
    return len(active) == 3 and all(t["health"] == "up" for t in active)


def test_a_task_that_keeps_dying_fires_the_dead_tasks_alert_until_it_stops(
    stack: Stack,
) -> None:
    wait_for(lambda: targets_up(stack), timeout=30, interval=0.2)
    assert not stack.firing("CairnDeadTasksGrowing")
    artifact = {"uri": FALSE.as_uri(), "sha256": hashlib.sha256(FALSE.read_bytes()).hexdigest()}
    body = spec(name="doomed", artifact=artifact, retry={"max_attempts": 1})
    with httpx.Client(base_url=stack.core, headers=stack.headers, timeout=10) as http:
        task = http.post("/v1/tasks", json=body).json()
        deaths = 0

        def died_again() -> bool:
            nonlocal deaths
            if http.get(f"/v1/tasks/{task['id']}").json()["state"] == "dead":
                deaths += 1
                http.post(f"/v1/tasks/{task['id']}/retry").raise_for_status()
            return stack.firing("CairnDeadTasksGrowing")

        wait_for(died_again, timeout=90, interval=0.1)
        assert deaths >= 5
        [alert] = stack.alerts("CairnDeadTasksGrowing")
        assert "cairn ls --state dead" in alert["annotations"]["summary"]
        # Left alone, the last retry dies once more, and then the series stops growing.
        wait_for(lambda: http.get(f"/v1/tasks/{task['id']}").json()["state"] == "dead")
    wait_for(lambda: not stack.alerts("CairnDeadTasksGrowing"), timeout=60, interval=0.5)
    [dead] = stack.query('sum(cairn_tasks_finished_total{state="dead"})')
    assert float(dead["value"][1]) == deaths + 1


def rule_expressions() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def dashboard_expressions() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def keda_expressions() -> list[str]:
    scaled_object = yaml.safe_load(KEDA.read_text())
    return [t["metadata"]["query"] for t in scaled_object["spec"]["triggers"]]


def grafana(expr: str) -> str:
    """Grafana's variables as Grafana would fill them in."""
    return expr.replace("$__rate_interval", "1m").replace("$queue", ".*")


def test_every_query_of_the_rules_dashboard_and_autoscaler_evaluates(stack: Stack) -> None:
    # A task parked in a queue no worker serves, and a schedule, make every gauge exist.
    with httpx.Client(base_url=stack.core, headers=stack.headers, timeout=10) as http:
        http.post("/v1/tasks", json=spec(name="parked", queue="parked")).raise_for_status()
    yearly = {
        "name": "yearly",
        "expression": "0 0 1 1 *",
        "target": {"kind": "task", "task": spec()},
    }
    with httpx.Client(base_url=stack.cron, headers=stack.headers, timeout=10) as http:
        http.post("/v1/schedules", json=yearly).raise_for_status()
    wait_for(lambda: stack.firing("CairnNoWorkerForQueue"), timeout=60, interval=0.5)
    wait_for(lambda: stack.query("cairn:queue_backlog"), timeout=30, interval=0.5)
    names = set(httpx.get(stack.prometheus + "/api/v1/label/__name__/values").json()["data"])
    expressions = rule_expressions() + dashboard_expressions() + keda_expressions()
    for expr in map(grafana, expressions):
        stack.query(expr)
        for name in re.findall(r"\b(cairn_[a-z_]+|cairn:[a-z0-9_:]+)", expr):
            assert name in names, f"{expr}: no series named {name}"
    rules = httpx.get(stack.prometheus + "/api/v1/rules").json()["data"]["groups"]
    health = {r["name"]: (r["health"], r.get("lastError")) for g in rules for r in g["rules"]}
    assert all(state == ("ok", None) or state == ("ok", "") for state in health.values()), health
    variable = httpx.get(
        stack.prometheus + "/api/v1/label/queue/values", params={"match[]": "cairn_queue_depth"}
    ).json()["data"]
    assert "parked" in variable


def documented() -> dict[str, set[str]]:
    """The metric names of each service's table in docs/observability.md."""
    tables: dict[str, set[str]] = {}
    section = None
    for line in DOCS.read_text().splitlines():
        if line.startswith("### "):
            section = line[4:].strip()
        elif section and line.startswith("| `"):
            first_cell = line.split("|")[1]
            tables.setdefault(section, set()).update(re.findall(r"`(cairn_[a-z_]+)`", first_cell))
    return tables


def exported(url: str) -> tuple[set[str], set[str]]:
    """Cairn's metric names at ``url``/metrics, and the label names their samples carry."""
    text = httpx.get(url + "/metrics", timeout=10).text
    names: set[str] = set()
    labels: set[str] = set()
    for family in text_string_to_metric_families(text):
        # The text format shows counters' and histograms' creation times as families.
        if family.name.startswith("cairn_") and not family.name.endswith("_created"):
            names.add(family.name + ("_total" if family.type == "counter" else ""))
            labels.update(key for sample in family.samples for key in sample.labels)
    return names, labels


def test_the_docs_tables_are_what_the_services_export_with_bounded_labels(stack: Stack) -> None:
    tables = documented()
    shared = tables["every service"]
    for service in ("core", "cron", "dag"):
        names, labels = exported(getattr(stack, service))
        assert names == tables[service] | shared, service
        assert labels <= BOUNDED_LABELS, (service, labels - BOUNDED_LABELS)
