"""The wire format: every request and answer body of core's HTTP API.

Request models refuse unknown fields, so nobody sets ``owner``, ``state`` or ``attempts``
by hand, and bound every string, list and map.
"""

from __future__ import annotations

import ipaddress
import json
import math
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit
from uuid import UUID

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    PrivateAttr,
    SerializeAsAny,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from libs.common.selectors import parse as parse_selector
from libs.common.states import AttemptOutcome, ReportedOutcome, TaskState, WorkerState
from libs.common.stored import Stored

MAX_BATCH = 1000
MAX_PAGE = 1000
MAX_WAIT_S = 30.0
#: how far ahead of its ``run_at`` a claim may ask to lease delayed work (core caps it
#: further by ``CAIRN_CLAIM_AHEAD_MAX_S``)
MAX_AHEAD_S = 60.0
#: what a task may hand on in its outputs file (``CAIRN_OUTPUTS``), as JSON
MAX_OUTPUTS_BYTES = 64 * 1024
MAX_OUTPUTS = 100
#: how deep the arrays and objects of JSON kept as given (outputs, event data, params) may
#: nest, the object itself level 1: a report carries outputs three levels further down a
#: turn, whose encoders and parsers stop at a few hundred
MAX_JSON_DEPTH = 32


def too_deep(name: str) -> str:
    """Why JSON of the field ``name`` nested past ``MAX_JSON_DEPTH`` is refused."""
    return f"{name} may not be nested deeper than {MAX_JSON_DEPTH} levels"


OUTPUTS_TOO_DEEP = too_deep("outputs")
#: the integers such JSON may hold: a 64-bit signed one, what the services' encoder takes
MAX_JSON_INT = 2**63 - 1
_J = TypeVar("_J")
_I = TypeVar("_I", bound="Input")
#: the longest a task's ``timeout_s``, a queue's limits, or a wait to start may be
MAX_TIME_LIMIT_S = 30 * 86400
#: the exit code by which a task says "do not retry me": its failure is final at once
#: (unless its retry policy lists it under ``always``). The first code past the
#: sysexits range (64 to 78), so no standard meaning collides with it.
NO_RETRY_EXIT_CODE = 79
#: a checkpoint an attempt hands to the next attempt of its task (docs/progress.md)
MAX_CHECKPOINT_BYTES = 64 * 1024
#: the checkpoints one turn may carry, together (the agent sends the rest in the next)
MAX_TURN_CHECKPOINT_BYTES = 2 * 1024 * 1024
MAX_PROGRESS_MESSAGE = 200
#: an attempt's fencing token: ``<attempt id>.<epoch>.<32 hex digits of secret>``
FENCING_TOKEN_PATTERN = r"^[1-9][0-9]{0,18}\.[1-9][0-9]{0,9}\.[0-9a-f]{32}$"  # noqa: S105 - a pattern, not a secret

Name = Annotated[
    str, StringConstraints(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")
]
QueueName = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9_.\-]*$")
]
Arg = Annotated[str, StringConstraints(max_length=8192, pattern=r"^[^\x00]*$")]
EnvKey = Annotated[str, StringConstraints(max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
EnvValue = Annotated[str, StringConstraints(max_length=8192, pattern=r"^[^\x00]*$")]
LabelKey = Annotated[
    str, StringConstraints(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-/]*$")
]
LabelValue = Annotated[str, StringConstraints(max_length=256, pattern=r"^[^\x00-\x1f\x7f]*$")]
Path_ = Annotated[str, StringConstraints(min_length=1, max_length=1024, pattern=r"^[^\x00]+$")]
IdempotencyKey = Annotated[
    str, StringConstraints(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")
]
TaskId = Annotated[int, Field(ge=1, le=2**63 - 1)]
TeamName = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9_.\-]*$")
]
PrincipalName = Annotated[
    str, StringConstraints(min_length=1, max_length=100, pattern=r"^[^\x00-\x1f\x7f]+$")
]
SecretName = Annotated[
    str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
]
Role = Literal["user", "admin", "service", "worker"]


# Set by the cron service on the tasks its fires submit (docs/cron.md): informational,
# so they are the only CAIRN_ names a submission may carry.
CRON_ENV = frozenset({"CAIRN_CRON_SLOT", "CAIRN_CRON_SCHEDULE_ID", "CAIRN_CRON_BACKFILL"})


class SecretRef(BaseModel):
    """An ``env`` value kept as a secret: the owner's secret ``secret``, or with ``team``
    that team's. Core puts its value only into the worker's lease of the attempt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    secret: SecretName
    team: TeamName | None = None


EnvEntry = EnvValue | SecretRef


def _no_reserved_env(env: dict[str, EnvEntry]) -> dict[str, EnvEntry]:
    reserved = sorted(k for k in env if k.startswith("CAIRN_") and k not in CRON_ENV)
    if reserved:
        raise ValueError(
            f"names starting with CAIRN_ are reserved for Cairn: {', '.join(reserved)}"
        )
    return env


def _storable_time(value: datetime) -> datetime:
    """In UTC, and within what PostgreSQL's timestamptz holds."""
    offset = value.utcoffset()
    if offset is not None and abs(offset) >= timedelta(hours=16):
        raise ValueError("the UTC offset must be less than 16 hours")
    try:
        utc = value.astimezone(UTC)
    except OverflowError:
        raise ValueError("out of range") from None
    if utc.year < 1970 or utc.year > 9999:
        raise ValueError("must be between 1970 and 9999")
    return utc


#: a time PostgreSQL can store, in UTC
StorableTime = Annotated[AwareDatetime, AfterValidator(_storable_time)]


# The bases of every wire model here and in cron_models and dag_models. defer_build: a
# model's validator is built when it is first used, not when its module is imported; the
# CLI and each service use a part of these 200-odd models.
class Input(BaseModel):
    """What a client sends: unknown fields refused, immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


def shared_default(model: Callable[[], _I]) -> Callable[[], _I]:
    """A ``default_factory`` handing out one default instance of the ``Input`` model,
    made once: ``default_factory=Model`` validated a whole default model, its validators
    too, at every use (a task without ``retry`` or ``resources`` spent 6 of its 17 µs of
    parsing there, in a batch of 1,000). Safe because an ``Input`` is frozen and nothing
    changes a list or dict of one in place."""
    made = model()
    return lambda: made


class Output(BaseModel):
    """What a service answers: fields a newer service adds are ignored."""

    model_config = ConfigDict(extra="ignore", defer_build=True)


def first_error(exc: ValidationError) -> str:
    """A validation error in one line: its first error's field and reason, and how many
    more (for a reason stored or reported, where pydantic's own text runs to lines)."""
    errors = exc.errors()
    if not errors:
        return str(exc)
    first = errors[0]
    where = ".".join(str(part) for part in first.get("loc", ())) or exc.title
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first.get('msg', 'invalid')}{more}"


S3Endpoint = Annotated[str, StringConstraints(max_length=2048, pattern=r"^https?://[^\s/]+/?$")]


class Artifact(Input):
    """Where the executable lives, and the digest it must have."""

    uri: Annotated[
        str,
        StringConstraints(
            min_length=8, max_length=2048, pattern=r"^(s3|https|file)://[^\s\x00-\x1f\x7f]+$"
        ),
    ]
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
    #: an ``s3://`` artifact's credentials: a secret of the owner's (or, with ``team``,
    #: that team's) holding ``S3Credentials`` as JSON; core opens it into the lease only
    credentials: SecretRef | None = Field(default=None, exclude_if=lambda value: value is None)

    @field_validator("credentials")
    @classmethod
    def _s3_only(cls, value: SecretRef | None, info: ValidationInfo) -> SecretRef | None:
        if value is not None and not str(info.data.get("uri", "")).startswith("s3://"):
            raise ValueError("only an s3:// artifact takes credentials")
        return value


class S3Credentials(Input):
    """The JSON value of an artifact's ``credentials`` secret: what the worker signs that
    one fetch with (docs/security.md, "Artifact credentials"). Kept out of ``repr``."""

    access_key_id: Annotated[str, StringConstraints(min_length=1, max_length=256)] = Field(
        repr=False
    )
    secret_access_key: Annotated[str, StringConstraints(min_length=1, max_length=1024)] = Field(
        repr=False
    )
    session_token: Annotated[str, StringConstraints(min_length=1, max_length=8192)] | None = Field(
        default=None, repr=False
    )
    region: Annotated[str, StringConstraints(pattern=r"^[a-z0-9-]{1,64}$")] | None = None
    #: another S3-compatible service: ``https://`` (``http://`` only where the worker
    #: admits insecure http), under the worker's ``CAIRN_ARTIFACT_SOURCES``
    endpoint: S3Endpoint | None = None


#: a countable device's name (``gpu``, ``fpga``): lower case, as it goes into the attempt's
#: ``CAIRN_DEVICES_<NAME>`` (docs/placement.md, "Devices")
DeviceName = Annotated[
    str, StringConstraints(min_length=1, max_length=32, pattern=r"^[a-z][a-z0-9_]*$")
]
#: the most device names one worker offers or one task asks for, and of one name
MAX_DEVICE_NAMES = 8
MAX_DEVICES = 256
#: counts of devices by name: a task's request (each at least one), a worker's offer
Devices = Annotated[
    dict[DeviceName, Annotated[int, Field(ge=1, le=MAX_DEVICES)]],
    Field(max_length=MAX_DEVICE_NAMES),
]

#: the largest disk quota an attempt may ask (MiB)
MAX_DISK_MB = 1024 * 1024


class Resources(Input):
    """What one attempt declares it needs: CPU, memory, whole devices by name
    (``{"gpu": 1}``), which the attempt holds alone (docs/placement.md, "Devices"), and
    ``disk_mb``: its disk quota, the size of the tmpfs that holds its home and /tmp (its
    pages count towards ``memory_mb``); unset: its queue's ``default_disk_mb``, else the
    worker's ``CAIRN_WORKER_DISK_MB``."""

    cpu: float = Field(default=1.0, gt=0, le=1024)
    memory_mb: int = Field(default=512, ge=1, le=4 * 1024 * 1024)
    devices: Devices = Field(default_factory=dict, exclude_if=lambda value: not value)
    disk_mb: int | None = Field(default=None, ge=1, le=MAX_DISK_MB)


ExitCode = Annotated[int, Field(ge=0, le=255)]
SignalNumber = Annotated[int, Field(ge=1, le=64)]


class RetryCauses(Input):
    """Why an attempt failed: the exit codes it exited with, the signals that killed it
    (one the worker did not send)."""

    exit_codes: list[ExitCode] = Field(default_factory=list, max_length=256)
    signals: list[SignalNumber] = Field(default_factory=list, max_length=64)

    def __bool__(self) -> bool:
        return bool(self.exit_codes or self.signals)


class RetryPolicy(Input):
    """How failures are retried. With no ``base_s`` the Sidekiq curve applies:
    ``attempt**4 + 15 + rand(10) * (attempt + 1)`` seconds. ``never``: causes whose
    failure is final at once; ``always``: causes retried after backoff without spending
    an attempt (up to ``ALWAYS_RETRY_LIMIT`` attempts in all). Exit code
    ``NO_RETRY_EXIT_CODE`` (79) is never retried unless ``always`` lists it. Crashes
    count towards ``poison_after`` only within ``poison_window_s`` (unset: core's
    ``CAIRN_POISON_WINDOW_S``, 72 h)."""

    max_attempts: int = Field(default=5, ge=1, le=100)
    base_s: float | None = Field(default=None, gt=0, le=86400)
    cap_s: float = Field(default=86400.0, gt=0, le=30 * 86400)
    jitter: bool = True
    poison_after: int = Field(default=3, ge=1, le=100)
    poison_window_s: float | None = Field(default=None, gt=0, le=MAX_TIME_LIMIT_S)
    never: RetryCauses = Field(default_factory=shared_default(RetryCauses))
    always: RetryCauses = Field(default_factory=shared_default(RetryCauses))

    @model_validator(mode="after")
    def _never_or_always(self) -> RetryPolicy:
        if not (self.never and self.always):
            return self
        codes = sorted(set(self.never.exit_codes) & set(self.always.exit_codes))
        signals = sorted(set(self.never.signals) & set(self.always.signals))
        if codes or signals:
            both = [f"exit code {c}" for c in codes] + [f"signal {s}" for s in signals]
            raise ValueError(f"{', '.join(both)}: in both never and always")
        return self


#: an ``always`` cause spends no attempt until the task has had this many in all
ALWAYS_RETRY_LIMIT = 100


ConcurrencyKeyName = Annotated[
    str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/\-]*$")
]


class Concurrency(Input):
    """A shared downstream system the task uses: at most ``limit`` attempts naming
    ``key`` run at once across the pool (an admin's limit for the key wins)."""

    key: ConcurrencyKeyName
    limit: int | None = Field(default=None, ge=1, le=100_000)


def _selector(text: str) -> str:
    """The selector's text as given, once it parses (``libs.common.selectors``)."""
    parse_selector(text)
    return text


#: one placement selector, checked wherever a task is defined (core, a schedule, a workflow)
SelectorText = Annotated[
    str, StringConstraints(min_length=1, max_length=512), AfterValidator(_selector)
]


class Preference(Input):
    """A selector a worker had better match: among the work a worker may take at one
    priority, the task whose preferences it meets with the most weight goes first."""

    selector: SelectorText
    weight: int = Field(default=1, ge=1, le=100)


class Spread(Input):
    """Spread the running tasks of the same owner and name (a service's replicas)
    across the values of a worker label, or across hosts (``by: host``): a worker takes
    one only while its domain holds at most ``max_skew`` more of them than the emptiest
    domain. A worker without the label takes none."""

    by: LabelKey
    max_skew: int = Field(default=1, ge=1, le=1000)


class Placement(Input):
    """Where a task may run, by the workers' labels (docs/placement.md). ``required``:
    every selector must hold (``disk=ssd``, ``zone in (a,b)``, ``gpu exists``,
    ``zone!=c``, ``zone notin (a,b)``, ``!gpu``). ``anti_affinity``: never two running
    tasks of the same owner and name on workers with the same value of this label (or
    on one host: ``host``)."""

    required: list[SelectorText] = Field(default_factory=list, max_length=16)
    preferred: list[Preference] = Field(default_factory=list, max_length=16)
    spread: Spread | None = None
    anti_affinity: LabelKey | None = None


# --- services (docs/services.md): ports, probes, replicas --------------------------------

#: a port's name, as Kubernetes spells it (``IANA_SVC_NAME``)
PortName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9-]{0,14}$")]
#: a port by number or by the name the service declared
PortRef = Annotated[int, Field(ge=1, le=65535)] | PortName
ProbeArg = Annotated[str, StringConstraints(min_length=1, max_length=1024, pattern=r"^[^\x00]+$")]
HttpPath = Annotated[str, StringConstraints(max_length=1024, pattern=r"^/[\x21-\x7e]*$")]
MAX_PORTS = 16
MAX_REPLICAS_LISTED = 1000
MAX_REPLICAS = 1000


class ServicePort(Input):
    """A port the service listens on. ``port`` 0: the agent picks a free one for each
    replica; the service reads it from ``CAIRN_PORT_<NAME>`` (upper case, ``-`` as ``_``)."""

    name: PortName
    port: int = Field(default=0, ge=0, le=65535)


class HttpProbe(Input):
    """``GET path`` on ``port`` of the replica's loopback: a 2xx or 3xx answer is a success."""

    path: HttpPath = "/"
    port: PortRef


class TcpProbe(Input):
    """A TCP connection to ``port`` of the replica's loopback: accepted is a success."""

    port: PortRef


class ExecProbe(Input):
    """A command run in the replica's sandbox (its user, cgroup, /tmp and network): exit
    0 is a success."""

    command: list[ProbeArg] = Field(min_length=1, max_length=64)


class Probe(Input):
    """One probe: exactly one of ``http``, ``tcp``, ``exec``, run every ``period_s`` from
    ``initial_delay_s`` after the start, each try given ``timeout_s``. ``failure_threshold``
    failures in a row make it fail, ``success_threshold`` successes in a row make it pass
    (Kubernetes' semantics)."""

    http: HttpProbe | None = None
    tcp: TcpProbe | None = None
    exec: ExecProbe | None = None
    initial_delay_s: float = Field(default=0, ge=0, le=3600)
    period_s: float = Field(default=10, ge=0.1, le=3600)
    timeout_s: float = Field(default=1, ge=0.05, le=600)
    failure_threshold: int = Field(default=3, ge=1, le=1000)
    success_threshold: int = Field(default=1, ge=1, le=1000)

    @model_validator(mode="after")
    def _one_kind(self) -> Probe:
        given = [k for k in ("http", "tcp", "exec") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of http, tcp or exec (given: {given or 'none'})")
        return self


class ServiceSpec(Input):
    """What a ``kind: service`` adds: the ports it listens on and its probes. A startup
    probe gates the other two: they start once it has passed; a failing startup or
    liveness probe kills the attempt (restarted by the service's backoff); readiness is
    reported to core, and only ready replicas are listed as endpoints."""

    ports: list[ServicePort] = Field(default_factory=list, max_length=MAX_PORTS)
    liveness: Probe | None = None
    readiness: Probe | None = None
    startup: Probe | None = None


class ReplicaStatus(Input):
    """What an agent tells core of one running replica: whether it is ready, the address
    of its host and the port each declared name resolved to."""

    attempt_id: Annotated[int, Field(ge=1, le=2**63 - 1)]
    ready: bool
    address: Annotated[str, StringConstraints(min_length=1, max_length=255)] | None = None
    ports: dict[PortName, Annotated[int, Field(ge=1, le=65535)]] = Field(
        default_factory=dict, max_length=MAX_PORTS
    )


class ReplicaStatuses(Input):
    items: list[ReplicaStatus] = Field(min_length=1, max_length=256)


class ReplicaStatusAnswer(Output):
    """The attempts whose status core kept (the others are no longer open on this worker)."""

    kept: list[int]


class Endpoint(Output):
    """One replica of a service and where it listens (``address:port`` per port name)."""

    task_id: int
    attempt_id: int
    owner: str
    ready: bool
    address: str | None
    ports: dict[str, int]
    endpoints: dict[str, str]


class EndpointList(Output):
    name: str
    items: list[Endpoint]


class TaskCreate(Input):
    """A submission."""

    name: Name
    artifact: Artifact
    queue: QueueName = "default"
    priority: int = Field(default=0, ge=-100, le=100)
    kind: Literal["task", "service"] = "task"
    args: list[Arg] = Field(default_factory=list, max_length=256)
    env: Annotated[dict[EnvKey, EnvEntry], AfterValidator(_no_reserved_env)] = Field(
        default_factory=dict,
        max_length=128,
        description='Plain values are stored as given; {"secret": NAME} refers to a secret '
        "(see /v1/secrets), stored encrypted and given only to the worker that runs it.",
    )
    input_path: Path_ | None = None
    output_path: Path_ | None = None
    resources: Resources = Field(default_factory=shared_default(Resources))
    preemptible: bool = False
    retry: RetryPolicy = Field(default_factory=shared_default(RetryPolicy))
    #: a hard limit per attempt; unset: its queue's default (or core's), none for a service
    timeout_s: int | None = Field(default=None, ge=1, le=MAX_TIME_LIMIT_S)
    run_at: Annotated[AwareDatetime, AfterValidator(_storable_time)] | None = None
    #: a task that has not started by then ends ``dead`` (never run)
    start_by: Annotated[AwareDatetime, AfterValidator(_storable_time)] | None = None
    #: the same, counted from when it is due (``run_at``, or its submission); its queue's
    #: ``max_wait_s``, if shorter, applies instead
    max_wait_s: int | None = Field(default=None, ge=1, le=MAX_TIME_LIMIT_S)
    idempotency_key: IdempotencyKey | None = None
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32)
    #: time-insensitive: may wait while its pool is busy (until ``deadline`` if given)
    defer_ok: bool = False
    #: when it must have finished; a task with a deadline may be deferred until its
    #: latest start (the deadline less its ``timeout_s``, or ten minutes)
    deadline: Annotated[AwareDatetime, AfterValidator(_storable_time)] | None = None
    #: owned by this team too (the submitter must belong to it): its members see and act on it
    team: TeamName | None = None
    concurrency: Concurrency | None = None
    #: an attempt that writes no progress (nor checkpoint) for this long is ended as
    #: ``timeout``, retried by its policy (docs/progress.md)
    progress_timeout_s: int | None = Field(default=None, ge=1, le=30 * 86400)
    #: which workers may take it, by their labels (docs/placement.md)
    placement: Placement | None = None
    #: a service's ports and probes (docs/services.md); ``kind: service`` only
    service: ServiceSpec | None = None

    @model_validator(mode="after")
    def _starts_after_it_is_due(self) -> TaskCreate:
        if self.start_by is not None and self.run_at is not None and self.start_by <= self.run_at:
            raise ValueError("start_by must be after run_at")
        return self


class RolloutPolicy(Input):
    """How a service moves to a new template (Kubernetes' rolling update): at most
    ``max_surge`` replicas above ``replicas`` and at most ``max_unavailable`` below it
    ready at any time; a rollout whose new replicas are not all ready within
    ``deadline_s``, or whose new replicas have failed ``max_failures`` times in all
    (exited, or stopped by their startup or liveness probe), is rolled back to the
    previous template."""

    max_surge: int = Field(default=1, ge=0, le=1000)
    max_unavailable: int = Field(default=0, ge=0, le=1000)
    deadline_s: int = Field(default=600, ge=1, le=86400)
    max_failures: int = Field(default=3, ge=1, le=1000)

    @model_validator(mode="after")
    def _moves(self) -> RolloutPolicy:
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise ValueError("max_surge and max_unavailable may not both be 0")
        return self


class ServiceCreate(Input):
    """A service kept at ``replicas`` running tasks of ``template`` (its ``kind`` must be
    ``service``; its tasks are named after the service, docs/services.md)."""

    name: Name
    replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS)
    template: TaskCreate
    rollout: RolloutPolicy = Field(default_factory=RolloutPolicy)


class ServiceChange(Input):
    """A change of a service: a new ``template`` starts a rolling update to it."""

    replicas: int | None = Field(default=None, ge=0, le=MAX_REPLICAS)
    template: TaskCreate | None = None
    rollout: RolloutPolicy | None = None


class ServiceStep(Output):
    """One step the service controller took (docs/services.md)."""

    at: datetime
    step: str
    detail: str | None


class ServiceInfo(Output):
    """A service, its rollout and its replicas now. ``rollout_state``: ``complete`` (all
    replicas of ``revision`` ready), ``progressing``, or ``rolled_back`` (the last new
    template was not ready within the deadline; ``revision`` is the previous one again)."""

    name: str
    owner: str
    replicas: int
    revision: int
    template: Stored[TaskCreate]
    rollout: Stored[RolloutPolicy]
    rollout_state: Literal["progressing", "complete", "rolled_back"]
    message: str | None
    #: live tasks of the service, those of ``revision``, and the ready ones of it
    live: int = 0
    current: int = 0
    ready: int = 0
    created_at: datetime
    updated_at: datetime
    steps: list[ServiceStep] = Field(default_factory=list)


class ServiceList(Output):
    items: list[ServiceInfo]


class TaskBatchCreate(Input):
    """Up to 1,000 submissions, accepted all together or not at all."""

    tasks: list[TaskCreate] = Field(min_length=1, max_length=MAX_BATCH)
    owners: list[Name] | None = Field(
        default=None,
        max_length=MAX_BATCH,
        description="The owner of each task, in order: for the service role only (cron "
        "firing many people's schedules at once submits them in one batch).",
    )

    @model_validator(mode="after")
    def _one_owner_each(self) -> TaskBatchCreate:
        if self.owners is not None and len(self.owners) != len(self.tasks):
            raise ValueError(
                f"owners has {len(self.owners)} names for {len(self.tasks)} tasks; "
                "give one owner per task"
            )
        return self


MAX_BULK = 10_000
MAX_BULK_COUNT = 100_000


class TaskSelector(Input):
    """Which tasks a bulk action takes: every condition given must hold. ``state`` must
    be one the action starts from; unset, every such state is taken."""

    state: TaskState | None = None
    queue: QueueName | None = None
    owner: Name | None = None
    #: the tasks this team owns (a member's bulk action on them; admins any team's)
    team: TeamName | None = None
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32)
    created_after: Annotated[AwareDatetime, AfterValidator(_storable_time)] | None = None
    created_before: Annotated[AwareDatetime, AfterValidator(_storable_time)] | None = None
    finished_after: Annotated[AwareDatetime, AfterValidator(_storable_time)] | None = None
    finished_before: Annotated[AwareDatetime, AfterValidator(_storable_time)] | None = None


class BulkAction(Input):
    """Retry or cancel the tasks a filter selects, at most ``limit`` of them in this call
    (oldest first); ``dry_run`` only counts them."""

    filter: TaskSelector = Field(default_factory=TaskSelector)
    dry_run: bool = False
    limit: int = Field(default=1000, ge=1, le=MAX_BULK)


class BulkResult(Output):
    """What a bulk action found and did."""

    #: tasks the filter selects now, before this call acted (counted up to 100,000)
    matched: int
    #: tasks this call moved (0 on a dry run)
    changed: int
    dry_run: bool
    #: whether selected tasks remain after this call: call again to take them
    more: bool
    #: selected tasks a retry left as they were: their owner may no longer run them
    #: (a team left, a queue's policy), as a submission of them would be refused now
    refused: int = 0
    #: why the first of them was refused
    refusal: str | None = None


ProgressMessage = Annotated[
    str, StringConstraints(max_length=MAX_PROGRESS_MESSAGE, pattern=r"^[^\x00-\x1f\x7f]*$")
]


class TaskProgress(Output):
    """What the task last said of its progress (``CAIRN_PROGRESS``), and of its latest
    checkpoint (``CAIRN_CHECKPOINT_OUT``): by which attempt, when, how large."""

    attempt_id: int
    fraction: float | None = None
    message: str | None = None
    updated_at: datetime | None = None
    checkpoint_bytes: int | None = None
    checkpoint_attempt_id: int | None = None
    checkpoint_at: datetime | None = None


class Task(Output):
    """A task as core stores it."""

    id: int
    owner: str
    name: str
    queue: str
    priority: int
    kind: Literal["task", "service"]
    artifact: Stored[Artifact]
    args: list[str]
    env: dict[str, str | Stored[SecretRef]]
    input_path: str | None
    output_path: str | None
    resources: Stored[Resources]
    preemptible: bool
    retry: Stored[RetryPolicy]
    timeout_s: int | None
    run_at: datetime
    idempotency_key: str | None
    labels: dict[str, str]
    state: TaskState
    attempts: int
    last_error: str | None
    current_attempt_id: int | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    defer_ok: bool = False
    deadline: datetime | None = None
    concurrency: Stored[Concurrency] | None = None
    #: why it is not running (ready, waiting, failed), computed when it is read
    pending_reason: str | None = None
    team: str | None = None
    #: when it ends ``dead`` if it has not started (its ``start_by``, ``max_wait_s`` or
    #: its queue's, whichever comes first)
    start_by: datetime | None = None
    progress_timeout_s: int | None = None
    #: its latest progress and checkpoint, when it reported any (read with the task)
    progress: TaskProgress | None = None
    #: which workers may take it, by their labels, as submitted
    placement: Stored[Placement] | None = None
    service: Stored[ServiceSpec] | None = None


class BatchItem(Output):
    id: int
    state: TaskState
    created: bool
    #: with the id, what names the task's trace (libs/common/tracing.py)
    created_at: datetime | None = None


class BatchResult(Output):
    """One entry per submitted task, in the order given."""

    tasks: list[BatchItem]


class TaskPage(Output):
    items: list[Task]
    next_cursor: str | None


class Attempt(Output):
    id: int
    task_id: int
    number: int
    worker_id: int | None
    outcome: str | None
    started_at: datetime
    ended_at: datetime | None
    exit_code: int | None
    peak_memory_mb: float | None
    cpu_seconds: float | None
    error: str | None
    log_tail: str | None
    charge_cpu: float | None = None
    charge_memory_mb: float | None = None
    #: the devices it held, by name (None: none)
    charge_devices: dict[str, int] | None = None
    squeezed_at: datetime | None = None
    preempted_by: int | None = None
    outputs: dict[str, Any] | None = None
    #: a service's replica: whether its readiness probe passes (None: not a service, or
    #: not reported yet), its host's address and its ports (docs/services.md)
    ready: bool | None = None
    address: str | None = None
    ports: dict[str, int] | None = None
    #: the signal that killed it, when the worker did not send it
    signal: int | None = None


class AttemptList(Output):
    items: list[Attempt]


class Event(Output):
    """One state change of one task; ``seq`` counts the task's own changes from 1."""

    cursor: str
    task_id: int
    seq: int
    owner: str
    op: str
    from_state: TaskState | None
    to_state: TaskState
    reason: str | None
    attempt_id: int | None
    at: datetime


class EventList(Output):
    items: list[Event]


class EventPage(Output):
    """A page of the feed. Pass ``next_cursor`` as ``after`` to read on; it moves even
    when the page is empty, and never skips an event that commits later."""

    items: list[Event]
    next_cursor: str


#: an ``allow`` policy's bound on its entries
MAX_EGRESS_RULES = 32


class EgressRule(Input):
    """One destination an ``allow`` policy opens: a CIDR range (IPv4 or IPv6; a bare
    address is one host) and, optionally, one port (TCP and UDP); no port: every port."""

    cidr: Annotated[str, StringConstraints(min_length=1, max_length=49)]
    port: int | None = Field(default=None, ge=1, le=65535)

    @field_validator("cidr")
    @classmethod
    def _network(cls, value: str) -> str:
        try:
            return str(ipaddress.ip_network(value.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{value!r} is not an IPv4 or IPv6 CIDR range") from None


class Egress(Input):
    """What an attempt's network may reach (docs/security.md, "Egress"): ``host`` (the
    default) the host's network, except the blocked destinations (link-local, the
    database: ``CAIRN_WORKER_EGRESS_BLOCK``); ``none`` its own network namespace with
    loopback only; ``allow`` only the ``allow`` list, the blocked destinations never."""

    mode: Literal["host", "none", "allow"] = "host"
    allow: list[EgressRule] = Field(default_factory=list, max_length=MAX_EGRESS_RULES)

    @model_validator(mode="after")
    def _allow_only_with_allow(self) -> Egress:
        if self.allow and self.mode != "allow":
            raise ValueError(f"allow is a list for mode allow only, not {self.mode}")
        return self


class QueueInfo(Output):
    name: str
    paused: bool
    depth: dict[TaskState, int]
    oldest_waiting_age_s: float | None
    #: preemptible work is charged its measured use divided by this
    overcommit: float = 1.0
    #: time-insensitive work is deferred while utilisation is above this share
    defer_above: float = 1.0
    #: the placement pass's last reading of how full the pool is (0 to 1)
    utilisation: float | None = None
    #: ``timeout_s`` of its tasks that set none (null: core's ``CAIRN_DEFAULT_TIMEOUT_S``)
    default_timeout_s: int | None = None
    #: the largest ``timeout_s`` a submission may ask for (null: no limit)
    max_timeout_s: int | None = None
    #: ``resources.disk_mb`` of its tasks that set none (null: the worker's default)
    default_disk_mb: int | None = None
    #: the largest ``resources.disk_mb`` a submission may ask for (null: no limit)
    max_disk_mb: int | None = None
    #: a task not started this long after it is due ends ``dead`` (null: no limit)
    max_wait_s: int | None = None
    #: what its attempts' network may reach
    egress: Stored[Egress] = Field(default_factory=Egress)


class QueueSettings(Input):
    """A queue's settings: its pool's placement, and its tasks' time limits. A field left
    out keeps its value, null restores the default. A default above the maximum is
    refused (422)."""

    overcommit: float | None = Field(default=None, ge=1, le=10)
    defer_above: float | None = Field(default=None, gt=0, le=1)
    default_timeout_s: int | None = Field(default=None, ge=1, le=MAX_TIME_LIMIT_S)
    max_timeout_s: int | None = Field(default=None, ge=1, le=MAX_TIME_LIMIT_S)
    max_wait_s: int | None = Field(default=None, ge=1, le=MAX_TIME_LIMIT_S)
    #: its tasks' disk quota when they ask none, and the most they may ask (MiB)
    default_disk_mb: int | None = Field(default=None, ge=1, le=MAX_DISK_MB)
    max_disk_mb: int | None = Field(default=None, ge=1, le=MAX_DISK_MB)
    #: its attempts' egress policy (null: ``host``, the default)
    egress: Egress | None = None


class QueueList(Output):
    items: list[QueueInfo]


class QueueSeries(Output):
    """One queue's last hour, a value a minute, oldest first."""

    name: str
    submitted: list[int]
    finished: list[int]
    backlog: list[int] = Field(description="Unfinished tasks at the end of each minute.")


class QueueHistory(Output):
    minutes: int
    until: datetime
    items: list[QueueSeries]


class TeamSource(Output):
    """Where a team of the caller comes from."""

    team: str
    #: ``membership``: an admin recorded it; ``claim``: the identity provider's groups
    #: claim it (through ``CAIRN_OIDC_TEAM_PREFIX`` or ``_MAP``)
    sources: list[Literal["membership", "claim"]]
    #: for a claim: until when it stands for what services do in the caller's name
    #: (the fires of the team's schedules, its workflows' node tasks) without a new token
    standing_until: datetime | None = None


class WhoAmI(Output):
    """The principal a token stands for."""

    name: str
    role: Role
    teams: list[str] = Field(default_factory=list)
    #: when the credential stops working (a token's expiry, a JWT's ``exp``, the end of
    #: a dashboard session)
    expires_at: datetime | None = None
    #: each team of ``teams``, with where it comes from
    team_sources: list[TeamSource] = Field(default_factory=list)
    #: how the caller is authenticated: a bearer token (Cairn's own or the provider's
    #: JWT), or the dashboard's session cookie
    via: Literal["token", "session"] = "token"


class LoginConfig(Output):
    """What a client needs to sign a person in at the identity provider."""

    issuer: str
    client_id: str
    scopes: str


class SessionToken(Output):
    """A short-lived bearer token of a dashboard session's person (for cron's and dag's
    APIs, which take bearer tokens): it ends with the session, at ``expires_at`` at
    the latest."""

    token: str
    expires_at: datetime


class Health(Output):
    status: Literal["ok", "unavailable"]
    detail: str | None = None


class Problem(Output):
    """An RFC 9457 problem document, as every error answer carries."""

    type: str
    title: str
    status: int
    detail: str
    instance: str | None = None
    errors: list[dict[str, str]] | None = None
    #: the request field a refusal is about (``body.priority``)
    field: str | None = None
    #: the quota a 429 names (``waiting``, ``submits_per_min``)
    quota: str | None = None
    retry_after_s: int | None = None


# --- workers ------------------------------------------------------------------------------


class WorkerRegister(Input):
    """What a worker agent offers when it starts."""

    hostname: Name
    queues: list[QueueName] = Field(min_length=1, max_length=64)
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32)
    cpu: float = Field(gt=0, le=4096)
    memory_mb: int = Field(ge=1, le=64 * 1024 * 1024)
    #: the countable devices it offers, by name (``{"gpu": 2}``)
    devices: Devices = Field(default_factory=dict)
    #: the agent turns at least every eighth of ``agent_hang_timeout_s`` (keep-alive turns
    #: when it claims nothing), so core may declare it dead when it takes no turn for the
    #: bound; agents from before leave it unset, and only their heartbeats count
    hang_watch: bool = False


class Worker(Output):
    id: int
    principal: str
    hostname: str
    queues: list[str]
    labels: dict[str, str]
    cpu: float
    memory_mb: int
    devices: dict[str, int] = Field(default_factory=dict)
    state: WorkerState
    registered_at: datetime
    last_heartbeat_at: datetime
    #: the agent's own last turn, as stored: turns rewrite it only once it is older than
    #: a quarter of the shorter liveness bound (so it lags by up to that); None for an
    #: agent that registered without ``hang_watch``
    last_turn_at: datetime | None = None
    used_cpu: float = 0
    used_memory_mb: int = 0
    #: the devices its attempts hold, by name
    used_devices: dict[str, int] = Field(default_factory=dict)
    running: int = 0


class WorkerList(Output):
    items: list[Worker]
    #: the next page (newest first), None on the last one
    next_cursor: str | None = None


#: the header that carries a worker's lease secret on every call made for that worker
WORKER_LEASE_HEADER = "X-Cairn-Worker-Lease"


class WorkerRegistered(Output):
    worker: Worker
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    #: an agent whose loop has not turned for this long is hung: its sidecar kills its
    #: attempts at half of it; core declares the worker dead at the whole
    agent_hang_timeout_s: float
    #: how far the stored liveness times may lag a turn (a turn rewrites them only when
    #: older): the agent's vouched window is shorter by this much
    turn_fresh_s: float
    #: the worker's lease secret: sent as ``X-Cairn-Worker-Lease`` on every call for this
    #: worker (heartbeat, claim, report, log, leave); core keeps only its sha-256
    lease: str


#: the most of each kind a heartbeat says hangs on sources (``Heartbeat``): an agent
#: with more (a spawn helper for each of thousands of cgroup v1 slots, 8 checkers each)
#: says this many
HUNG_SOURCES_MAX = 10_000


class Heartbeat(Input):
    """The attempts the worker's agent holds: being prepared or started, running, or
    ended and not yet reported (an open attempt left out is lost)."""

    attempts: list[TaskId] = Field(default_factory=list, max_length=10_000)
    #: the highest attempt id the agent had been handed when the sidecar read that list:
    #: an open attempt above it is not judged by this beat, whose list may have been read
    #: before its lease's answer reached the agent and be heard long after (a beat held
    #: by core through a database failover lost an attempt leased meanwhile, which then
    #: ran twice). None (an older sidecar; its last word): every open attempt is judged
    seen: int | None = Field(default=None, ge=0, le=2**63 - 1)
    #: the agent's loop has stood still this many seconds, past the hang bound: the
    #: sidecar killed its attempts, and core declares the worker dead at once
    hung_s: float | None = Field(default=None, ge=0, le=10.0**9)
    #: the agent's threads left to opens or reads of ``file://`` sources that did not
    #: answer, and its spawn helpers' checker processes of such sources held aside
    #: (docs/security.md, "A ``file://`` source that does not answer"); core's gauge
    #: ``cairn_workers_hung_sources``
    hung_source_threads: int = Field(default=0, ge=0, le=HUNG_SOURCES_MAX)
    hung_source_checkers: int = Field(default=0, ge=0, le=HUNG_SOURCES_MAX)


class HeartbeatAnswer(Output):
    state: WorkerState
    #: attempts the worker must stop: cancelled, or no longer current (lost)
    stop: list[int]
    #: attempts to run with a lower CPU share (guaranteed work needs the CPU)
    squeeze: list[int] = Field(default_factory=list)
    #: attempts to stop (SIGTERM, ``preempt_grace_s``, SIGKILL) and report ``preempted``
    preempt: list[int] = Field(default_factory=list)
    preempt_grace_s: float = 10.0


class ClaimRequest(Input):
    """Room the worker has now; core hands out work that fits it."""

    cpu: float = Field(ge=0, le=4096)
    memory_mb: int = Field(ge=0, le=64 * 1024 * 1024)
    max: int = Field(default=16, ge=1, le=256)
    wait: float = Field(default=0, ge=0, le=MAX_WAIT_S)
    #: also lease delayed work due within this many seconds (capped by core's
    #: ``CAIRN_CLAIM_AHEAD_MAX_S``), each with its ``start_at``: only into room left once
    #: the work due now is served (docs/architecture.md, "Claiming ahead")
    ahead_s: float = Field(default=0, ge=0, le=MAX_AHEAD_S)


class Charge(Output):
    """What an attempt holds against its worker's capacity."""

    cpu: float
    memory_mb: float
    #: whole devices, by name: never overcommitted, always the request
    devices: dict[str, int] = Field(default_factory=dict, exclude_if=lambda value: not value)


class Assignment(Output):
    """One attempt leased to a worker: everything it needs to run it."""

    attempt_id: int
    attempt_number: int
    task_id: int
    kind: Literal["task", "service"]
    artifact: Artifact
    args: list[str]
    env: dict[str, str]
    input_path: str | None
    output_path: str | None
    resources: Resources
    timeout_s: int | None
    charge: Charge | None = None
    #: W3C trace context of the claim, when core traces (libs/common/tracing.py)
    traceparent: Annotated[str, StringConstraints(max_length=55)] | None = None
    #: the agent may preempt it under memory pressure (it is charged its measured use)
    preemptible: bool = False
    #: leased ahead (``ClaimRequest.ahead_s``): start its process at this instant (its
    #: ``run_at``, by core's clock), not before; None: start it now
    start_at: datetime | None = None
    #: end it as ``timeout`` when it writes no progress for this long
    progress_timeout_s: int | None = None
    #: the latest checkpoint of its task (base64), for ``CAIRN_CHECKPOINT``
    checkpoint: str | None = None
    #: the attempt's fencing token, for ``CAIRN_FENCING_TOKEN`` (docs/progress.md)
    fencing_token: str | None = None
    #: its queue's egress policy (None: ``host``), applied by the agent (serialised as
    #: held: core sends one stored under older rules as it is, ``db.attempts``)
    egress: SerializeAsAny[Egress] | None = None
    #: the opened value of ``artifact.credentials`` (``S3Credentials``), for that fetch only
    artifact_credentials: S3Credentials | None = Field(
        default=None, exclude_if=lambda value: value is None
    )
    #: a service's ports and probes, run by the agent (docs/services.md)
    service: SerializeAsAny[ServiceSpec] | None = Field(
        default=None, exclude_if=lambda value: value is None
    )


class ClaimAnswer(Output):
    attempts: list[Assignment]


def _bounded_outputs(outputs: dict[str, Any]) -> dict[str, Any]:
    return kept_json(outputs, "outputs", MAX_OUTPUTS_BYTES)


def kept_json(value: _J, name: str, max_bytes: int) -> _J:
    """``value`` (JSON as parsed, the field ``name``) if ``json_problem`` finds none and
    it is at most ``max_bytes`` as JSON, else a ValueError saying why: the AfterValidator
    of every field whose JSON is kept as given (outputs, event data, params)."""
    problem = json_problem(value, name)
    if problem is not None:
        raise ValueError(problem)
    if len(json.dumps(value)) > max_bytes:
        raise ValueError(f"{name} must be at most {max_bytes} bytes as JSON")
    return value


def outputs_problem(outputs: Any) -> str | None:
    """Why ``outputs`` cannot be carried in a report, or None (``json_problem``)."""
    return json_problem(outputs, "outputs")


def json_problem(value: Any, name: str) -> str | None:
    """Why ``value`` (JSON as parsed, the field ``name``) cannot be kept as given, or
    None: nested deeper than ``MAX_JSON_DEPTH``, a NUL (PostgreSQL's text and jsonb hold
    none), an unpaired surrogate (a JSON ``\\ud800`` escape: no UTF-8 encoder takes it,
    the agent's turn neither), an integer past 64 bits (the services' encoder refuses
    it), NaN or Infinity (not JSON: jsonb would keep null). One walk, without recursion,
    so any depth is answered."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            problem = _string_problem(item, name)
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, float):
            problem = None if math.isfinite(item) else f"{name} must be JSON: no NaN or Infinity"
        elif isinstance(item, int):
            problem = None if -MAX_JSON_INT - 1 <= item <= MAX_JSON_INT else _big_int(name)
        elif depth > MAX_JSON_DEPTH:
            problem = too_deep(name)
        elif isinstance(item, dict):
            stack.extend((key, depth) for key in item)
            stack.extend((inner, depth + 1) for inner in item.values())
            continue
        else:
            stack.extend((inner, depth + 1) for inner in item)
            continue
        if problem is not None:
            return problem
    return None


def _big_int(name: str) -> str:
    return f"{name}: integers must fit in 64 bits (-2**63 to 2**63 - 1)"


def _string_problem(text: str, name: str) -> str | None:
    if "\x00" in text:
        return f"{name} may not hold NUL characters"
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            return f"{name} may not hold an unpaired surrogate (such as \\ud800)"
    return None


OutputKey = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
]
#: the JSON object a task wrote to its ``CAIRN_OUTPUTS`` file
Outputs = Annotated[
    dict[OutputKey, JsonValue], Field(max_length=MAX_OUTPUTS), AfterValidator(_bounded_outputs)
]


#: why a worker handed an attempt back, where core treats it apart: ``source``: its
#: ``file://`` source did not answer the spawn helper's check in time (docs/security.md,
#: "A ``file://`` source that does not answer"); core buries the task after
#: ``CAIRN_SOURCE_UNANSWERED_MAX`` of them in a row. A report without one (an older
#: worker's, a drain's, a check the helper could not make, which says nothing of the
#: source), or a task whose artifact is not ``file://``, is an ordinary hand-back
HandBackCause = Literal["source"]


class Report(Input):
    """How an attempt ended. ``handed_back``: not run to the end (drain, preemption), so it
    does not spend an attempt; ``preempted``: stopped at core's request for guaranteed
    work, requeued without spending one either. ``crashed``: the process died of a signal the
    worker did not send; it counts towards the poison-pill limit. ``oom_killed``: the
    attempt went over its memory limit and the kernel killed it; retried as a failure.
    ``disk_exceeded``: it failed with its files filling its disk quota (``disk_mb``: a
    write failed with ENOSPC); retried as a failure too.
    ``retryable: false`` makes a failure final. ``hand_back_cause``: why a
    ``handed_back`` attempt did not start, when the worker knows (``HandBackCause``)."""

    outcome: ReportedOutcome
    exit_code: int | None = Field(default=None, ge=-(2**31), le=2**31 - 1)
    #: ``crashed``: the signal that killed the process
    signal: int | None = Field(default=None, ge=1, le=64)
    error: Annotated[str, StringConstraints(max_length=4096)] | None = None
    retryable: bool = True
    peak_memory_mb: float | None = Field(default=None, ge=0, le=1e9)
    cpu_seconds: float | None = Field(default=None, ge=0, le=1e9)
    log_tail: Annotated[str, StringConstraints(max_length=16384)] | None = None
    #: what the attempt wrote to its ``CAIRN_OUTPUTS`` file (a JSON object), if anything
    outputs: Outputs | None = None
    #: how many bytes of output the attempt wrote, when the end of its log is still on
    #: its way to core (core then takes the rest for ``CAIRN_LOG_LATE_S``: docs/logs.md);
    #: omitted when core has it all. This field and the next are left out of a report's
    #: body when unset, so a core that predates them takes the report (docs/deploy.md)
    log_bytes: int | None = Field(
        default=None, ge=0, le=2**62, exclude_if=lambda value: value is None
    )
    hand_back_cause: HandBackCause | None = Field(
        default=None, exclude_if=lambda value: value is None
    )

    @model_validator(mode="after")
    def _cause_of_hand_back(self) -> Report:
        if self.hand_back_cause is not None and self.outcome != "handed_back":
            raise ValueError("hand_back_cause: only a handed_back report has one")
        return self


class ReportAnswer(Output):
    task_id: int
    state: TaskState


# --- live logs (docs/logs.md) ----------------------------------------------------------

MAX_LOG_CHUNK = 64 * 1024
MAX_LOG_BATCH = 256
AttemptId = Annotated[int, Field(ge=1, le=2**63 - 1)]


class LogChunk(Input):
    """Bytes ``offset`` to ``offset + length`` of the attempt's log file on its worker,
    decoded as ``text``. Core keeps each (attempt, offset) once, so a retried batch is
    not doubled; an ``offset`` past what core has means the worker skipped output."""

    attempt_id: AttemptId
    offset: int = Field(ge=0, le=2**62)
    length: int = Field(ge=1, le=MAX_LOG_CHUNK)
    text: Annotated[str, StringConstraints(min_length=1, max_length=MAX_LOG_CHUNK)]


class LogBatch(Input):
    """What a worker ships in one request: chunks of any of its running attempts."""

    chunks: list[LogChunk] = Field(min_length=1, max_length=MAX_LOG_BATCH)

    @model_validator(mode="after")
    def _in_order(self) -> LogBatch:
        """One attempt's chunks follow each other in the file, none overlapping an
        earlier one (a gap is skipped output; an overlap is no worker's)."""
        ends: dict[int, int] = {}
        for chunk in self.chunks:
            if chunk.offset < ends.get(chunk.attempt_id, 0):
                raise ValueError(
                    f"chunks: attempt {chunk.attempt_id}'s chunk at offset {chunk.offset} "
                    "overlaps an earlier one of this batch"
                )
            ends[chunk.attempt_id] = chunk.offset + chunk.length
        return self


class LogAck(Output):
    """One chunk's answer: ``status`` 200 (stored, or already held), 409 (the attempt is
    no longer this worker's, or has ended and its log is closed: ship no more of it) or
    422 (past the end of the output its report gave); ``next_offset`` is where core's copy
    of the file ends, where the next chunk starts; ``detail`` says why a chunk is refused."""

    attempt_id: int
    offset: int
    status: int
    next_offset: int
    detail: str | None = None


class LogBatchAnswer(Output):
    items: list[LogAck]


class LogPiece(Output):
    """A part of a stored log, as ``GET /v1/tasks/{id}/logs?follow=true`` sends it (the
    data of an SSE ``log`` event): ``text`` starts at ``offset`` of the stored log and
    ends at ``next_offset``, the cursor to resume from."""

    attempt_id: int
    offset: int
    next_offset: int
    text: str


class LogEnd(Output):
    """The data of the SSE ``end`` event: the attempt ended and all of its log was sent."""

    attempt_id: int | None
    outcome: str | None
    next_offset: int
    task_state: TaskState


MAX_TURN_ITEMS = 256
#: attempts one ``Starts`` may name: as many as a worker may hold (``worker_slots``)
MAX_STARTS = 4096


#: the variable naming an attempt's outputs file (services/worker/outputs.py), which
#: the reason of an attempt failed for what it wrote there starts with
OUTPUTS_ENV = "CAIRN_OUTPUTS"
#: what of a report a turn keeps when it fails the attempt for its outputs
_KEPT_OF_REFUSED = (
    "attempt_id",
    "exit_code",
    "peak_memory_mb",
    "cpu_seconds",
    "log_tail",
    "log_bytes",
)


class AttemptReport(Report):
    """A report inside a worker's turn: the attempt it is about, and how it ended (its
    log reached core apart, in chunks: docs/logs.md). A report whose ``outputs`` break
    ``json_problem`` (sent by an agent from before that rule) is refused alone: it is read
    as the attempt failed, not retryable, naming the rule, as a newer agent reports such
    an attempt itself, so the rest of its turn is applied."""

    attempt_id: TaskId

    @model_validator(mode="before")
    @classmethod
    def _outputs_refused_alone(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("outputs") is None:
            return data
        problem = json_problem(data["outputs"], "outputs")
        if problem is None:
            return data
        kept = {key: data[key] for key in _KEPT_OF_REFUSED if key in data}
        return {
            **kept,
            "outcome": "failed",
            "error": f"{OUTPUTS_ENV}: {problem}",
            "retryable": False,
        }


def _checkpoint_size(value: str | None) -> str | None:
    if value is not None and len(value) * 3 // 4 - value[-2:].count("=") > MAX_CHECKPOINT_BYTES:
        raise ValueError(f"a checkpoint must be at most {MAX_CHECKPOINT_BYTES} bytes")
    return value


Checkpoint = Annotated[
    str,
    StringConstraints(
        min_length=0,
        max_length=(MAX_CHECKPOINT_BYTES + 2) // 3 * 4,
        pattern=r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$",
    ),
    AfterValidator(_checkpoint_size),
]


class ProgressNote(Input):
    """What a running attempt last wrote of its progress and (or) its checkpoint (base64),
    as its agent read them (docs/progress.md). ``progress`` false: only the checkpoint
    changed. Core keeps it while the attempt is its task's current one."""

    attempt_id: TaskId
    progress: bool = True
    fraction: float | None = Field(default=None, ge=0, le=1)
    message: ProgressMessage | None = None
    checkpoint: Checkpoint | None = None


class Turn(Input):
    """One round trip of a worker agent: the reports of attempts that ended since its last
    turn, the attempts it started since (acknowledged, not asked for), the progress its
    running attempts wrote, and the room it wants filled (none: only report). Core
    applies it in one transaction."""

    reports: list[AttemptReport] = Field(default_factory=list, max_length=MAX_TURN_ITEMS)
    started: list[TaskId] = Field(default_factory=list, max_length=MAX_TURN_ITEMS)
    claim: ClaimRequest | None = None
    progress: list[ProgressNote] = Field(default_factory=list, max_length=MAX_TURN_ITEMS)
    #: sent when the answer to the worker's last turn never came (a broken connection, a
    #: timeout, a 5xx: core may have committed a lease the worker never saw): every
    #: attempt the worker holds. Core answers again, among ``attempts``, each attempt it
    #: holds for the worker that the worker has neither started nor listed here, with a
    #: new fencing token (the first was never seen), so a lost answer costs no attempt.
    holding: list[TaskId] | None = Field(default=None, max_length=10_000)
    #: the agent drains (SIGTERM): core marks a live worker ``draining`` before it applies
    #: the rest of the turn, leases it nothing more, and answers its claim waiting at
    #: core at once (nothing leased), so the agent hears that claim's answer, and the
    #: verdicts of the reports it carried, instead of giving it up
    draining: bool = False

    @model_validator(mode="after")
    def _draining_claims_nothing(self) -> Turn:
        if self.draining and self.claim is not None:
            raise ValueError("claim: a turn that says its worker drains claims nothing")
        return self

    @model_validator(mode="after")
    def _checkpoints_bounded(self) -> Turn:
        total = sum(len(n.checkpoint or "") for n in self.progress) * 3 // 4
        if total > MAX_TURN_CHECKPOINT_BYTES:
            raise ValueError(
                f"progress: checkpoints of one turn must be at most "
                f"{MAX_TURN_CHECKPOINT_BYTES} bytes together"
            )
        return self


class Starts(Input):
    """Attempts leased ahead whose ``start_at`` has come: the agent asks, for all of
    them at once, whether core still holds them before it starts their processes."""

    attempts: list[TaskId] = Field(min_length=1, max_length=MAX_STARTS)


class StartsAnswer(Output):
    #: held for this worker: start them
    held: list[int]
    #: no longer held (cancelled, lost, not this worker's): never start them
    gone: list[int]


class ReportVerdict(Output):
    """What became of one report of a turn: ``status`` 200 (applied; ``state`` is the
    task's state now), 409 (stale: not the task's current attempt, or not this worker's)
    or 404 (no such attempt); a refused report changed nothing. ``ended_as``: refused
    because the attempt had already ended, how it ended (the same outcome as the report's
    when it is this report again: sent by a turn whose answer was lost, and applied then)."""

    attempt_id: int
    status: Literal[200, 404, 409]
    task_id: int | None = None
    state: TaskState | None = None
    detail: str | None = None
    ended_as: AttemptOutcome | None = None


class FencingCheck(Input):
    """Is the attempt that holds this fencing token still its task's current one?"""

    token: Annotated[str, StringConstraints(max_length=64, pattern=FENCING_TOKEN_PATTERN)]


class FencingAnswer(Output):
    """``current``: the attempt is its task's current attempt and still running, so a
    write it fences may go ahead. ``epoch`` grows with each attempt of the task: a system
    that remembers the highest epoch it accepted refuses an older one."""

    current: bool
    task_id: int
    attempt_id: int
    epoch: int


class TurnAnswer(Output):
    #: the worker's state: a ``dead`` or ``left`` worker is leased nothing
    state: WorkerState
    reports: list[ReportVerdict]
    attempts: list[Assignment]
    #: leased attempts the worker could not read, (attempt id, why): ``CoreClient.turn``
    #: takes them out of ``attempts``, for the agent to fail them alone; not on the wire
    _unreadable: list[tuple[int, str]] = PrivateAttr(default_factory=list)
    #: the claim waited in core's line for work (a long poll): without it, work was
    #: waiting when the turn looked, and the agent's next claim is likely answered as
    #: soon (its reports ride on it rather than in a turn of their own)
    waited: bool = False


# --- right-sizing -------------------------------------------------------------------------


class UsageRow(Output):
    """One kind of task (owner, name): what it asks for, what it uses, what to ask for."""

    owner: str
    name: str
    attempts: int
    requested_cpu: float
    requested_memory_mb: float
    p95_cpu: float
    p95_memory_mb: float
    suggested_cpu: float
    suggested_memory_mb: int
    #: the measured p95 as a share of the request, of the fuller resource
    used_share: float
    #: the devices its attempts asked for, on average, by name (held whole while they
    #: run: a hint to ask for fewer where the work does not use them)
    requested_devices: dict[str, float] = Field(default_factory=dict)


class UsageReport(Output):
    items: list[UsageRow]


#: a calendar month, as ``2026-12``
Month = Annotated[str, StringConstraints(pattern=r"^[1-9][0-9]{3}-(0[1-9]|1[0-2])$")]


class UsageAccount(Output):
    """What the attempts that ended in a month used, for one owner, team or queue
    (docs/sharing.md, "Usage"). Reserved: the attempts' charges over their wall time."""

    #: the owner, team or queue
    key: str
    attempts: int
    wall_s: float
    #: CPU seconds used, as the agents measured them
    cpu_s: float
    #: core-seconds reserved
    cpu_reserved_s: float
    #: MB-seconds of memory reserved
    memory_mb_s: float
    #: the largest peak memory of one attempt
    peak_memory_mb: float
    #: device-seconds held, by device name (``{"gpu": 7200.0}``)
    device_s: dict[str, float] = Field(default_factory=dict)


class UsageAccounts(Output):
    month: Month
    by: Literal["owner", "team", "queue"]
    items: list[UsageAccount]


# --- identity: tokens, teams, secrets, audit ----------------------------------------------


class TokenCreate(Input):
    """A new token. Without ``principal`` it is the caller's own; only admins name another
    principal (and ``role``, for one that does not exist yet)."""

    name: Annotated[
        str, StringConstraints(min_length=1, max_length=100, pattern=r"^[^\x00-\x1f\x7f]+$")
    ]
    principal: PrincipalName | None = None
    role: Role | None = None
    expires_at: Annotated[AwareDatetime, AfterValidator(_storable_time)] | None = None


class TokenInfo(Output):
    """A token as the API shows it: never its value, which only its creation answer holds."""

    id: int
    name: str
    principal: str
    role: str
    created_at: datetime
    created_by: str | None
    expires_at: datetime | None
    last_used_at: datetime | None
    revoked_at: datetime | None


class TokenCreated(Output):
    token: str = Field(description="The bearer token; shown this once, stored only as a hash.")
    info: TokenInfo


class TokenList(Output):
    items: list[TokenInfo]


class PrincipalInfo(Output):
    """A principal as core keeps it: its role, and whether an admin has disabled it (someone
    who left: its tokens, sessions, the work services submit for it and its webhooks are
    refused until it is enabled again)."""

    name: str
    role: Role
    created_at: datetime
    disabled_at: datetime | None = None
    disabled_by: str | None = None


class TeamCreate(Input):
    name: TeamName
    reuse_name: bool = Field(
        default=False,
        description=(
            "Take the name of a team deleted before: its tasks, schedules and workflows "
            "still name it, and the new team's members will see and act on them. Without "
            "it, such a name is a 409."
        ),
    )


class Team(Output):
    name: str
    members: list[str]
    created_at: datetime
    created_by: str


class TeamList(Output):
    items: list[Team]


SecretValue = Annotated[
    str, StringConstraints(min_length=1, max_length=8192, pattern=r"^[^\x00]*$")
]


class SecretCreate(Input):
    """A secret of the caller, or with ``team`` of a team the caller belongs to."""

    name: SecretName
    value: SecretValue
    team: TeamName | None = None


class SecretUpdate(Input):
    value: SecretValue


class SecretInfo(Output):
    """A secret's name and metadata; its value is never returned."""

    name: str
    owner: str | None
    team: str | None
    created_at: datetime
    updated_at: datetime
    created_by: str
    updated_by: str


class SecretList(Output):
    items: list[SecretInfo]


class RekeyRequest(Input):
    """How many sealed values one call may visit, and where to go on from (the CLI calls
    again with the last answer's ``next`` until it is null)."""

    limit: Annotated[int, Field(ge=1, le=10_000)] = 1000
    #: the last call's ``next`` (``COLUMN:ID``); none: from the start
    after: Annotated[str | None, Field(pattern=r"^[a-z_]{1,40}:[0-9]{1,19}$")] = None


class RekeyResult(Output):
    """What one rekey call did: values sealed anew under ``key_id``, those that do not
    open with their key (left as they are), and how many are still under another key."""

    key_id: str
    rekeyed: int
    unreadable: int
    remaining: int
    #: where the next call goes on from (``after``), past the values this one visited
    #: (those that do not open included); null: every value was visited
    next: str | None = None


class SealedCount(Output):
    """How many values of a sealed column one key seals."""

    column: str
    key_id: str
    rows: int
    #: the key is in CAIRN_SECRETS_KEY (or its file): the values open
    configured: bool
    #: the key new values are sealed with
    current: bool


class KeyStatus(Output):
    """The secrets keys core holds and what each seals; ``remaining`` values are under a
    key other than the current one (0: every older key may be removed)."""

    current: str
    configured: list[str]
    columns: list[SealedCount]
    remaining: int


class AuditEntry(Output):
    """One security-relevant action: who, what, on what, from where, when, before/after."""

    id: int
    at: datetime
    actor: str
    actor_role: str
    action: str
    target: str
    source: str | None
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    prev_hash: str | None = Field(default=None, description="The hash of the row before.")
    hash: str | None = Field(
        default=None, description="sha256(prev_hash || canonical JSON): docs/security.md."
    )


def _small_json(value: dict[str, Any]) -> dict[str, Any]:
    # kept as given in the chained trail: the one rule of such JSON (``kept_json``); a
    # NUL or an integer past 64 bits was a 500 of the database or the encoder
    return kept_json(value, "after", 4096)


class AuditReport(Input):
    """An action a person took through the cron or DAG service (an approval gate's
    decision), reported by that service for core's audit trail: who (None: the
    service itself, as when a gate's timeout decided), with which role, what, on what,
    and what it left. Its ``source`` is the reporting service."""

    action: Annotated[
        str, StringConstraints(max_length=64, pattern=r"^(dag|cron)\.[a-z_]+(\.[a-z_]+)*$")
    ]
    target: Name
    actor: PrincipalName | None = None
    actor_role: Literal["user", "admin", "service"] | None = None
    after: Annotated[dict[str, Any], AfterValidator(_small_json)] = Field(
        default_factory=dict, max_length=32
    )
    idempotency_key: IdempotencyKey | None = Field(
        default=None,
        description="A report sent again with the key of one the same service reported"
        " is recorded once (409 if it differs).",
    )


class AuditPage(Output):
    items: list[AuditEntry]
    next_before: int | None = Field(description="Pass as before= to read older entries.")


class AuditChainPage(Output):
    """The chained trail oldest first, for an export (docs/security.md)."""

    items: list[AuditEntry]
    next_after: int | None = Field(description="Pass as after= to read the next rows.")
    exported_through: int = Field(description="The last id the scheduled export wrote.")


# --- sharing ------------------------------------------------------------------------------


class ShareSettings(Input):
    """An owner's share and quotas, set by an admin; a field left out keeps its value,
    null removes the limit (the weight: back to 1)."""

    weight: float | None = Field(default=None, gt=0, le=1000)
    max_cpu: float | None = Field(default=None, gt=0, le=1_000_000)
    max_memory_mb: float | None = Field(default=None, gt=0, le=2**40)
    max_running: int | None = Field(default=None, ge=1, le=10_000_000)
    #: devices running at once, by name (``{"gpu": 4}``)
    max_devices: Devices | None = None
    max_waiting: int | None = Field(default=None, ge=1, le=100_000_000)
    max_submits_per_min: int | None = Field(default=None, ge=1, le=100_000_000)


class Quotas(Output):
    max_cpu: float | None = None
    max_memory_mb: float | None = None
    max_running: int | None = None
    max_devices: dict[str, int] | None = None
    max_waiting: int | None = None
    max_submits_per_min: int | None = None


class RunningUse(Output):
    attempts: int
    cpu: float
    memory_mb: float
    devices: dict[str, int] = Field(default_factory=dict)


class OwnerUsage(Output):
    """An owner's (or a team's) share, what it runs and has waiting, its quotas, and which
    it is at."""

    name: str
    #: ``owner``: a principal's work, all it submitted; ``team``: the work a team owns
    kind: Literal["owner", "team"] = "owner"
    weight: float
    #: its weight over the weights of every owner with work running or waiting
    share: float
    running: RunningUse
    waiting: int
    quota: Quotas
    #: the quotas it is at now, by name (``cpu``, ``memory``, ``running``, ``waiting``, a
    #: device's name)
    at_quota: list[str]
    submitted_last_minute: int
    #: the core-seconds its ended attempts reserved, halved every
    #: ``CAIRN_FAIR_SHARE_HALF_LIFE_S``, as of now: what fair share by usage weighs
    #: (docs/sharing.md; counted by the usage loop, every ``CAIRN_USAGE_INTERVAL_S``)
    decayed_cpu_s: float = 0.0


class OwnerList(Output):
    items: list[OwnerUsage]


class PriorityRange(Input):
    min: int = Field(default=-100, ge=-100, le=100)
    max: int = Field(default=100, ge=-100, le=100)

    @model_validator(mode="after")
    def _ordered(self) -> PriorityRange:
        if self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}")
        return self


PolicyRole = Literal["user", "admin", "service"]


class QueuePolicy(Input):
    """What submitters may ask for in a queue. A role missing from ``priority`` may use
    any priority; ``owners`` null lets everyone in. ``services`` and ``guaranteed`` apply
    to the user role (and to a service submitting on someone's behalf)."""

    priority: dict[PolicyRole, PriorityRange] = Field(default_factory=dict, max_length=3)
    services: bool = True
    guaranteed: bool = True
    owners: list[Name] | None = Field(default=None, max_length=10_000)
    #: how the claim orders this queue's work across owners (docs/sharing.md): by the
    #: fair-share stamps alone (``tasks``) or pushed back by decayed usage (``usage``);
    #: null: core's ``CAIRN_FAIR_SHARE``
    fair_share: Literal["tasks", "usage"] | None = None


class ConcurrencyLimit(Input):
    """An admin's limits for a concurrency key: running at once, and starts per window."""

    max_running: int | None = Field(default=None, ge=1, le=100_000)
    max_starts: int | None = Field(default=None, ge=1, le=100_000_000)
    window_s: float | None = Field(default=None, gt=0, le=86400)

    @model_validator(mode="after")
    def _rate_has_window(self) -> ConcurrencyLimit:
        if (self.max_starts is None) != (self.window_s is None):
            raise ValueError("max_starts and window_s go together")
        return self


class ConcurrencyState(Output):
    key: str
    max_running: int | None
    max_starts: int | None
    window_s: float | None
    running: int
    started_in_window: int


# Notifications (docs/notifications.md): subscriptions, deliveries and their answers, and
# the events the cron and DAG services post.

#: what a subscription may ask to hear about
EventName = Literal[
    "task.dead",
    "task.deadline_missed",
    "run.failed",
    "fire.missed",
    "fire.failed",
    "approval.waiting",
]
#: the events cron and DAG post (the others core sees itself)
PostedEvent = Literal["run.failed", "fire.missed", "fire.failed", "approval.waiting"]
DeliveryState = Literal["pending", "delivered", "failed"]
MAX_SUBSCRIPTIONS = 100
EventText = Annotated[str, StringConstraints(max_length=1000, pattern=r"^[^\x00]*$")]
EventKey = Annotated[
    str, StringConstraints(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")
]


def _webhook_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https"):
        raise ValueError("must be an http:// or https:// URL")
    if not parts.hostname:
        raise ValueError("must name a host")
    if parts.username or parts.password:
        raise ValueError("must not carry credentials; the signature authenticates Cairn")
    try:
        parts.port  # noqa: B018 - urlsplit checks the port when it is read
    except ValueError:
        raise ValueError("must have a port from 0 to 65535") from None
    return value


WebhookUrl = Annotated[
    str,
    StringConstraints(min_length=8, max_length=2048, pattern=r"^[^\s\x00-\x1f\x7f]+$"),
    AfterValidator(_webhook_url),
]


class SubscriptionFilter(Input):
    """Only events of tasks in this queue and carrying all these labels (task events;
    posted events match on the queue and labels they name)."""

    queue: QueueName | None = None
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32)


class SubscriptionCreate(Input):
    """A webhook to call when one of ``events`` happens to the caller's work."""

    name: Name
    events: list[EventName] = Field(min_length=1, max_length=6)
    filter: SubscriptionFilter = Field(default_factory=SubscriptionFilter)
    url: WebhookUrl


class Subscription(Output):
    id: int
    owner: str
    name: str
    events: list[EventName]
    filter: Stored[SubscriptionFilter]
    url: str
    enabled: bool
    #: why deliveries stopped (set when ``enabled`` is false)
    disabled_reason: str | None
    #: failed deliveries in a row; at the limit the subscription is disabled
    failures: int
    created_at: datetime
    updated_at: datetime


class SubscriptionCreated(Subscription):
    """The new subscription with its signing secret, which is shown only this once."""

    secret: str


class SubscriptionList(Output):
    items: list[Subscription]


class Answer(Output):
    """One try of one delivery: the webhook's status, or the error instead."""

    delivery_id: UUID
    event: str
    try_: int = Field(alias="try")
    at: datetime
    status: int | None
    error: str | None
    duration_ms: float


class AnswerList(Output):
    items: list[Answer]


class Delivery(Output):
    """A notification in the outbox and where its delivery stands."""

    delivery_id: UUID
    subscription_id: int
    event: str
    state: DeliveryState
    tries: int
    next_at: datetime
    created_at: datetime
    finished_at: datetime | None
    last_status: int | None
    last_error: str | None
    last_at: datetime | None


class DeliveryList(Output):
    items: list[Delivery]


class NotificationEvent(Input):
    """An event cron or DAG saw, posted for ``owner``'s subscriptions. ``key`` names the
    occurrence (a schedule and fire time, a run): posting it again notifies nobody twice."""

    event: PostedEvent
    owner: Name
    key: EventKey
    summary: EventText = ""
    queue: QueueName | None = None
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32)
    subject: dict[EventKey, EventText] = Field(default_factory=dict, max_length=32)
    at: StorableTime | None = None


class NotificationAccepted(Output):
    """How many subscriptions got a delivery queued for the event (0: none match, or all
    already had it)."""

    queued: int
