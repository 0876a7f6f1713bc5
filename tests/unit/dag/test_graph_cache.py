"""Parsed definitions: parsing a large one leaves the event loop free, and the cache holds
no more than its memory bound."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from services.dag import engine as dag_engine
from services.dag import store
from services.dag.engine import Graphs, parse
from tests.support import TRUE_SHA


def _definition(nodes: int, name: str = "big") -> dict[str, Any]:
    artifact = {"uri": "file:///bin/true", "sha256": TRUE_SHA}
    return {
        "name": name,
        "nodes": [
            {"name": f"n{i}", "task": {"artifact": artifact}, "depends_on": [f"n{i - 1}"] * bool(i)}
            for i in range(nodes)
        ],
    }


def test_parsing_a_large_definition_leaves_the_event_loop_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    definition = _definition(10_000)  # the bound on nodes

    async def workflow_by_id(_conn: Any, _id: int) -> Any:
        return SimpleNamespace(definition=definition)

    monkeypatch.setattr(store, "workflow_by_id", workflow_by_id)

    # Measured in the process's CPU time, not the wall clock: what the code controls is how
    # much of the parse runs while the loop is shut out (a parse holding the GIL burns CPU
    # through the whole gap); a loaded machine that deschedules the process stretches the
    # wall-clock gaps without the loop being blocked, and failed this test in CI at load 3.
    # Parsed on the loop itself, the worst gap is the whole parse; in its thread, the
    # longest single step (about 70 ms of 250 here).
    async def scenario() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        gaps: list[float] = []
        done = asyncio.Event()

        async def tick() -> None:
            last = time.process_time()
            while not done.is_set():
                await asyncio.sleep(0.01)
                gaps.append(time.process_time() - last)
                last = time.process_time()

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)  # the ticker has taken its first reading
        started = time.process_time()
        dag = await Graphs(8).get(None, 1)  # type: ignore[arg-type]
        took = time.process_time() - started
        done.set()
        await ticker
        assert len(dag.order) == 10_000
        assert loop.is_running()
        return took, max(gaps)

    took, worst = asyncio.run(scenario())
    assert worst < took / 2, (took, worst)


def test_the_cache_is_bounded_by_memory_least_recently_used_first_out() -> None:
    dags = {i: parse(_definition(200, f"w{i}")) for i in range(4)}
    weight = dags[0][1]
    assert weight > 200 * dag_engine._BYTES_PER_NODE
    cache = Graphs(size=100, max_bytes=int(weight * 2.5))
    for i, (dag, w) in dags.items():
        cache.put(i, dag, w)
    assert len(cache) == 2 and cache.bytes <= cache.max_bytes
    assert set(cache._dags) == {2, 3}
    cache.put(9, dags[0][0], cache.max_bytes + 1)  # larger than the bound: not kept
    assert 9 not in cache._dags and cache.bytes <= cache.max_bytes
