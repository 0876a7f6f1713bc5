"""One word for each state and outcome (libs/common/states.py), read by the wire models,
the tables' constraints, the outcome rules and the metrics; the simulator reads the
claim's depth from core instead of describing it."""

from __future__ import annotations

from typing import get_args

from prometheus_client import generate_latest

from cairn import sim
from libs.common import models
from libs.common.states import ATTEMPT_OUTCOMES, REPORTED_OUTCOMES, WORKER_STATES, Workers
from services.core.db import tables
from services.core.domain import outcomes
from services.core.domain.placement import claim_depth
from services.core.ops.metrics import CoreMetrics
from services.worker.settings import WorkerSettings


def test_the_wire_models_use_the_states_words() -> None:
    for model in (models.Worker, models.HeartbeatAnswer, models.TurnAnswer):
        state = model.model_fields.get("state")
        if state is not None:
            assert get_args(state.annotation) == WORKER_STATES, model
    assert get_args(models.Report.model_fields["outcome"].annotation) == REPORTED_OUTCOMES


def test_every_reported_outcome_has_a_rule_and_every_outcome_is_in_the_constraint() -> None:
    assert set(outcomes.OUTCOMES) == set(REPORTED_OUTCOMES)
    assert set(REPORTED_OUTCOMES) < set(ATTEMPT_OUTCOMES)
    checks = " ".join(str(c.sqltext) for c in tables.attempts.constraints if hasattr(c, "sqltext"))
    for outcome in ATTEMPT_OUTCOMES:
        assert f"'{outcome}'" in checks
    states = " ".join(str(c.sqltext) for c in tables.workers.constraints if hasattr(c, "sqltext"))
    for state in WORKER_STATES:
        assert f"'{state}'" in states
    assert set(Workers.PRESENT) | set(Workers.GONE) == set(WORKER_STATES)


def test_the_metrics_know_every_outcome_before_the_first_oom_kill() -> None:
    exposed = generate_latest(CoreMetrics().metrics.registry).decode()
    for outcome in ATTEMPT_OUTCOMES:
        assert f'cairn_attempts_finished_total{{outcome="{outcome}"}} 0.0' in exposed


def test_the_worker_offer_settings_are_defined_once() -> None:
    from libs.common.settings import CairnSettings, WorkerOfferSettings

    offer = set(WorkerOfferSettings.model_fields)
    assert offer <= set(CairnSettings.model_fields) and offer <= set(WorkerSettings.model_fields)
    for name in offer:
        assert name not in vars(CairnSettings).get("__annotations__", {})
        assert name not in vars(WorkerSettings).get("__annotations__", {})


def test_the_simulator_reads_as_deep_as_a_claim() -> None:
    assert claim_depth(sim.MOST) == sim.HEAD
