"""Rendering a node's task template for one run: ``{{ params.x }}``, ``{{ run.id }}``,
``{{ node.try }}``, ``{{ nodes.UPSTREAM.output_path }}``,
``{{ nodes.UPSTREAM.outputs.NAME }}``, ``{{ map.item }}``, ``{{ map.index }}`` (a list or
an object renders as JSON), ``{{ fire.slot }}`` (and
``fire.schedule_id``, ``fire.backfill``: empty unless a cron fire started the run, whose
nodes also get ``CAIRN_CRON_SLOT`` and ``CAIRN_CRON_SCHEDULE_ID``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from libs.common.errors import InvalidInput
from libs.common.models import TaskCreate
from services.dag.domain.data import Instance, instance_name
from services.dag.domain.graph import TEMPLATE, Dag


@dataclass(frozen=True)
class RunContext:
    run_id: int
    workflow: str
    owner: str
    params: Mapping[str, Any]
    #: the outputs of the run's nodes so far (``data.collect``)
    outputs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: the run's own default ``timeout_s`` of its node tasks (over the workflow's)
    task_timeout_s: int | None = None


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def merged_params(dag: Dag, given: Mapping[str, Any]) -> dict[str, Any]:
    """The run's parameters: the definition's defaults overridden by ``given``; refuse a
    parameter nobody declared and one a node needs that has no value."""
    declared = set(dag.definition.params) | dag.referenced_params
    unknown = sorted(set(given) - declared)
    missing = sorted(dag.referenced_params - set(dag.definition.params) - set(given))
    errors = [
        {"field": f"body.params.{p}", "reason": "not a parameter of this workflow"} for p in unknown
    ]
    errors += [{"field": f"body.params.{p}", "reason": "required: a node uses it"} for p in missing]
    if errors:
        raise InvalidInput(f"{errors[0]['field']}: {errors[0]['reason']}", errors=errors)
    return {**dag.definition.params, **given}


def release_key(run_id: int, node: str, try_number: int) -> str:
    """The idempotency key of a node's try: a release submitted again finds its task."""
    return f"dag:{run_id}:{node}:{try_number}"


def decision_key(run_id: int, node: str, try_number: int, decided_at: datetime) -> str:
    """The idempotency key of an approval decision's audit report: the same decision,
    reported again after a timeout, is recorded once in core's audit trail."""
    at = decided_at.astimezone(UTC).isoformat(timespec="microseconds")
    return f"{release_key(run_id, node, try_number)}:decided:{at}"


class Renderer:
    """Renders the nodes of one run."""

    def __init__(self, dag: Dag, run: RunContext) -> None:
        self.dag = dag
        self.run = run

    def _value(
        self, node: str, try_number: int, expression: str, instance: Instance | None = None
    ) -> str:
        head, _, rest = expression.partition(".")
        if head == "params":
            return _text(self.run.params.get(rest))
        if head == "run":
            return _text(
                {"id": self.run.run_id, "workflow": self.run.workflow, "owner": self.run.owner}[
                    rest
                ]
            )
        if head == "node":
            return _text(node if rest == "name" else try_number)
        if head == "fire":
            return _text(self._fire().get(rest))
        if head == "map":
            if instance is None:
                return ""
            return _text(instance.item if rest == "item" else instance.index)
        upstream, _, output = rest.rpartition(".outputs.")
        if upstream:
            return _text(self.run.outputs.get(upstream, {}).get(output))
        upstream = rest.rsplit(".", 1)[0]
        task = self.dag.specs[upstream].task
        path = (task.output_path if task is not None else None) or ""
        return self._render(upstream, 1, path)

    def _fire(self) -> Mapping[str, Any]:
        fire = self.run.params.get("fire")
        return fire if isinstance(fire, Mapping) else {}

    def _render(
        self, node: str, try_number: int, text: str, instance: Instance | None = None
    ) -> str:
        if "{{" not in text:
            return text
        return TEMPLATE.sub(lambda m: self._value(node, try_number, m[1], instance), text)

    def paths(self, node: str, try_number: int, instance: Instance | None = None) -> dict[str, str]:
        """The node's declared output paths, rendered."""
        return {
            name: self._render(node, try_number, declared.path, instance)
            for name, declared in self.dag.specs[node].outputs.items()
            if declared.path is not None
        }

    def child_params(self, node: str, try_number: int) -> dict[str, Any]:
        """A sub-workflow node's parameters for its child run: a string that is one
        ``{{ params.NAME }}`` or ``{{ nodes.UPSTREAM.outputs.NAME }}`` passes that value as
        it is (a list stays a list); other strings render as a task's args do."""
        spec = self.dag.specs[node].workflow
        if spec is None:
            raise InvalidInput(f"nodes.{node}: not a sub-workflow node")
        return {
            name: self._raw(node, try_number, value) if isinstance(value, str) else value
            for name, value in spec.params.items()
        }

    def _raw(self, node: str, try_number: int, text: str) -> Any:
        whole = TEMPLATE.fullmatch(text.strip())
        if whole is not None:
            head, _, rest = whole[1].partition(".")
            if head == "params":
                return self.run.params.get(rest)
            upstream, _, output = rest.rpartition(".outputs.")
            if head == "nodes" and upstream:
                return self.run.outputs.get(upstream, {}).get(output)
        return self._render(node, try_number, text)

    def task(self, node: str, try_number: int, instance: Instance | None = None) -> TaskCreate:
        """The submission of ``node``'s try (of one of its items when it is mapped);
        ``InvalidInput`` if what renders is invalid."""
        template = self.dag.specs[node].task
        if template is None:
            raise InvalidInput(f"nodes.{node}: an approval gate has no task to submit")

        def render(text: str) -> str:
            return self._render(node, try_number, text, instance)

        doc = template.model_dump(exclude={"idempotency_key", "run_at"})
        if doc["timeout_s"] is None and template.kind == "task":
            # the run's default, else the workflow's; core's rule (a queue's maximum)
            # still applies
            doc["timeout_s"] = self.run.task_timeout_s or self.dag.definition.task_timeout_s
        doc["args"] = [render(arg) for arg in template.args]
        doc["env"] = {
            k: render(v) if isinstance(v, str) else doc["env"][k] for k, v in template.env.items()
        }
        if fire := self._fire():
            doc["env"]["CAIRN_CRON_SLOT"] = _text(fire.get("slot"))
            doc["env"]["CAIRN_CRON_SCHEDULE_ID"] = _text(fire.get("schedule_id"))
            if fire.get("backfill"):
                doc["env"]["CAIRN_CRON_BACKFILL"] = "true"
        for name in ("input_path", "output_path"):
            if doc[name] is not None:
                doc[name] = render(doc[name])
        row = node if instance is None else instance_name(node, instance.index)
        doc["idempotency_key"] = release_key(self.run.run_id, row, try_number)
        doc["labels"] = {
            **template.labels,
            "cairn.dag/run": str(self.run.run_id),
            "cairn.dag/node": row,
        }
        try:
            return TaskCreate.model_validate(doc)
        except ValidationError as exc:
            errors = [
                {
                    "field": f"nodes.{node}.task." + ".".join(str(p) for p in err["loc"]),
                    "reason": err["msg"],
                }
                for err in exc.errors()[:20]
            ]
            raise InvalidInput(
                f"{errors[0]['field']}: {errors[0]['reason']} (after templating)", errors=errors
            ) from None
