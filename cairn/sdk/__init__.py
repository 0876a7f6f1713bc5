"""Workflows as code: write a DAG service workflow in Python, render it to the definition
``POST /v1/workflows`` takes, submit it and follow its runs (docs/sdk.md)::

    from cairn.sdk import MAP_ITEM, Artifact, Client, Node, Workflow, param

    ETL = Artifact(uri="s3://bin/etl", sha256="...")
    with Workflow("nightly") as nightly:
        extract = Node("extract", artifact=ETL, args=["extract", param("day")],
                       outputs=["files"])
        load = Node("load", artifact=ETL, args=["load", MAP_ITEM],
                    map=extract.outputs.files)
        extract >> load

    cairn = Client()
    cairn.apply(nightly)
    result = cairn.start(nightly, {"day": "2026-12-04"}).wait()

The task fields, ``Artifact``, ``Resources``, ``RetryPolicy`` and the rest are the wire
models of ``libs.common``: one definition of each, shared with the services.
"""

from cairn.sdk.definition import (
    Approval,
    DefinitionError,
    Node,
    SubWorkflow,
    WaitForEvent,
    Workflow,
    chain,
    render_all,
)
from cairn.sdk.files import load_file
from cairn.sdk.refs import (
    FIRE_BACKFILL,
    FIRE_SCHEDULE_ID,
    FIRE_SLOT,
    MAP_INDEX,
    MAP_ITEM,
    NODE_NAME,
    NODE_TRY,
    RUN_ID,
    RUN_OWNER,
    RUN_WORKFLOW,
    Ref,
    param,
)
from cairn.sdk.runs import Applied, Client, RunFailed, RunHandle, RunResult, apply, wait_for_run
from libs.common.dag_models import MapSpec, NodeState, OutputSpec, RunState, TriggerRule
from libs.common.models import (
    Artifact,
    Concurrency,
    Resources,
    RetryCauses,
    RetryPolicy,
    SecretRef,
)

__all__ = [
    "FIRE_BACKFILL",
    "FIRE_SCHEDULE_ID",
    "FIRE_SLOT",
    "MAP_INDEX",
    "MAP_ITEM",
    "NODE_NAME",
    "NODE_TRY",
    "RUN_ID",
    "RUN_OWNER",
    "RUN_WORKFLOW",
    "Applied",
    "Approval",
    "Artifact",
    "Client",
    "Concurrency",
    "DefinitionError",
    "MapSpec",
    "Node",
    "NodeState",
    "OutputSpec",
    "Ref",
    "Resources",
    "RetryCauses",
    "RetryPolicy",
    "RunFailed",
    "RunHandle",
    "RunResult",
    "RunState",
    "SecretRef",
    "SubWorkflow",
    "TriggerRule",
    "WaitForEvent",
    "Workflow",
    "apply",
    "chain",
    "load_file",
    "param",
    "render_all",
    "wait_for_run",
]
