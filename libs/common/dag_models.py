"""The wire format of the DAG service: workflow definitions, runs and their nodes.

Definitions refuse unknown fields and bound every list, map and string, as core's
submissions do. What a graph means (no cycle, every ``depends_on`` known) is checked by the
DAG service, which names the offending nodes.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    Field,
    StringConstraints,
    model_validator,
)

from libs.common.models import (
    MAX_TIME_LIMIT_S,
    IdempotencyKey,
    Input,
    Output,
    PrincipalName,
    TaskCreate,
    TeamName,
    kept_json,
)
from libs.common.stored import Stored

MAX_NODES = 10_000
MAX_DEPENDS_ON = 1_000
MAX_PARAMS = 100
MAX_PARAMS_BYTES = 64 * 1024
MAX_NODE_LABELS = 30
MAX_OUTPUT_DECLS = 32
#: the most items one node may map over (its own ``map.max_items`` may be lower)
MAX_MAP_ITEMS = 10_000
#: the most instances all the maps of one run may make (the sum of their max_items)
MAX_RUN_INSTANCES = 100_000
MAX_RUN_TIMEOUT_S = 30 * 86400
#: the longest branch condition (a node's ``when``), in characters
MAX_WHEN_CHARS = 1024
#: the longest an approval gate waits for a person
MAX_APPROVAL_TIMEOUT_S = MAX_RUN_TIMEOUT_S
#: the most people an approval gate names
MAX_APPROVERS = 100
#: the longest comment on an approval decision, in characters
MAX_COMMENT_CHARS = 2000
#: the deepest sub-workflows nest: a run's child's child's ... at most this many levels
MAX_SUBFLOW_DEPTH = 5
#: the longest an event node waits for its event
MAX_EVENT_TIMEOUT_S = MAX_RUN_TIMEOUT_S
#: the largest data an event carries (and a trigger's body), as JSON bytes
MAX_EVENT_BYTES = 64 * 1024
#: the most triggers one workflow has
MAX_TRIGGERS = 20
#: the most runs the history grid shows
MAX_HISTORY_RUNS = 100

NodeName = Annotated[
    str, StringConstraints(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
]
EventName = Annotated[
    str, StringConstraints(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
]
#: where a value sits in a JSON payload: keys separated by dots (``order.id``)
PayloadPath = Annotated[
    str,
    StringConstraints(
        min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+){0,9}$"
    ),
]
WorkflowName = Annotated[
    str, StringConstraints(min_length=1, max_length=100, pattern=r"^[a-z0-9][a-z0-9_.\-]*$")
]
ParamName = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
]
ParamScalar = (
    Annotated[str, StringConstraints(max_length=8192, pattern=r"^[^\x00]*$")]
    | int
    | float
    | bool
    | None
)
#: a list parameter is what a node may map over (``map.over: "{{ params.NAME }}"``)
ParamValue = ParamScalar | Annotated[list[ParamScalar], Field(max_length=10_000)]


class TriggerRule(StrEnum):
    """When a node may run, given its upstream nodes' outcomes."""

    #: every upstream node succeeded
    ALL_SUCCESS = "all_success"
    #: every upstream node ended, however
    ALL_DONE = "all_done"
    #: at least one upstream node failed (or could not run because of a failure)
    ONE_FAILED = "one_failed"
    #: at least one upstream node succeeded
    ONE_SUCCESS = "one_success"
    #: every upstream node ended and none failed (succeeded or skipped)
    NONE_FAILED = "none_failed"
    #: every upstream node ended, none failed, and at least one succeeded
    NONE_FAILED_MIN_ONE_SUCCESS = "none_failed_min_one_success"
    #: every upstream node failed (or could not run because of a failure)
    ALL_FAILED = "all_failed"
    #: at least one upstream node succeeded or failed (its task ran)
    ONE_DONE = "one_done"
    #: at once, whatever the upstream nodes do
    ALWAYS = "always"


class RunState(StrEnum):
    #: accepted, waiting for room under the workflow's ``max_active_runs``
    QUEUED = "queued"
    #: nodes are being released and followed
    RUNNING = "running"
    #: final: every leaf succeeded or was skipped
    SUCCEEDED = "succeeded"
    #: final: a leaf failed or could not run because of a failure
    FAILED = "failed"
    #: final, by request
    CANCELLED = "cancelled"


RUN_FINAL: frozenset[RunState] = frozenset(
    {RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED}
)
RUN_ACTIVE: frozenset[RunState] = frozenset(RunState) - RUN_FINAL


class NodeState(StrEnum):
    #: its trigger rule is not met yet
    PENDING = "pending"
    #: its rule is met; the task is being submitted to core
    READY = "ready"
    #: its task exists in core and has not started
    RELEASED = "released"
    #: its task is running in core
    RUNNING = "running"
    #: it maps over a list: one instance per item runs; it ends when they all have
    MAPPED = "mapped"
    #: an approval gate whose rule is met: it waits for a person's decision (or its
    #: timeout's default); approved it succeeds, rejected it fails
    WAITING = "waiting"
    #: final: its task succeeded
    SUCCEEDED = "succeeded"
    #: final: its task ended dead or cancelled, or core refused it
    FAILED = "failed"
    #: final: its rule can no longer be met because an upstream node failed
    UPSTREAM_FAILED = "upstream_failed"
    #: final: its rule can no longer be met, and nothing failed
    SKIPPED = "skipped"
    #: the run was cancelled while the node's task was live; core is asked to cancel it
    CANCELLING = "cancelling"
    #: final: the run was cancelled before the node ended
    CANCELLED = "cancelled"


NODE_FINAL: frozenset[NodeState] = frozenset(
    {
        NodeState.SUCCEEDED,
        NodeState.FAILED,
        NodeState.UPSTREAM_FAILED,
        NodeState.SKIPPED,
        NodeState.CANCELLED,
    }
)
#: the node's task is live in core
NODE_LIVE: frozenset[NodeState] = frozenset(
    {NodeState.RELEASED, NodeState.RUNNING, NodeState.CANCELLING}
)
#: outcomes that count as a failure for trigger rules
NODE_FAILED: frozenset[NodeState] = frozenset({NodeState.FAILED, NodeState.UPSTREAM_FAILED})

#: ``{{ ... }}`` holding one reference, for ``map.over``
SingleTemplate = Annotated[
    str, StringConstraints(max_length=200, pattern=r"^\{\{\s*[A-Za-z0-9_.\-]+\s*\}\}$")
]
OutputName = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
]


def _bounded_params(params: dict[str, Any]) -> dict[str, Any]:
    return kept_json(params, "params", MAX_PARAMS_BYTES)


Params = Annotated[
    dict[ParamName, ParamValue],
    Field(max_length=MAX_PARAMS),
    AfterValidator(_bounded_params),
]


def _fire_is_reserved(params: dict[str, Any]) -> dict[str, Any]:
    if "fire" in params:
        raise ValueError("params.fire is reserved: the cron service sets fire")
    return params


#: a run's parameters, as a caller starts it (``fire`` is set by the cron service)
RunParams = Annotated[Params, AfterValidator(_fire_is_reserved)]


class TaskTemplate(TaskCreate):
    """A node's task: a submission to core whose ``args``, ``env`` values, ``input_path``
    and ``output_path`` may hold ``{{ params.NAME }}``, ``{{ run.id }}``,
    ``{{ run.workflow }}``, ``{{ node.name }}``, ``{{ node.try }}`` and
    ``{{ nodes.UPSTREAM.output_path }}``. The DAG service sets the idempotency key."""

    @model_validator(mode="after")
    def _set_by_the_service(self) -> TaskTemplate:
        if self.idempotency_key is not None:
            raise ValueError("idempotency_key is set by the DAG service (run, node, try)")
        if self.run_at is not None:
            raise ValueError("run_at is not allowed in a node: a node runs when released")
        if self.start_by is not None:
            raise ValueError("start_by is not allowed in a node: bound its wait by max_wait_s")
        if len(self.labels) > MAX_NODE_LABELS:
            raise ValueError(f"at most {MAX_NODE_LABELS} labels (the service adds two)")
        return self


class OutputSpec(Input):
    """One output a node declares. Without ``path``: a value its task writes to its
    ``CAIRN_OUTPUTS`` file (required unless ``required`` is false). With ``path``: an
    object-store path (templated like ``output_path``), known when the node is released
    and kept as the output when it succeeds."""

    path: (
        Annotated[
            str,
            StringConstraints(
                min_length=1, max_length=2048, pattern=r"^(s3|gs|az|file|https?)://[^\x00]+$"
            ),
        ]
        | None
    ) = None
    required: bool = True


class MapSpec(Input):
    """Run the node once per item of a list: ``over`` is ``{{ params.NAME }}`` or
    ``{{ nodes.UPSTREAM.outputs.NAME }}``; each instance sees ``{{ map.item }}`` and
    ``{{ map.index }}``. A list longer than ``max_items`` fails the node."""

    over: SingleTemplate
    max_items: int = Field(default=1000, ge=1, le=MAX_MAP_ITEMS)


class Approvers(Input):
    """Who may decide an approval gate: the members of ``team``, the ``people`` named,
    or both."""

    team: TeamName | None = None
    people: list[PrincipalName] = Field(default_factory=list, max_length=MAX_APPROVERS)

    @model_validator(mode="after")
    def _someone(self) -> Approvers:
        if self.team is None and not self.people:
            raise ValueError("name a team or at least one person")
        return self


class ApprovalSpec(Input):
    """An approval gate: when its trigger rule is met the node waits for a person to
    approve (it succeeds) or reject (it fails) it; after ``timeout_s`` without a
    decision ``on_timeout`` decides. Without ``approvers``: the run's owner and the
    members of its team."""

    timeout_s: int = Field(ge=1, le=MAX_APPROVAL_TIMEOUT_S)
    on_timeout: Literal["approve", "reject"]
    approvers: Approvers | None = None


class SubWorkflowSpec(Input):
    """Run another stored workflow of the same owner as this node: version ``version``,
    or (unset) its newest version when the parent run started (the child run records
    which). ``params`` are the child's parameters, string values templated like a task's
    args (``{{ params.NAME }}``, ``{{ nodes.UPSTREAM.outputs.NAME }}``, ...). The node
    ends as the child run does (succeeded: succeeded; failed, timed out or cancelled:
    failed) and keeps as its declared ``outputs`` the values of those names that the
    child's nodes kept (docs/dag.md, "Sub-workflows")."""

    name: WorkflowName
    version: int | None = Field(default=None, ge=1, le=2**31 - 1)
    params: Params = Field(default_factory=dict)


class EventSpec(Input):
    """Wait for an external event: when its trigger rule is met the node waits until an
    event named ``name`` is delivered to its run (``POST /v1/runs/ID/events/NAME``; one
    delivered earlier counts), and succeeds with the event's data as its outputs (the
    ``outputs`` it declares, read from the data's keys). After ``timeout_s`` without it,
    ``on_timeout`` decides: the node succeeds (with no outputs) or fails."""

    name: EventName
    timeout_s: int = Field(ge=1, le=MAX_EVENT_TIMEOUT_S)
    on_timeout: Literal["succeed", "fail"] = "fail"


class NodeSpec(Input):
    """One node of a workflow: its task (or, instead, an ``approval`` gate, a
    sub-``workflow`` or an ``event`` to wait for), what it waits for, and when it may
    run."""

    name: NodeName
    #: (left out of a dump when unset: only an approval gate has none)
    task: TaskTemplate | None = Field(default=None, exclude_if=lambda value: value is None)
    depends_on: list[NodeName] = Field(default_factory=list, max_length=MAX_DEPENDS_ON)
    trigger_rule: TriggerRule = TriggerRule.ALL_SUCCESS
    outputs: dict[OutputName, OutputSpec] = Field(default_factory=dict, max_length=MAX_OUTPUT_DECLS)
    map: MapSpec | None = None
    #: a branch condition over ``params.NAME`` and ``nodes.UPSTREAM.outputs.NAME``,
    #: evaluated when the trigger rule is met: false skips the node (docs/dag.md)
    #: (left out of a dump when unset, so a definition without branches dumps and hashes
    #: as it did before ``when`` existed: storing it again answers its version)
    when: Annotated[str, StringConstraints(min_length=1, max_length=MAX_WHEN_CHARS)] | None = Field(
        default=None, exclude_if=lambda value: value is None
    )
    #: wait for a person instead of running a task (docs/dag.md, "Approval gates")
    approval: ApprovalSpec | None = Field(default=None, exclude_if=lambda value: value is None)
    #: run another stored workflow instead of a task (docs/dag.md, "Sub-workflows")
    workflow: SubWorkflowSpec | None = Field(default=None, exclude_if=lambda value: value is None)
    #: wait for an external event instead of running a task (docs/dag.md, "Events")
    event: EventSpec | None = Field(default=None, exclude_if=lambda value: value is None)

    @model_validator(mode="after")
    def _task_or_approval(self) -> NodeSpec:
        kinds: dict[str, object] = {"task": self.task, "approval": self.approval}
        kinds |= {"workflow": self.workflow, "event": self.event}
        given = [field for field, kind in kinds.items() if kind is not None]
        if len(given) != 1:
            field = given[-1] if given else "task"
            raise ValueError(
                f"{field}: a node has exactly one of a task, an approval gate, a workflow"
                " or an event"
            )
        if given[0] != "task":
            self._check_no_task(given[0])
        return self

    def _check_no_task(self, kind: str) -> None:
        """A node that runs no task (an approval gate, a sub-workflow or an event node)
        cannot map, and has outputs only as its kind allows."""
        what = {"approval": "an approval gate", "workflow": "a sub-workflow node"}
        if self.map is not None:
            raise ValueError(f"{kind}: {what.get(kind, 'an event node')} cannot map")
        if kind == "approval" and self.outputs:
            raise ValueError("approval: an approval gate has no outputs")
        if any(declared.path is not None for declared in self.outputs.values()):
            if kind == "workflow":
                raise ValueError("workflow: a sub-workflow's outputs are its child's, not paths")
            raise ValueError("event: an event node's outputs come from its data: no path")

    @model_validator(mode="before")
    @classmethod
    def _task_named_after_node(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("task"), dict):
            task = data["task"]
            if "name" not in task and isinstance(data.get("name"), str):
                data = {**data, "task": {**task, "name": data["name"]}}
        return data


class WorkflowCreate(Input):
    """A workflow definition; storing it under a name already used makes a new version.
    With ``team`` (one the caller belongs to), the team's members see the workflow, run
    it and act on its runs, and its nodes' tasks are owned by the team; the nodes may
    then use only the team's secrets."""

    name: WorkflowName
    team: TeamName | None = None
    description: Annotated[str, StringConstraints(max_length=4096, pattern=r"^[^\x00]*$")] = ""
    params: Params = Field(default_factory=dict)
    max_active_runs: int = Field(default=16, ge=1, le=1000)
    #: a run that has not ended this long after it started fails; its live tasks are
    #: cancelled (a run may set its own)
    timeout_s: int | None = Field(default=None, ge=1, le=MAX_RUN_TIMEOUT_S)
    #: at most this many of a run's node tasks live in core at once
    max_active_nodes: int | None = Field(default=None, ge=1, le=MAX_NODES)
    #: the ``timeout_s`` of every node task of its runs that sets none (core still holds
    #: it to its queue's maximum; unset: the queue's default applies)
    task_timeout_s: int | None = Field(default=None, ge=1, le=MAX_TIME_LIMIT_S)
    nodes: list[NodeSpec] = Field(min_length=1, max_length=MAX_NODES)


class Workflow(Output):
    """One stored version of a workflow."""

    id: int
    owner: str
    team: str | None = None
    name: str
    version: int
    definition: Stored[WorkflowCreate]
    created_at: datetime


class WorkflowSummary(Output):
    id: int
    owner: str
    team: str | None = None
    name: str
    version: int
    nodes: int
    created_at: datetime


class WorkflowList(Output):
    items: list[WorkflowSummary]


class RunFire(Input):
    """The cron fire that starts a run: its slot (``{{ fire.slot }}``), schedule and
    whether a backfill asked for it. Kept in the run's params as ``fire``."""

    slot: AwareDatetime
    schedule_id: int = Field(ge=1, le=2**63 - 1)
    backfill: bool = False
    #: who last changed the schedule (``fire.changed_by``): the run's record of it
    changed_by: PrincipalName | None = None


class RunCreate(Input):
    """Start a run of the newest version (or ``version``) with these parameters."""

    params: RunParams = Field(default_factory=dict)
    idempotency_key: IdempotencyKey | None = None
    version: int | None = Field(default=None, ge=1, le=2**31 - 1)
    fire: RunFire | None = Field(default=None, description="Set by the cron service.")
    #: overrides the definition's ``timeout_s`` for this run
    timeout_s: int | None = Field(default=None, ge=1, le=MAX_RUN_TIMEOUT_S)
    #: overrides the definition's ``task_timeout_s`` for this run: the ``timeout_s`` of
    #: its node tasks that set none (a node's own still wins)
    task_timeout_s: int | None = Field(default=None, ge=1, le=MAX_TIME_LIMIT_S)


class RunClear(Input):
    """Run ``node`` again in a finished run, with everything downstream of it (unless
    ``downstream`` is false): each with its next try; the run queues again."""

    node: NodeName
    downstream: bool = True


class RunRetry(Input):
    """How a retry runs a mapped node that failed again: ``all`` maps it again whole
    (every instance with the next try); ``failed`` keeps the instances that succeeded,
    with their outputs, and runs only the others again."""

    instances: Literal["all", "failed"] = "all"


class Node(Output):
    name: str
    state: NodeState
    trigger_rule: TriggerRule
    depends_on: list[str]
    #: counts releases: 1, then one more for each retry of the run that re-releases it
    try_number: int
    task_id: int | None
    #: why it failed, or why it was skipped when a rule does not say (its ``when`` was
    #: false, its map's list was empty)
    error: str | None = None
    updated_at: datetime
    #: what the node handed on: its declared outputs once it succeeded (a mapped node:
    #: each output as the list of its instances' values)
    outputs: dict[str, Any] | None = None
    #: an instance of a mapped node (named ``NODE[INDEX]``): its node, index and item
    map_of: str | None = None
    map_index: int | None = None
    map_item: Any = None
    #: an approval gate's decision once made: ``approve`` or ``reject``, by whom (None:
    #: its timeout decided), when, with what comment; ``wait_until`` while it waits
    decision: Literal["approve", "reject"] | None = None
    decided_by: str | None = None
    decided_at: datetime | None = None
    comment: str | None = None
    wait_until: datetime | None = None
    #: a sub-workflow node: the run it started (``GET /v1/runs/{child_run_id}``)
    child_run_id: int | None = None
    #: an event node's event (it waits while ``waiting``; its data are its outputs)
    event: str | None = None


class ApprovalDecision(Input):
    """A person's decision on a waiting approval gate."""

    comment: Annotated[
        str, StringConstraints(max_length=MAX_COMMENT_CHARS, pattern=r"^[^\x00]*$")
    ] = ""


class Run(Output):
    """A run of one workflow version; ``nodes`` is empty in lists."""

    id: int
    owner: str
    team: str | None = None
    workflow: str
    workflow_version: int
    params: dict[str, Any]
    state: RunState
    idempotency_key: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    timeout_s: int | None = None
    #: when a running run with a timeout fails
    deadline: datetime | None = None
    #: why it ended as it did, when the nodes do not say (a timeout)
    reason: str | None = None
    #: the ``timeout_s`` of its node tasks that set none (the run's or the workflow's)
    task_timeout_s: int | None = None
    #: a sub-workflow's run: the run and node that started it
    parent_run_id: int | None = None
    parent_node: str | None = None
    nodes: list[Node] = Field(default_factory=list)


class RunList(Output):
    items: list[Run]
    next_cursor: str | None


class GraphNode(Output):
    name: str
    state: NodeState
    trigger_rule: TriggerRule
    task_id: int | None


class GraphEdge(Output):
    source: str
    target: str


class Graph(Output):
    """A run's graph: nodes with their states, and ``depends_on`` as edges upstream to
    downstream; ``mermaid`` draws the same as a Mermaid flowchart."""

    run_id: int
    nodes: list[GraphNode]
    edges: list[GraphEdge]
    mermaid: str


def _bounded_event(data: dict[str, Any]) -> dict[str, Any]:
    return kept_json(data, "data", MAX_EVENT_BYTES)


class EventDelivery(Input):
    """An external event delivered to a run: ``data`` (an object) becomes the outputs of
    the node waiting for it."""

    data: Annotated[
        dict[Annotated[str, StringConstraints(max_length=64)], Any],
        AfterValidator(_bounded_event),
    ] = Field(default_factory=dict, max_length=MAX_PARAMS)


class RunEvent(Output):
    """An event as the run keeps it (once per name)."""

    run_id: int
    name: str
    data: dict[str, Any]
    sent_by: str
    created_at: datetime
    #: the node waiting for it when it came (None: kept until one waits)
    node: str | None = None


class TriggerCreate(Input):
    """A signed HTTP trigger of a workflow: each delivery starts a run of its newest
    version. Its params come from ``params`` (run parameter name -> dotted path into the
    JSON payload) or, without a mapping, from the payload's ``params`` object.
    ``key_path`` names the payload's idempotency key (an ``Idempotency-Key`` header
    also counts)."""

    params: dict[ParamName, PayloadPath] | None = Field(default=None, max_length=MAX_PARAMS)
    key_path: PayloadPath | None = None


class Trigger(Output):
    id: int
    owner: str
    workflow: str
    params: dict[str, str] | None
    key_path: str | None
    created_at: datetime
    #: where deliveries go on the DAG service (``POST``, signed)
    path: str


class TriggerCreated(Trigger):
    """A new trigger, with its secret: shown once, never again."""

    secret: str


class TriggerList(Output):
    items: list[Trigger]


class HistoryCell(Output):
    state: NodeState
    try_number: int
    #: from its rule being met to its end (or now, while open); None before it started
    duration_s: float | None


class HistoryRun(Output):
    id: int
    state: RunState
    workflow_version: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    #: node name -> its cell (a node the run's version lacks has none)
    nodes: dict[str, HistoryCell]


class WorkflowHistory(Output):
    """A workflow's recent runs, oldest first, by node: ``nodes`` in the newest
    version's order, then nodes only older versions had."""

    workflow: str
    nodes: list[str]
    runs: list[HistoryRun]
