"""The cron service's metrics: fires by outcome and their lag (counted where the engine
records them), leadership, and the schedules the database holds (read at scrape time)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime

from prometheus_client.core import Metric
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.metrics import Metrics, gauge_family
from services.cron import store

OUTCOMES = ("submitted", "failed", "pending", "missed", "skipped_overlap", "withdrawn")


class CronMetrics:
    def __init__(self, is_leader: Callable[[], bool]) -> None:
        m = self.metrics = Metrics("cron")
        self.fires = m.counter(
            "cairn_cron_fires_total",
            "Fires recorded, by outcome (submitted, failed, pending, missed, skipped_overlap,"
            " withdrawn: sent ahead, then cancelled by a change before the slot)",
            ["outcome"],
        )
        self.lag = m.histogram(
            "cairn_cron_fire_lag_seconds",
            "From a slot's fire time to its submission (0 for fires sent ahead of the slot)",
        )
        leader = m.gauge("cairn_cron_leader", "1 while this replica leads and fires schedules")
        leader.set_function(lambda: float(is_leader()))
        for outcome in OUTCOMES:
            self.fires.labels(outcome)
        m.read_at_scrape(read_schedules)

    def fired(self, fires: Iterable[tuple[str, datetime, datetime | None]]) -> None:
        """``(outcome, fire time, submitted at)`` of each fire recorded."""
        for outcome, fire_time, submitted_at in fires:
            self.fires.labels(outcome).inc()
            if outcome == "submitted" and submitted_at is not None:
                self.lag.observe(max(0.0, (submitted_at - fire_time).total_seconds()))

    def withdrawn(self, count: int) -> None:
        self.fires.labels("withdrawn").inc(count)


async def read_schedules(conn: AsyncConnection) -> list[Metric]:
    rows = [((state,), float(n)) for state, n in (await store.schedule_counts(conn)).items()]
    return [gauge_family("cairn_cron_schedules", "Schedules by state", ["state"], rows)]
