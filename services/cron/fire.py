"""Sending fires to core: one task per fire, submitted for the schedule's owner with the
idempotency key ``cron:<schedule>:<fire time>``, so a second try, a second leader or a
restart finds the task the first one made instead of making another."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from libs.common.client import CoreClient
from libs.common.dag_client import DagClient
from libs.common.dag_models import RunFire
from libs.common.errors import CairnError, is_refusal
from libs.common.models import NotificationEvent
from libs.common.states import FINAL
from services.cron.domain.fires import Result

log = logging.getLogger("cairn.cron.fire")
SCHEDULE_LABEL = "cairn.cron/schedule"
FIRE_LABEL = "cairn.cron/fire-time"
BACKFILL_LABEL = "cairn.cron/backfill"
CHANGED_BY_LABEL = "cairn.cron/changed-by"


def fire_key(schedule_id: int, fire_time: datetime, manual: bool, withdrawn: int = 0) -> str:
    """The idempotency key of a fire. A fire withdrawn by a change before its slot is
    sent again under a key of its own (``:w<n>``): the first task is cancelled, not reused."""
    stamp = fire_time.astimezone(UTC).isoformat()
    if manual:
        return f"cron:{schedule_id}:manual:{stamp}"
    return f"cron:{schedule_id}:{stamp}" + (f":w{withdrawn}" if withdrawn else "")


@dataclass(frozen=True)
class Outgoing:
    """A claimed fire, ready to send. ``run_at``: when its task may start (the slot plus
    the schedule's jitter; None: at once)."""

    schedule_id: int
    fire_time: datetime
    manual: bool
    owner: str
    target: dict[str, Any]
    run_at: datetime | None = None
    backfill: bool = False
    withdrawn: int = 0
    #: who last changed the schedule, carried by its task (None: its owner)
    changed_by: str | None = None

    @property
    def key(self) -> str:
        return fire_key(self.schedule_id, self.fire_time, self.manual, self.withdrawn)


def _retryable(exc: BaseException) -> bool:
    """Core (or the DAG service) is down, overloaded or holds the owner to a quota: try
    again later. A refusal of the fire itself is its own fault."""
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, CairnError) and not is_refusal(exc)


def _task_body(item: Outgoing) -> dict[str, Any]:
    body = dict(item.target["task"])
    stamp = item.fire_time.astimezone(UTC).isoformat()
    body["idempotency_key"] = item.key
    body["env"] = {
        **body.get("env", {}),
        "CAIRN_CRON_SLOT": stamp,
        "CAIRN_CRON_SCHEDULE_ID": str(item.schedule_id),
        **({"CAIRN_CRON_BACKFILL": "true"} if item.backfill else {}),
    }
    if item.run_at is not None:
        body["run_at"] = item.run_at.astimezone(UTC).isoformat()
    body["labels"] = {
        **body.get("labels", {}),
        SCHEDULE_LABEL: str(item.schedule_id),
        FIRE_LABEL: stamp,
        **({BACKFILL_LABEL: "true"} if item.backfill else {}),
        CHANGED_BY_LABEL: item.changed_by or item.owner,
    }
    return body


# What an earlier fire made, for the overlap policies: ("task", id) or ("run", id).
Made = tuple[str, int]
_RUN_OVER = frozenset({"succeeded", "failed", "cancelled"})


class Sender:
    """Submits task fires to core in batches (every owner's together, several batches at
    once) and starts workflow runs in the DAG service, one request each."""

    def __init__(
        self, core: CoreClient, chunk: int, dag: DagClient | None = None, parallel: int = 4
    ) -> None:
        self.core = core
        self.dag = dag
        self.chunk = chunk
        self._gate = asyncio.Semaphore(parallel)

    async def send(self, items: Sequence[Outgoing]) -> list[Result]:
        tasks = [i for i in items if i.target.get("kind") == "task"]
        runs = [i for i in items if i.target.get("kind") == "dag"]
        # Many owners in one request: each task names its owner (``owners``).
        batches = [tasks[i : i + self.chunk] for i in range(0, len(tasks), self.chunk)]
        results: list[Result] = []
        for done in await asyncio.gather(*(self._batch(b) for b in batches)):
            results.extend(done)
        results.extend(await asyncio.gather(*(self._run(i) for i in runs)))
        return results

    async def _run(self, item: Outgoing) -> Result:
        if self.dag is None:
            return Result(
                item.schedule_id,
                item.fire_time,
                "failed",
                detail="workflow targets need the DAG service, which is not configured",
            )
        async with self._gate:
            try:
                run, _ = await self.dag.start_run(
                    item.target["workflow"],
                    item.target.get("params") or {},
                    idempotency_key=item.key,
                    fire=RunFire(
                        slot=item.fire_time,
                        schedule_id=item.schedule_id,
                        backfill=item.backfill,
                        changed_by=item.changed_by or item.owner,
                    ),
                    on_behalf_of=item.owner,
                )
            except Exception as exc:
                return self._failure(item, exc, "dag")
        return Result(
            item.schedule_id,
            item.fire_time,
            "submitted",
            run_id=run.id,
            submitted_at=datetime.now(UTC),
        )

    async def _batch(self, items: list[Outgoing]) -> list[Result]:
        async with self._gate:
            try:
                answer = await self.core.submit_batch_json(
                    [_task_body(i) for i in items], owners=[i.owner for i in items]
                )
            except Exception as exc:
                if _retryable(exc) or len(items) == 1:
                    return [self._failure(i, exc, "core") for i in items]
                # One bad fire refuses the whole batch: send them one by one to find it.
                return [r for i in items for r in await self._batch_alone(i)]
        now = datetime.now(UTC)
        return [
            Result(i.schedule_id, i.fire_time, "submitted", task_id=a.id, submitted_at=now)
            for i, a in zip(items, answer, strict=True)
        ]

    async def _batch_alone(self, item: Outgoing) -> list[Result]:
        try:
            [answer] = await self.core.submit_batch_json([_task_body(item)], owners=[item.owner])
        except Exception as exc:
            return [self._failure(item, exc, "core")]
        return [
            Result(
                item.schedule_id,
                item.fire_time,
                "submitted",
                task_id=answer.id,
                submitted_at=datetime.now(UTC),
            )
        ]

    @staticmethod
    def _failure(item: Outgoing, exc: BaseException, service: str) -> Result:
        if _retryable(exc):
            return Result(item.schedule_id, item.fire_time, "pending", detail=f"{service}: {exc}")
        return Result(
            item.schedule_id, item.fire_time, "failed", detail=f"{service} refused: {exc}"
        )

    async def active(self, made: Sequence[Made]) -> dict[Made, bool]:
        """Whether each task or run an earlier fire made is still live, for the overlap
        policies. One its service no longer knows (purged) counts as over."""

        async def one(ref: Made) -> tuple[Made, bool]:
            kind, ident = ref
            async with self._gate:
                try:
                    if kind == "task":
                        return ref, (await self.core.get_task(ident)).state not in FINAL
                    if self.dag is None:
                        return ref, False
                    return ref, (await self.dag.get_run(ident)).state not in _RUN_OVER
                except CairnError as exc:
                    if exc.status == 404:
                        return ref, False
                    raise

        return dict(await asyncio.gather(*(one(m) for m in made)))

    async def withdraw(self, task_id: int) -> bool:
        """Cancel a task sent ahead of its slot; False if core started it already (so it
        is the slot's run and stays)."""
        try:
            await self.core.cancel(task_id)
        except CairnError as exc:
            if exc.status == 404:
                return True
            if exc.status != 409:
                raise
            return (await self.core.get_task(task_id)).state == "cancelled"
        return True

    async def notify(self, fires: Sequence[tuple[str, int, datetime, str, str | None]]) -> None:
        """Post (owner, schedule, slot, missed|failed, detail) fires to core for the owners'
        subscriptions (docs/notifications.md). Best effort: a lost post is logged."""
        for owner, sid, at, outcome, detail in fires:
            slot = at.isoformat()
            event = NotificationEvent.model_validate(
                {
                    "event": f"fire.{outcome}",
                    "owner": owner,
                    "key": f"schedule {sid} at {slot}",
                    "summary": (detail or "")[:1000],
                    "subject": {"schedule_id": str(sid), "fire_time": slot},
                }
            )
            try:
                await self.core.notify(event)
            except Exception as exc:  # whatever it is, the fire itself is recorded
                log.warning("schedule %s fire %s: notification not posted: %s", sid, slot, exc)

    async def cancel(self, made: Made) -> None:
        kind, ident = made
        try:
            if kind == "task":
                await self.core.cancel(ident)
            elif self.dag is not None:
                await self.dag.cancel_run(ident)
        except CairnError as exc:
            if exc.status not in (404, 409):
                raise
