"""Core's settings: the shared ones plus what only core reads."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from libs.common.settings import CairnSettings
from libs.common.sources import parse_sources


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

    #: URI prefixes artifacts may come from (``s3://jobs-bucket/,https://artifacts.corp/``);
    #: empty: any source (development only)
    artifact_sources: str = ""

    @field_validator("artifact_sources")
    @classmethod
    def _check_sources(cls, value: str) -> str:
        parse_sources(value)
        return value

    @model_validator(mode="after")
    def _sources_in_production(self) -> CoreSettings:
        if self.env == "production" and not self.artifact_sources:
            raise ValueError("CAIRN_ARTIFACT_SOURCES is required when CAIRN_ENV=production")
        return self

    @property
    def sources(self) -> tuple[str, ...]:
        return parse_sources(self.artifact_sources)
