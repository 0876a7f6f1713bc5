"""The cron service's settings: the shared ones plus what only cron reads."""

from __future__ import annotations

from pydantic import Field, model_validator

from libs.common.settings import CairnSettings


class CronSettings(CairnSettings):
    """``CAIRN_*`` environment variables read by the cron service. ``CAIRN_TOKEN`` is its
    own token (role ``service``), with which it submits for each schedule's owner."""

    db_pool_size: int = Field(default=10, ge=2, le=200)
    max_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    token_cache_s: float = Field(default=30.0, ge=0)
    #: how long a caller's token check waits for core's answer before a 503
    token_check_timeout_s: float = Field(default=5.0, gt=0, le=120)
    migrate_on_start: bool = True
    # How often a standby tries to take the lead, and the leader checks it still holds it.
    cron_leader_poll_s: float = Field(default=1.0, gt=0)
    # The longest the engine sleeps before looking at the clock again: it bounds how late
    # a fire can be after the wall clock jumps forward.
    cron_tick_s: float = Field(default=1.0, gt=0)
    # Tasks submitted to core per request when many schedules fire at once.
    cron_submit_chunk: int = Field(default=500, ge=1, le=1000)
    # Fires of task targets (overlap allow) are sent this long before their slot, with
    # run_at = the slot: a burst is spread over the lead, and core starts each on time.
    # 0: sent at the slot.
    cron_lead_s: float = Field(default=30.0, ge=0, le=3600)
    # Backfill: the most slots one request may fire, and the fires sent per second.
    cron_backfill_max: int = Field(default=1000, ge=1, le=100_000)
    cron_backfill_rate: float = Field(default=10.0, gt=0, le=10_000)
    # How often the leader looks for pending fires it was not told of (a manual trigger or
    # a backfill whose API process died before sending), and how long its fire loop may go
    # without a turn before /readyz reports it stalled.
    cron_pending_scan_s: float = Field(default=30.0, gt=0)
    cron_stall_s: float = Field(default=60.0, gt=0)
    # Longest pause between tries of a submission while core cannot be reached.
    cron_retry_max_s: float = Field(default=30.0, gt=0)
    cron_fire_retention_days: float = Field(default=30.0, gt=0)
    cron_max_schedules_per_owner: int = Field(default=10_000, ge=1)
    # "<anchor unix seconds>,<virtual ISO instant>,<speed>": a fast clock, for tests and
    # rehearsals only (refused in production).
    cron_clock_warp: str | None = None

    @model_validator(mode="after")
    def _stall_past_the_tick(self) -> CronSettings:
        # An idle fire loop turns once a tick: a stall bound within two of them would
        # have /readyz say "stalled" between healthy turns, flapping.
        if self.cron_stall_s <= 2 * self.cron_tick_s:
            raise ValueError(
                f"CAIRN_CRON_STALL_S ({self.cron_stall_s:g}) must be more than twice"
                f" CAIRN_CRON_TICK_S ({self.cron_tick_s:g}): an idle engine turns once a"
                " tick, and readiness would call it stalled between turns"
            )
        return self

    @model_validator(mode="after")
    def _no_warp_in_production(self) -> CronSettings:
        if self.env == "production" and self.cron_clock_warp:
            raise ValueError("CAIRN_CRON_CLOCK_WARP is for tests; it is refused in production")
        return self
