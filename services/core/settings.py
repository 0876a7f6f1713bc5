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
