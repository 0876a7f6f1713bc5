"""The DAG service's metrics: runs by state (read at scrape time), how long a ready node
waits to be released to core, and the loop's leadership."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client.core import Metric
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.dag_models import RUN_ACTIVE, RUN_FINAL, NodeState
from libs.common.metrics import Metrics, gauge_family
from services.dag import store


class DagMetrics:
    def __init__(
        self, is_leader: Callable[[], bool], clock: Callable[[], float] = time.monotonic
    ) -> None:
        m = self.metrics = Metrics("dag")
        self.release_latency = m.histogram(
            "cairn_dag_release_latency_seconds",
            "From a node becoming ready (its rule met) to its task accepted by core",
        )
        self.released = m.counter("cairn_dag_nodes_released_total", "Nodes released to core")
        self.finished = m.counter(
            "cairn_dag_runs_finished_total",
            "Runs ended by the loop, by state (succeeded, failed)",
            ["state"],
        )
        for state in RUN_FINAL:
            self.finished.labels(state.value)
        self.timed_out = m.counter(
            "cairn_dag_runs_timed_out_total", "Runs failed by their timeout_s"
        )
        self.mapped = m.counter(
            "cairn_dag_map_instances_total", "Instances made by mapped nodes (one per item)"
        )
        leader = m.gauge("cairn_dag_leader", "1 while this replica runs the DAG loop")
        leader.set_function(lambda: float(is_leader()))
        self._is_leader = is_leader
        self._clock = clock
        self._caught_up: float | None = None
        lag = m.gauge(
            "cairn_dag_feed_lag_seconds",
            "Seconds since the DAG loop last read core's event feed up to its head (0 off the lead)",
        )
        lag.set_function(self._feed_lag)
        m.read_at_scrape(read_runs)

    def caught_up(self) -> None:
        """The loop read a page that reached the head of core's feed."""
        self._caught_up = self._clock()

    def _feed_lag(self) -> float:
        # Counted from the first scrape of a new lead until the loop first reaches the head.
        if not self._is_leader():
            self._caught_up = None
            return 0.0
        if self._caught_up is None:
            self._caught_up = self._clock()
        return self._clock() - self._caught_up


async def read_runs(conn: AsyncConnection) -> list[Metric]:
    runs, nodes = await store.live_counts(conn)
    return [
        gauge_family(
            "cairn_dag_runs",
            "Live runs by state (queued, running)",
            ["state"],
            [((s.value,), runs.get(s, 0.0)) for s in RUN_ACTIVE],
        ),
        gauge_family(
            "cairn_dag_live_nodes",
            "Nodes of unfinished runs, by state",
            ["state"],
            [((s.value,), nodes.get(s, 0.0)) for s in NodeState],
        ),
    ]
