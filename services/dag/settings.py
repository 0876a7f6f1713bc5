"""The DAG service's settings: the shared ones plus what only it reads."""

from __future__ import annotations

from pydantic import Field

from libs.common.settings import CairnSettings


class DagSettings(CairnSettings):
    """``CAIRN_*`` environment variables read by the DAG service. ``CAIRN_TOKEN`` is its
    own token of role ``service``: it reads core's feed and submits for the run's owner."""

    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    db_pool_size: int = Field(default=10, ge=1, le=200)
    token_cache_s: float = Field(default=30.0, ge=0)
    #: how long a caller's token check waits for core's answer before a 503
    token_check_timeout_s: float = Field(default=5.0, gt=0, le=120)
    migrate_on_start: bool = True
    #: how long one read of core's feed waits for events
    feed_wait_s: float = Field(default=10.0, ge=0, le=30)
    feed_page: int = Field(default=1000, ge=1, le=1000)
    #: first pause after core failed or could not be reached; doubles up to the cap
    retry_base_s: float = Field(default=0.5, gt=0)
    retry_cap_s: float = Field(default=15.0, gt=0)
    #: a release batch's encoded tasks stay under this (core refuses bodies over its own
    #: CAIRN_MAX_BODY_BYTES, 8 MiB by default; a refused batch is halved)
    release_batch_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    #: finished runs (with their nodes) are deleted this long after they end
    retention_days: float = Field(default=30.0, gt=0)
    retention_interval_s: float = Field(default=600.0, gt=0)
    #: anti-entropy: this often, nodes released, running or cancelling unchanged for as
    #: long have their tasks read from core (``GET /v1/tasks/ID``), so an outcome the feed
    #: never delivered (core's retention purged the task or its events first) is not lost
    dag_resync_s: float = Field(default=60.0, gt=0)
    #: nodes checked in one pass (a full pass goes on at the next turn)
    dag_resync_batch: int = Field(default=200, ge=1, le=1000)
    #: parsed definitions kept in memory (versions never change)
    graph_cache: int = Field(default=256, ge=1)
    #: and the memory they may take (estimated; a 10,000-node definition is about 40 MB)
    graph_cache_mb: int = Field(default=256, ge=1)
    #: a trigger delivery's ``X-Cairn-Timestamp`` may be this far from now (replays of
    #: one within it answer the run it started)
    trigger_tolerance_s: int = Field(default=300, ge=1, le=3600)
