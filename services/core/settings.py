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

    # sharing (see docs/sharing.md)
    fair_quantum_s: float = Field(default=1.0, gt=0, le=3600)
    aging_s: float = Field(default=60.0, gt=0)
    aging_max: int = Field(default=200, ge=0, le=200)
    sharing_cache_s: float = Field(default=5.0, ge=0, le=300)
