"""Fencing tokens (docs/progress.md): whether the attempt that holds a token is still its
task's current one. The token is the credential: it carries a secret only that attempt
was given, so the caller (the task itself, or the system its write goes to) needs no
bearer token, and learns nothing of any attempt but the token's own."""

from __future__ import annotations

from fastapi import APIRouter

from libs.common.errors import NotFound
from libs.common.models import FencingAnswer, FencingCheck
from libs.common.problems import PROBLEMS
from services.core.api.deps import Engine
from services.core.db import attempts as attempts_db

router = APIRouter(prefix="/v1/fencing", tags=["fencing"])


@router.post("", response_model=FencingAnswer, responses=PROBLEMS)
async def check_fencing_token(body: FencingCheck, engine: Engine) -> FencingAnswer:
    """Is the attempt holding this token (``CAIRN_FENCING_TOKEN``) its task's current
    attempt, still running? 404 when no attempt holds it (a wrong secret included)."""
    attempt, epoch, secret = body.token.split(".")
    async with engine.connect() as conn:
        row = await attempts_db.fence(conn, int(attempt), int(epoch), secret)
    if row is None:
        raise NotFound("no attempt holds this fencing token")
    return FencingAnswer(
        current=row.current, task_id=row.task_id, attempt_id=row.attempt_id, epoch=row.epoch
    )
