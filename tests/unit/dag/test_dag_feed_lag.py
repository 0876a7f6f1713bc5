"""cairn_dag_feed_lag_seconds: time since the DAG loop last reached the head of core's
feed, on the leader only."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.dag.metrics import DagMetrics


def lag(metrics: DagMetrics) -> float:
    text = generate_latest(metrics.metrics.registry).decode()
    [family] = [
        f for f in text_string_to_metric_families(text) if f.name == "cairn_dag_feed_lag_seconds"
    ]
    return float(family.samples[0].value)


def test_the_lag_grows_until_the_loop_catches_up_and_is_zero_off_the_lead() -> None:
    now = [100.0]
    leading = [False]
    metrics = DagMetrics(lambda: leading[0], clock=lambda: now[0])
    assert lag(metrics) == 0
    leading[0] = True
    assert lag(metrics) == 0  # the lead starts the count
    now[0] += 45
    assert lag(metrics) == 45
    metrics.caught_up()
    now[0] += 2
    assert lag(metrics) == 2
    leading[0] = False
    assert lag(metrics) == 0
    leading[0] = True
    now[0] += 7
    assert lag(metrics) == 0  # a new lead counts afresh
