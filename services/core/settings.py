"""Core's settings: the shared ones plus what only core reads."""

from __future__ import annotations

from pydantic import Field

from libs.common.settings import CairnSettings


class CoreSettings(CairnSettings):
    """``CAIRN_*`` environment variables read by core."""

    retention_days: float = Field(default=30.0, gt=0)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    db_pool_size: int = Field(default=20, ge=1, le=200)
    promote_interval_s: float = Field(default=1.0, gt=0)
    retention_interval_s: float = Field(default=300.0, gt=0)
    retention_batch: int = Field(default=500, ge=1, le=10000)
    token_cache_s: float = Field(default=30.0, ge=0)
    migrate_on_start: bool = True

    # placement (see docs/placement.md)
    overcommit_ratio: float = Field(default=1.0, ge=1, le=10)
    defer_above: float = Field(default=0.8, gt=0, le=1)
    defer_max_s: float = Field(default=6 * 3600.0, gt=0)
    defer_margin_s: float = Field(default=600.0, ge=0)
    preempt_after_s: float = Field(default=5.0, ge=0)
    preempt_grace_s: float = Field(default=10.0, ge=0, le=3600)
    placement_interval_s: float = Field(default=1.0, gt=0)

    # notifications (see docs/notifications.md)
    notify_interval_s: float = Field(default=0.5, gt=0)
    notify_batch: int = Field(default=100, ge=1, le=1000)
    notify_timeout_s: float = Field(default=10.0, gt=0, le=300)
    notify_lease_s: float | None = Field(default=None, gt=0)
    notify_max_tries: int = Field(default=12, ge=1, le=100)
    notify_backoff_base_s: float = Field(default=5.0, gt=0)
    notify_backoff_cap_s: float = Field(default=3600.0, gt=0)
    notify_disable_after: int = Field(default=20, ge=1, le=10000)
    notify_allow_http: bool = False

    @property
    def notify_lease(self) -> float:
        """How long a replica holds a delivery it sends: unset, well past the timeout,
        which bounds the whole exchange."""
        if self.notify_lease_s is not None:
            return self.notify_lease_s
        return self.notify_timeout_s * 2 + 5
