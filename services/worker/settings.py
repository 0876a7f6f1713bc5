"""The worker agent's settings (``CAIRN_*``). A worker never holds the database URL: what
it needs of core comes over the HTTP API, with a worker token."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from libs.common.loglimit import DEFAULT_LOG_MAX_BYTES, LogMaxBytes
from libs.common.models import WorkerRegister
from libs.common.settings import (
    HomePath,
    HttpUrl,
    LogLevel,
    WorkerOfferSettings,
    parse_devices,
    parse_labels,
    parse_list,
)
from libs.common.sources import parse_sources
from services.worker.devices import node_rule
from services.worker.firewall import parse_blocked

#: ``worker_source_timeout_s``'s default: a healthy local open takes microseconds
SOURCE_TIMEOUT_S = 5.0


#: the variable behind each field of the offer (``WorkerRegister``)
_OFFERED = {
    "queues": "CAIRN_WORKER_QUEUES",
    "labels": "CAIRN_WORKER_LABELS",
    "cpu": "CAIRN_WORKER_CPU",
    "memory_mb": "CAIRN_WORKER_MEMORY_MB",
    "devices": "CAIRN_WORKER_DEVICES",
}


class WorkerSettings(WorkerOfferSettings):
    """``CAIRN_*`` environment variables read by the worker agent and its sidecar."""

    env: Literal["development", "production"] = "development"
    home: HomePath = Field(default_factory=lambda: Path.home() / ".cairn")
    url: HttpUrl = "http://127.0.0.1:8400"
    #: the worker token, or (better) a 0600 file holding it
    token: str | None = None
    token_file: Path | None = None
    log_level: LogLevel = "info"

    #: lease delayed work this many seconds before its run_at and start it at its run_at
    #: (a held attempt keeps its slot and charge meanwhile); 0: only work due now
    # 3 s: 10,000 fires due in one second and a steady 100,000 a minute both start on time
    # with it (bench/cron.py, docs/benchmarks.md "Claiming ahead").
    worker_claim_ahead_s: float = Field(default=3.0, ge=0, le=60)

    #: ``user``: an agent running as root runs every attempt as a uid of its own;
    #: ``none``: attempts run as the agent's user (development, trusted code only)
    worker_isolation: Literal["user", "none"] = "user"
    #: the uids (and gids, the same numbers) given to attempts, one per running attempt
    worker_uids: str = "20000-29999"
    #: where attempts' folders are made; every folder above it must be searchable by all
    worker_run_dir: Path | None = None
    #: where agents on one host take the uids they hand out (a lock file per uid)
    worker_uid_locks: Path = Path("/run/cairn/uids")
    #: where agents on one host take the devices they hand out (a lock file per index;
    #: agents sharing a host's devices must share it); default ``$CAIRN_HOME/devices``
    worker_device_locks: Path | None = None
    #: each device index's node(s) on this host, ``gpu:0=/dev/nvidia0,gpu:1=/dev/nvidia1``:
    #: where cgroup v1's devices controller is mounted, an attempt may open only those of
    #: the indexes it holds (docs/placement.md, "Devices")
    worker_device_nodes: str = ""
    #: destinations no attempt may reach besides link-local (169.254.0.0/16, fe80::/10),
    #: as ``CIDR[:PORT]`` (``[v6/len]:PORT``), comma separated: list the database's host
    #: and port here (docs/security.md, "Egress")
    worker_egress_block: str = ""
    #: processes (and threads) one attempt may have at once
    worker_pids_max: int = Field(default=1024, ge=8, le=4_194_304)
    #: an attempt's disk quota (its tmpfs's size) when its task asks none (``disk_mb``)
    worker_disk_mb: int = Field(default=1024, ge=1, le=1024 * 1024)
    #: how long an attempt's folder is kept after its log is uploaded (0: removed at once)
    worker_keep_attempts_s: float = Field(default=0.0, ge=0)
    #: how long a start waits for its ``file://`` source to open (the spawn helper's check,
    #: as the attempt): a healthy local open takes microseconds; one that has not answered
    #: by then (a FUSE mount whose server hangs) fails the start (docs/security.md,
    #: "file:// sources that do not answer")
    worker_source_timeout_s: float = Field(default=SOURCE_TIMEOUT_S, gt=0, le=300)
    #: the artifact cache's bound; the least recently used artifacts go first
    worker_cache_mb: int = Field(default=10 * 1024, ge=1)
    artifact_sources: str = ""
    #: the s3 buckets whose artifacts the worker fetches with its own credentials for any
    #: task that names none (comma separated; ``*``: every bucket, for a single-tenant
    #: install). Default none: an artifact elsewhere must name its own credentials
    #: (docs/security.md, "Artifact credentials"); ``cairn up`` and compose set ``*``.
    worker_s3_own_buckets: str = ""
    #: preempt preemptible attempts while the host has less memory available than this
    #: (default: 5 % of the worker's memory, at least 64 MB)
    worker_min_available_mb: int | None = Field(default=None, ge=0)
    #: live logs (docs/logs.md): how often running attempts' new output is shipped, at
    #: most how fast per attempt, and how much unshipped output is kept before the middle
    #: is skipped (core keeps an attempt's last 16 MiB anyway); how long an attempt's end
    #: waits for its last output to reach core before it is reported regardless
    worker_log_interval_s: float = Field(default=0.5, gt=0, le=60)
    worker_log_rate_kib_s: int = Field(default=256, ge=1, le=1024 * 1024)
    worker_log_backlog_mb: int = Field(default=16, ge=1, le=4096)
    worker_log_flush_s: float = Field(default=5.0, ge=0, le=300)
    #: how long after the report the rest of a log core was too slow to take before it
    #: is still sent (keep it under core's ``CAIRN_LOG_LATE_S``, 60 s); 0: given up then
    worker_log_tail_s: float = Field(default=50.0, ge=0, le=3600)
    #: what the attempt's log file on this host keeps, its last bytes (a marker line first
    #: says how much was dropped): the same variable and rule as core's copy
    #: (``CAIRN_LOG_MAX_BYTES``, ``libs.common.loglimit``), so the file holds what core keeps
    log_max_bytes: LogMaxBytes = DEFAULT_LOG_MAX_BYTES
    #: progress and checkpoints (docs/progress.md): how often running attempts' progress
    #: files are looked at, and how often at most what they wrote is sent to core on its
    #: own (it rides along on every other turn)
    worker_progress_poll_s: float = Field(default=1.0, gt=0, le=60)
    worker_progress_interval_s: float = Field(default=5.0, ge=0.05, le=300)
    #: services (docs/services.md): the address other hosts reach this one's replicas at
    #: (unset: the address the host name resolves to, else 127.0.0.1)
    worker_address: str | None = Field(default=None, min_length=1, max_length=255)
    #: benchmarks: a file where the agent appends each attempt's step times (``timings``)
    worker_timings_file: Path | None = None

    @field_validator("artifact_sources")
    @classmethod
    def _check_sources(cls, value: str) -> str:
        parse_sources(value)
        return value

    @field_validator("worker_devices")
    @classmethod
    def _check_devices(cls, value: str) -> str:
        parse_devices(value)  # each a count; what core takes: ``_check_offer``
        return value

    def offer(self, hostname: str = "worker") -> WorkerRegister:
        """What the agent offers core as it registers (``CAIRN_WORKER_*``)."""
        return WorkerRegister(
            hostname=hostname[:200] or "worker",
            queues=self.queues,
            labels=self.labels,
            cpu=self.worker_cpu,
            memory_mb=self.worker_memory_mb,
            devices=self.devices,
            hang_watch=True,  # the agent's ``_pulse``: a turn at least every eighth of the bound
        )

    @model_validator(mode="after")
    def _check_offer(self) -> WorkerSettings:
        # Refused here, naming the variable: the agent built its offer after its host's
        # start, and a queue name core does not take (none, a space) or a memory past its
        # bound was a traceback there.
        try:
            self.offer()
        except ValidationError as exc:
            error = exc.errors()[0]
            field = str(error["loc"][0]) if error["loc"] else ""
            name = _OFFERED.get(field, "CAIRN_WORKER_*")
            raise ValueError(f"{name}: not an offer core takes ({field}: {error['msg']})") from None
        return self

    @model_validator(mode="after")
    def _check_device_nodes(self) -> WorkerSettings:
        for (name, index), path in self.device_nodes.items():
            if index >= self.devices.get(name, 0):
                raise ValueError(
                    f"CAIRN_WORKER_DEVICE_NODES names {name}:{index}, which "
                    "CAIRN_WORKER_DEVICES does not offer"
                )
            node_rule(path)
        return self

    @field_validator("worker_egress_block")
    @classmethod
    def _check_blocked(cls, value: str) -> str:
        parse_blocked(value)
        return value

    @field_validator("worker_uids")
    @classmethod
    def _check_uids(cls, value: str) -> str:
        first, _, last = value.partition("-")
        if not (first.strip().isdigit() and last.strip().isdigit()):
            raise ValueError("must be a range of uids, such as 20000-29999")
        if not 1000 <= int(first) <= int(last) < 2**31 - 1:
            raise ValueError("must lie between 1000 and 2**31-2, the first not above the last")
        return value

    @model_validator(mode="after")
    def _refuse_insecure_production(self) -> WorkerSettings:
        if self.env == "production" and not self.artifact_sources:
            raise ValueError("CAIRN_ARTIFACT_SOURCES is required when CAIRN_ENV=production")
        return self

    @property
    def labels(self) -> dict[str, str]:
        return parse_labels(self.worker_labels)

    @property
    def devices(self) -> dict[str, int]:
        return parse_devices(self.worker_devices)

    @property
    def device_nodes(self) -> dict[tuple[str, int], str]:
        """``CAIRN_WORKER_DEVICE_NODES`` by (name, index)."""
        out: dict[tuple[str, int], str] = {}
        for key, path in parse_labels(self.worker_device_nodes).items():
            name, _, index = key.partition(":")
            if not index.isdigit() or not path.startswith("/"):
                raise ValueError(f"device node {key}={path}: want NAME:INDEX=/dev/PATH")
            out[(name, int(index))] = path
        return out

    @property
    def device_locks(self) -> Path:
        return self.worker_device_locks or self.home / "devices"

    @property
    def queues(self) -> list[str]:
        return parse_list(self.worker_queues)

    @property
    def uids(self) -> range:
        first, _, last = self.worker_uids.partition("-")
        return range(int(first), int(last) + 1)

    @property
    def s3_own_buckets(self) -> frozenset[str]:
        return frozenset(parse_list(self.worker_s3_own_buckets))

    @property
    def sources(self) -> tuple[str, ...]:
        return parse_sources(self.artifact_sources)
