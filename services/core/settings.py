"""Core's settings: the shared ones plus what only core reads."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from libs.common.egress import IPNetwork, parse_cidrs
from libs.common.loglimit import DEFAULT_LOG_MAX_BYTES, LogMaxBytes
from libs.common.settings import CairnSettings
from libs.common.sources import parse_sources
from services.core.domain.groups import TeamMapping, parse_team_map
from services.core.domain.keys import decode_key, key_list
from services.core.domain.outcomes import SOURCE_UNANSWERED_MAX
from services.core.domain.sharing import FairShare


def _check_keys(text: str, variable: str) -> None:
    """Every key of ``text`` (``CAIRN_SECRETS_KEY``'s, or the key file's) opens; never
    shown (a key is the secret itself)."""
    keys = key_list(text)
    if not keys:
        raise ValueError(f"{variable} holds no key")
    for number, key in enumerate(keys, 1):
        try:
            decode_key(key)
        except ValueError as exc:
            raise ValueError(f"{variable}: key {number} of {len(keys)}: {exc}") from None


class SecretsKeySettings(CairnSettings):
    """Where core's secrets keys come from: all a migration that seals needs, so that it
    runs where core's other settings are not given (compose's setup step)."""

    secrets_key: SecretStr | None = None
    secrets_key_file: Path | None = None

    @model_validator(mode="after")
    def _check_key(self) -> SecretsKeySettings:
        if self.env == "production" and self.secrets_key is None and not self.secrets_key_file:
            raise ValueError(
                "CAIRN_SECRETS_KEY or CAIRN_SECRETS_KEY_FILE is required when CAIRN_ENV=production"
            )
        # Checked here, at start: a bad key passed the settings, the migrations ran, and
        # core then failed in its lifespan with a traceback (exit 3).
        if self.secrets_key is not None:
            _check_keys(self.secrets_key.get_secret_value(), "CAIRN_SECRETS_KEY")
        elif self.secrets_key_file is not None and (
            self.secrets_key_file.exists() or self.env == "production"
        ):
            try:
                text = self.secrets_key_file.read_text()
            except OSError as exc:  # a folder, no such file, not readable
                raise ValueError(
                    f"CAIRN_SECRETS_KEY_FILE {self.secrets_key_file}: cannot read it ({exc.strerror})"
                ) from None
            _check_keys(text, "CAIRN_SECRETS_KEY_FILE")
        return self

    @property
    def secrets_key_path(self) -> Path:
        """Where the keys are read from when ``CAIRN_SECRETS_KEY`` is not set; in
        development a key is made there on first start."""
        return self.secrets_key_file or self.home / "secrets.key"


class CoreSettings(SecretsKeySettings):
    """``CAIRN_*`` environment variables read by core."""

    retention_days: float = Field(default=30.0, gt=0)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    db_pool_size: int = Field(default=20, ge=1, le=200)
    #: how long a request waits for a free connection (a single submission, for its group
    #: commit's write to take it) before core answers 503: shorter
    #: than the clients' read timeout (``libs.common.client.DEFAULT_TIMEOUT``, 5 s), so an
    #: overloaded core refuses a request (retryable, nothing done) before its client gives
    #: up on it, rather than doing work whose answer nobody reads
    db_pool_timeout_s: float = Field(default=4.0, gt=0, le=60)
    #: connections of the liveness path alone (heartbeats, the reaper), which the data
    #: path's load cannot take
    liveness_pool_size: int = Field(default=4, ge=1, le=50)
    #: single submissions written together, in one statement and one commit, on a
    #: connection of their own (``ops.groupcommit``); false: each in its own statement
    submit_group_commit: bool = True
    promote_interval_s: float = Field(default=1.0, gt=0)
    #: how long past its run_at a ready task is left to claims (which take it from its
    #: run_at on) before the promoter moves it to waiting
    promote_after_s: float = Field(default=0.5, ge=0, le=60)
    #: how far ahead of a delayed task's run_at a worker's claim may lease it (the worker
    #: starts it at its run_at; 0: never ahead)
    claim_ahead_max_s: float = Field(default=10.0, ge=0, le=60)
    #: how often each replica's longest waiting claim of each queue looks without being
    #: woken: the most a lost wake-up delays work (docs/architecture.md, "Wake-ups")
    claim_sweep_s: float = Field(default=1.0, gt=0, le=60)
    #: how often a standby replica tries to take core's lead (the singleton loops), and
    #: the leader checks it still holds it
    leader_poll_s: float = Field(default=1.0, gt=0, le=60)
    retention_interval_s: float = Field(default=300.0, gt=0)
    # How often the leader adds the attempts that ended to the monthly usage sums
    # (docs/sharing.md, "Usage"); it reads on at once while a page was full.
    usage_interval_s: float = Field(default=60.0, gt=0)
    retention_batch: int = Field(default=500, ge=1, le=10000)
    token_cache_s: float = Field(default=30.0, ge=0)
    #: how long a worker's checked lease secret is trusted without reading its row again
    lease_cache_s: float = Field(default=60.0, ge=0)
    migrate_on_start: bool = True
    #: uvicorn worker processes serving core's port, each with its own pools and loops
    #: (replicas on one host); 1: one process
    core_workers: int = Field(default=1, ge=1, le=32)

    # a task's limits (docs/architecture.md, "Time limits" and "Retries")
    #: ``timeout_s`` of a task that sets none, in a queue without a default of its own
    #: (unset: none; never above its queue's maximum)
    default_timeout_s: int | None = Field(default=None, ge=1, le=30 * 86400)
    #: crashes count towards a task's poison-pill limit only within this window (a task's
    #: ``retry.poison_window_s`` overrides it)
    poison_window_s: float = Field(default=72 * 3600.0, gt=0, le=30 * 86400)
    #: a task whose ``file://`` source did not answer on this many starts in a row, each
    #: handed back by its worker, is buried (docs/security.md)
    source_unanswered_max: int = Field(default=SOURCE_UNANSWERED_MAX, ge=1, le=10_000)

    # placement (see docs/placement.md)
    overcommit_ratio: float = Field(default=1.0, ge=1, le=10)
    defer_above: float = Field(default=0.8, gt=0, le=1)
    defer_max_s: float = Field(default=6 * 3600.0, gt=0)
    defer_margin_s: float = Field(default=600.0, ge=0)
    preempt_after_s: float = Field(default=5.0, ge=0)
    preempt_grace_s: float = Field(default=10.0, ge=0, le=3600)
    placement_interval_s: float = Field(default=1.0, gt=0)
    #: how often the service controller passes over every service (docs/services.md)
    services_interval_s: float = Field(default=1.0, gt=0, le=300)

    # identity (see docs/security.md)
    audit_retention_days: float = Field(default=400.0, gt=0)
    #: where the leader exports the audit trail (docs/security.md, "Audit export"): a
    #: file's absolute path (appended) or ``s3://bucket/prefix``; unset: no export. Set,
    #: the audit retention deletes only rows already exported.
    audit_export_to: str | None = Field(
        default=None,
        max_length=1024,
        pattern=r"^(/[^\x00]*|s3://[a-z0-9][a-z0-9.-]{2,62}(/[^\x00]*)?)$",
    )
    audit_export_interval_s: float = Field(default=300.0, gt=0)
    audit_export_batch: int = Field(default=10_000, ge=1, le=100_000)
    #: the S3-compatible store's URL (moto, MinIO, Ceph); unset: AWS's own
    audit_export_s3_endpoint_url: str | None = Field(default=None, pattern=r"^https?://")
    tokens_per_principal: int = Field(default=100, ge=1, le=10_000)
    oidc_issuer: str | None = Field(default=None, min_length=1, max_length=2048)
    oidc_audience: str | None = Field(default=None, min_length=1, max_length=2048)
    oidc_jwks_url: str | None = Field(default=None, pattern=r"^https?://")
    oidc_jwks_file: Path | None = None
    oidc_principal_claim: str = "sub"
    oidc_teams_claim: str = "groups"
    oidc_admin_team: str | None = None
    oidc_algorithms: str = "RS256,ES256"
    oidc_leeway_s: float = Field(default=30.0, ge=0, le=600)
    #: how often the key set is read again, at most (a shorter Cache-Control max-age from
    #: the provider wins): how long a key the provider withdrew can still verify
    oidc_jwks_refresh_s: float = Field(default=300.0, gt=0, le=86400)
    #: the least time between two reads, whatever asks (an unknown kid, a short max-age,
    #: a failing provider): made-up kids must not make core hammer the provider
    oidc_jwks_min_refresh_s: float = Field(default=30.0, gt=0, le=3600)
    #: how long the last good set is used while the provider cannot be read; after that
    #: JWTs are answered 503 until it can
    oidc_jwks_stale_s: float = Field(default=3600.0, gt=0, le=7 * 86400)
    #: how long a team membership that a token's groups claimed is kept for the leases of
    #: what it submitted (which have no token at hand): until the token expires, and no
    #: longer than this after the submission
    oidc_claim_max_s: float = Field(default=3600.0, gt=0, le=7 * 86400)
    #: how long a team that a verified token's groups claimed stands, after the token it
    #: was last seen in, for what a service does in the member's name (the fires of a
    #: team's schedules, the node tasks of a team's workflows), which has no token at hand
    oidc_claim_seen_s: float = Field(default=7 * 86400.0, gt=0, le=90 * 86400)
    #: Cairn's client id at the provider: set, people sign in (``cairn login``'s device
    #: flow, the dashboard's authorization code flow with PKCE); the ID tokens it gets
    #: are for this audience, so CAIRN_OIDC_AUDIENCE is the same id
    oidc_client_id: str | None = Field(default=None, min_length=1, max_length=200)
    #: for a provider that holds the dashboard's client to a secret (a confidential
    #: client); unset: a public client, PKCE alone
    oidc_client_secret: SecretStr | None = None
    oidc_scopes: str = Field(
        default="openid offline_access groups", max_length=1000, pattern=r"^[\x21-\x7e ]+$"
    )
    #: how long a dashboard session lasts after sign-in, whatever is done with it
    session_max_s: float = Field(default=8 * 3600.0, ge=60, le=7 * 86400)
    #: the longest a bearer token minted for a session lives (``POST /v1/login/token``,
    #: what the dashboard calls cron and dag with); never past the session's end
    session_token_s: float = Field(default=300.0, ge=30, le=3600)
    #: provider groups that start with this grant the team named by the rest
    oidc_team_prefix: str | None = Field(default=None, min_length=1, max_length=200)
    #: ``group=team,...``: provider groups that grant a team; with no prefix and no
    #: table, groups grant no team
    oidc_team_map: str = Field(default="", max_length=65536)

    @field_validator("oidc_team_map")
    @classmethod
    def _check_team_map(cls, value: str) -> str:
        parse_team_map(value)
        return value

    @model_validator(mode="after")
    def _check_jwks_times(self) -> CoreSettings:
        if not self.oidc_jwks_min_refresh_s <= self.oidc_jwks_refresh_s <= self.oidc_jwks_stale_s:
            raise ValueError(
                "CAIRN_OIDC_JWKS_MIN_REFRESH_S <= CAIRN_OIDC_JWKS_REFRESH_S"
                " <= CAIRN_OIDC_JWKS_STALE_S must hold"
            )
        return self

    @property
    def oidc_team_mapping(self) -> TeamMapping:
        return TeamMapping(self.oidc_team_prefix, parse_team_map(self.oidc_team_map))

    @model_validator(mode="after")
    def _check_identity(self) -> CoreSettings:
        if self.audit_retention_days < self.retention_days:
            raise ValueError("CAIRN_AUDIT_RETENTION_DAYS must be at least CAIRN_RETENTION_DAYS")
        if (self.oidc_issuer is None) != (self.oidc_audience is None):
            raise ValueError("set both CAIRN_OIDC_ISSUER and CAIRN_OIDC_AUDIENCE, or neither")
        if self.oidc_issuer and (self.oidc_jwks_url is None) == (self.oidc_jwks_file is None):
            raise ValueError("OIDC needs one of CAIRN_OIDC_JWKS_URL or CAIRN_OIDC_JWKS_FILE")
        if self.oidc_client_id is not None and not self.oidc_issuer:
            raise ValueError("CAIRN_OIDC_CLIENT_ID needs CAIRN_OIDC_ISSUER and _AUDIENCE")
        plain = self.oidc_jwks_url is not None and self.oidc_jwks_url.startswith("http:")
        if self.env == "production" and plain:
            raise ValueError("CAIRN_OIDC_JWKS_URL must be https:// when CAIRN_ENV=production")
        return self

    @property
    def oidc_enabled(self) -> bool:
        return self.oidc_issuer is not None

    @property
    def signin_enabled(self) -> bool:
        """People sign in through the provider (``CAIRN_OIDC_CLIENT_ID`` is set)."""
        return self.oidc_issuer is not None and self.oidc_client_id is not None

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
    #: ranges webhooks may reach beside public addresses (``10.20.0.0/16,fd00::/8``):
    #: loopback, private, link-local and the database's host are refused otherwise
    notify_allow_cidrs: str = ""
    #: a subscription's ``test`` deliveries are at most one per this many seconds
    notify_test_interval_s: float = Field(default=10.0, gt=0, le=3600)

    @field_validator("notify_allow_cidrs")
    @classmethod
    def _check_cidrs(cls, value: str) -> str:
        parse_cidrs(value)
        return value

    @property
    def notify_allowed(self) -> tuple[IPNetwork, ...]:
        """The ranges of ``CAIRN_NOTIFY_ALLOW_CIDRS``."""
        return parse_cidrs(self.notify_allow_cidrs)

    @property
    def notify_lease(self) -> float:
        """How long a replica holds a delivery it sends: unset, well past the timeout,
        which bounds the whole exchange."""
        if self.notify_lease_s is not None:
            return self.notify_lease_s
        return self.notify_timeout_s * 2 + 5

    # sharing (see docs/sharing.md)
    fair_quantum_s: float = Field(default=1.0, gt=0, le=3600)
    aging_s: float = Field(default=60.0, gt=0)
    aging_max: int = Field(default=200, ge=0, le=200)
    sharing_cache_s: float = Field(default=5.0, ge=0, le=300)
    #: how submissions are stamped across owners and teams (the claim's order within a
    #: priority level): ``tasks`` (one step a task) or ``usage`` (a flow's new work also
    #: pushed back by its decayed reserved core-seconds); a queue's policy may say otherwise
    fair_share: Literal["tasks", "usage"] = "tasks"
    #: the half-life of the usage fair share weighs (Slurm's PriorityDecayHalfLife)
    fair_share_half_life_s: float = Field(default=7 * 86400.0, gt=0, le=366 * 86400.0)
    #: the decayed core-seconds (over the flow's weight) that push its new work back by
    #: one fair-share step (``CAIRN_FAIR_QUANTUM_S``): one task's turn per core-minute
    fair_share_unit_cpu_s: float = Field(default=60.0, gt=0, le=1e9)

    @property
    def fair_share_rule(self) -> FairShare:
        """The three settings above as the submit path takes them."""
        return FairShare(self.fair_share, self.fair_share_half_life_s, self.fair_share_unit_cpu_s)

    # live logs (see docs/logs.md)
    #: what one attempt's log keeps at most (its end; a marker says what was dropped)
    #: (the worker agent reads the same variable for its file: ``libs.common.loglimit``)
    log_max_bytes: LogMaxBytes = DEFAULT_LOG_MAX_BYTES
    #: how long after an attempt's report core still takes the rest of its log, when the
    #: report said some was still on its way (``log_bytes``: its worker's agent found core
    #: slow); its archiving and its followers' end wait for the rest as long
    log_late_s: float = Field(default=60.0, ge=0, le=3600)
    #: where the logs of ended attempts live: ``postgres`` (their chunks stay), or ``s3``
    #: (an S3-compatible store: each ended attempt's chunks become one object)
    log_store: Literal["postgres", "s3"] = "postgres"
    log_s3_bucket: str | None = Field(default=None, min_length=3, max_length=63)
    log_s3_prefix: str = Field(default="logs/", max_length=200)
    #: the store's URL (moto, MinIO, Ceph); unset: AWS's own, from boto3's usual chain
    log_s3_endpoint_url: str | None = Field(default=None, pattern=r"^https?://")
    log_archive_interval_s: float = Field(default=2.0, gt=0)

    @model_validator(mode="after")
    def _check_log_store(self) -> CoreSettings:
        if self.log_store == "s3" and not self.log_s3_bucket:
            raise ValueError("CAIRN_LOG_STORE=s3 needs CAIRN_LOG_S3_BUCKET")
        return self
