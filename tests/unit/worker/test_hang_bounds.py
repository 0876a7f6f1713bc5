"""The hang bound's parts (docs/architecture.md, "An agent that hangs"): how often the
agent marks its pulse and takes a keep-alive turn, how fresh core keeps its stored times,
and when the sidecar acts, all inside the bound, so a healthy agent is never buried and a
hung one has its attempts killed before core re-places them."""

from __future__ import annotations

from libs.common.models import MAX_WAIT_S
from services.core.domain.workers import turn_fresh_s
from services.worker.agent import keepalive_after, pulse_every
from services.worker.sidecar import hung_after, watch_every


def test_the_keepalive_pulse_and_freshness_fit_inside_the_hang_bound() -> None:
    """A healthy agent's stored turn lags by at most a keep-alive, a pulse and the
    freshness; the sidecar acts (its bound and a check) before core can see a hang."""
    for hang_s in (2.0, 6.0, 60.0, 300.0, 3600.0):
        for timeout_s in (1.0, 3.0, 180.0, 10_000.0):
            fresh = turn_fresh_s(timeout_s, hang_s)
            lag = keepalive_after(hang_s) + pulse_every(hang_s) + fresh
            assert lag < hang_s / 2
            sidecar = hung_after(hang_s) + watch_every(60.0, hang_s)
            assert sidecar < hang_s - lag, (hang_s, timeout_s)
    # At the defaults an idle agent's claims (30 s) are its only turns.
    assert keepalive_after(300.0) > MAX_WAIT_S
