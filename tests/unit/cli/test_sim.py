"""``cairn trace`` and ``cairn sim``: the trace's shape, the simulator's bookkeeping, and
what fair share does to everyone else's wait when one owner floods."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

from typer.testing import CliRunner

from cairn.cli import app
from cairn.sim import Policy, Simulator, percentile, simulate
from cairn.trace import FLOOD_OWNER, Shape, cluster_for, generate, read, write

SMALL = Shape(users=200, tasks_per_user=100, hours=1.0, seed=3)


def test_a_trace_is_in_time_order_and_holds_its_services() -> None:
    subs = list(generate(SMALL))
    times = [s.t for s in subs]
    assert times == sorted(times)
    services = [s for s in subs if s.kind == "service"]
    assert len(services) == round(SMALL.users * SMALL.service_share)
    assert all(s.use_memory_mb <= s.memory_mb for s in subs)
    assert not any(s.owner == FLOOD_OWNER for s in subs)


def test_a_flood_is_one_owners_tasks_in_one_second() -> None:
    shape = Shape(users=50, hours=0.5, seed=1, flood_tasks=3000, flood_at_s=120)
    flood = [s for s in generate(shape) if s.owner == FLOOD_OWNER]
    assert len(flood) == 3000
    assert all(120 <= s.t < 121 for s in flood)
    assert {(s.priority, s.preemptible) for s in flood} == {(0, False)}


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    count = write(path, SMALL)
    meta, subs = read(path)
    assert meta["cluster"] == cluster_for(SMALL)
    assert meta["trace"]["users"] == 200
    assert sum(1 for _ in subs) == count


def test_percentile_of_nothing_is_zero_and_of_values_is_a_value() -> None:
    assert percentile([], 0.99) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0


def _flooded(fair: bool) -> dict[str, float]:
    shape = Shape(users=500, hours=0.5, seed=5, flood_tasks=2500, flood_at_s=300)
    return simulate({"cluster": cluster_for(shape)}, generate(shape), Policy(fair=fair))


def test_fair_share_keeps_a_flood_from_delaying_everyone_else() -> None:
    unfair, fair = _flooded(False), _flooded(True)
    assert unfair["flood_tasks"] == fair["flood_tasks"] == 2500
    assert unfair["peers_wait_p99_s"] > 600, "without it the others queue behind the flood"
    assert fair["peers_wait_p99_s"] < 60, "with it they interleave with the flood's head"
    # Work at a lower priority than the flood still waits for it: priority comes first.
    assert fair["others_wait_p99_s"] > fair["peers_wait_p99_s"]


def test_every_started_task_is_counted_once() -> None:
    meta = {"cluster": cluster_for(SMALL)}
    figures = simulate(meta, generate(SMALL), Policy())
    assert figures["started"] == figures["started"] // 1
    assert figures["completed"] <= figures["started"]
    assert 0 <= figures["placed_memory"] <= 1.0 + 1e-9


def test_the_commands_write_a_trace_and_report_on_it(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    runner = CliRunner()
    made = runner.invoke(
        app, ["trace", str(path), "--users", "100", "--hours", "0.5", "--flood", "500"]
    )
    assert made.exit_code == 0, made.output
    assert "submissions written" in made.output
    fair = runner.invoke(app, ["sim", str(path), "--json"])
    assert fair.exit_code == 0, fair.output
    figures = json.loads(fair.output)
    assert figures["flood_tasks"] > 0
    text = runner.invoke(app, ["sim", str(path), "--no-fair"])
    assert text.exit_code == 0 and "fair share off" in text.output
    assert "others (all but the flood)" in text.output


def test_the_simulator_places_by_label_as_the_claim_does(tmp_path: Path) -> None:
    base = next(s for s in generate(SMALL) if s.kind == "task")
    subs = [
        replace(base, t=float(i), duration_s=5.0, required=("disk=ssd",) if i % 2 else ())
        for i in range(40)
    ]
    nowhere = replace(base, t=40.0, required=("disk=nvme",))
    path = tmp_path / "trace.jsonl"
    meta = {"cluster": {"workers": 4, "cpu": 64, "memory_mb": 262144}}
    path.write_text("\n".join(json.dumps(x) for x in [meta, *map(asdict, [*subs, nowhere])]))
    sim = Simulator({**meta["cluster"], "labels": [{"disk": "ssd"}, {}]}, Policy())
    _, read_back = read(path)
    stats = sim.run(read_back)
    assert stats.never_started == 1  # disk=nvme: no worker has it
    started = [r for r in sim.runs.values() if r.sub.required == ["disk=ssd"]]
    assert len(started) == 20
    assert {sim.workers[r.worker or 0].labels.get("disk") for r in started if r.started} == {"ssd"}
    assert all(r.started is not None for r in started)
    runner = CliRunner()
    shown = runner.invoke(app, ["sim", str(path), "--worker-labels", "zone=a", "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["never_started"] == 21  # nobody has disk=ssd there


def test_the_simulator_counts_devices_as_the_claim_does(tmp_path: Path) -> None:
    base = next(s for s in generate(SMALL) if s.kind == "task")
    base = replace(base, preemptible=False, cpu=1.0, memory_mb=512, use_memory_mb=100.0)
    # Eight 2-GPU tasks of 100 s at once on two workers with 4 GPUs each (one without):
    # four run at a time, the other four after them; a 5-GPU task fits no worker.
    gpu = [replace(base, t=0.0, duration_s=100.0, devices={"gpu": 2}) for _ in range(8)]
    huge = replace(base, t=1.0, devices={"gpu": 5})
    tail = replace(base, t=400.0, duration_s=1.0)  # the clock runs past them all
    path = tmp_path / "trace.jsonl"
    meta = {"cluster": {"workers": 3, "cpu": 64, "memory_mb": 262144}}
    path.write_text("\n".join(json.dumps(x) for x in [meta, *map(asdict, [*gpu, huge, tail])]))
    sim = Simulator({**meta["cluster"], "devices": [{"gpu": 4}, {"gpu": 4}, {}]}, Policy())
    _, read_back = read(path)
    stats = sim.run(read_back)
    starts = sorted(r.started for r in sim.runs.values() if r.sub.devices == {"gpu": 2})
    assert starts == [0.0] * 4 + [100.0] * 4
    assert stats.never_started == 1  # gpu 5
    assert {sim.workers[r.worker or 0].id for r in sim.runs.values() if r.worker} <= {0, 1}
    runner = CliRunner()
    shown = runner.invoke(app, ["sim", str(path), "--worker-devices", "gpu=4", "--json"])
    assert shown.exit_code == 0, shown.output
    figures = json.loads(shown.output)
    # every worker with 4 GPUs: 1,600 GPU-seconds held over 400 s of 12 GPUs
    assert figures["never_started"] == 1 and round(figures["placed_gpu"], 6) == round(1 / 3, 6)
    text = runner.invoke(app, ["sim", str(path), "--worker-devices", "gpu=4"])
    assert "gpu 33%" in text.output
    refused = runner.invoke(app, ["sim", str(path), "--worker-devices", "gpu=x"])
    assert refused.exit_code != 0 and "--worker-devices" in refused.output
