"""The cron service's own settings checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.cron.settings import CronSettings


@pytest.mark.parametrize(("stall", "tick"), [(1.0, 1.0), (2.0, 1.0), (0.5, 1.0), (10.0, 5.0)])
def test_a_stall_bound_within_two_ticks_is_refused_naming_both(stall: float, tick: float) -> None:
    with pytest.raises(ValidationError) as refused:
        CronSettings(cron_stall_s=stall, cron_tick_s=tick)
    message = str(refused.value)
    assert "CAIRN_CRON_STALL_S" in message and "CAIRN_CRON_TICK_S" in message


def test_a_stall_bound_past_two_ticks_is_taken() -> None:
    settings = CronSettings(cron_stall_s=2.5, cron_tick_s=1.0)
    assert settings.cron_stall_s == 2.5
    assert CronSettings().cron_stall_s > 2 * CronSettings().cron_tick_s
