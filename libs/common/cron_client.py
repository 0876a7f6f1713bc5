"""The typed HTTP client of the cron service, for the CLI and scripts. Errors are raised
as in ``libs.common.client``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from libs.common.client import ApiClient, read_answer
from libs.common.cron_models import (
    Backfill,
    BackfillCreate,
    CronStatus,
    Fire,
    FirePage,
    NextFires,
    Schedule,
    ScheduleCreate,
    SchedulePage,
    ScheduleUpdate,
)


class CronClient(ApiClient):
    """An async client of the cron service's API."""

    async def create(self, schedule: ScheduleCreate) -> Schedule:
        response = await self._call(
            "POST", "/v1/schedules", content=schedule.model_dump_json(exclude_unset=True)
        )
        return read_answer(Schedule, response)

    async def list_page(self, after: int = 0, limit: int = 100) -> SchedulePage:
        response = await self._call("GET", "/v1/schedules", params={"after": after, "limit": limit})
        return read_answer(SchedulePage, response)

    async def get(self, schedule_id: int) -> Schedule:
        response = await self._call("GET", f"/v1/schedules/{schedule_id}")
        return read_answer(Schedule, response)

    async def update(self, schedule_id: int, change: ScheduleUpdate) -> Schedule:
        response = await self._call(
            "PATCH",
            f"/v1/schedules/{schedule_id}",
            content=change.model_dump_json(exclude_unset=True),
        )
        return read_answer(Schedule, response)

    async def delete(self, schedule_id: int) -> None:
        await self._call("DELETE", f"/v1/schedules/{schedule_id}")

    async def pause(self, schedule_id: int) -> Schedule:
        response = await self._call("POST", f"/v1/schedules/{schedule_id}/pause")
        return read_answer(Schedule, response)

    async def resume(self, schedule_id: int) -> Schedule:
        response = await self._call("POST", f"/v1/schedules/{schedule_id}/resume")
        return read_answer(Schedule, response)

    async def trigger(self, schedule_id: int) -> Fire:
        response = await self._call("POST", f"/v1/schedules/{schedule_id}/trigger")
        return read_answer(Fire, response)

    async def backfill(self, schedule_id: int, start: datetime, end: datetime) -> Backfill:
        body = BackfillCreate.model_validate({"from": start, "to": end})
        response = await self._call(
            "POST",
            f"/v1/schedules/{schedule_id}/backfill",
            content=body.model_dump_json(by_alias=True),
        )
        return read_answer(Backfill, response)

    async def next(self, schedule_id: int, n: int = 10, after: datetime | None = None) -> NextFires:
        params: dict[str, Any] = {"n": n}
        if after is not None:
            params["after"] = after.isoformat()
        response = await self._call("GET", f"/v1/schedules/{schedule_id}/next", params=params)
        return read_answer(NextFires, response)

    async def fires(self, schedule_id: int, limit: int = 100) -> list[Fire]:
        response = await self._call(
            "GET", f"/v1/schedules/{schedule_id}/fires", params={"limit": limit}
        )
        return read_answer(FirePage, response).items

    async def status(self) -> CronStatus:
        response = await self._call("GET", "/v1/cron/status")
        return read_answer(CronStatus, response)
