"""Prometheus metrics, the same shape on every service: a registry per application (tests
run several applications in one process), counters and histograms bumped where things
happen, and gauges read from the database when ``/metrics`` is scraped.

Label values are bounded: queue names, states, outcomes; never a task, run or worker id.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator

from fastapi import APIRouter, Request, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

log = logging.getLogger("cairn.metrics")

# Latencies from a millisecond to a minute: dispatch, fire lag, release.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

Reader = Callable[[AsyncConnection], Awaitable[Iterable[Metric]]]


class _Snapshot(Collector):
    """Yields what the last scrape read from the database."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self) -> Iterator[Metric]:
        yield from self.families


class Metrics:
    """One application's metrics. ``readers`` run at scrape time, on one connection."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry(auto_describe=True)
        self._readers: list[Reader] = []
        self._snapshot = _Snapshot()
        self.registry.register(self._snapshot)
        ProcessCollector(registry=self.registry)
        self.database_up = self.gauge(
            "cairn_metrics_database_up", "1 if the last scrape read the database, else 0"
        )

    def counter(self, name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
        return Counter(name, doc, list(labels), registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Iterable[str] = ()) -> Gauge:
        return Gauge(name, doc, list(labels), registry=self.registry)

    def histogram(self, name: str, doc: str, labels: Iterable[str] = ()) -> Histogram:
        return Histogram(name, doc, list(labels), buckets=LATENCY_BUCKETS, registry=self.registry)

    def read_at_scrape(self, reader: Reader) -> None:
        self._readers.append(reader)

    async def render(self, engine: AsyncEngine | None) -> bytes:
        """The exposition text; database gauges are left out while it cannot be read."""
        families: list[Metric] = []
        if engine is not None and self._readers:
            try:
                async with engine.connect() as conn:
                    for read in self._readers:
                        families.extend(await read(conn))
                self.database_up.set(1)
            except (DBAPIError, OSError) as exc:
                log.warning("metrics: database gauges unavailable: %r", exc)
                families = []
                self.database_up.set(0)
        self._snapshot.families = families
        return generate_latest(self.registry)


def gauge_family(
    name: str, doc: str, labels: list[str], rows: Iterable[tuple[tuple[str, ...], float]]
) -> GaugeMetricFamily:
    """A gauge family from ``(label values, value)`` pairs."""
    family = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in rows:
        family.add_metric(list(values), value)
    return family


router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
    include_in_schema=False,
)
async def metrics(request: Request) -> Response:
    """Prometheus exposition of this process's metrics."""
    found: Metrics = request.app.state.metrics
    engine: AsyncEngine | None = getattr(request.app.state, "engine", None)
    return Response(await found.render(engine), media_type=CONTENT_TYPE_LATEST)
