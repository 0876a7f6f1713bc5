"""The reference endpoint of ``bench/submit.py``: a bare FastAPI + psycopg app that stores
one submission with one INSERT and answers 201 with the stored row.

It is what a straightforward FastAPI service would be: a typed request model (the same
shape as core's submission, without core's string patterns), an async psycopg pool, one
``INSERT ... RETURNING`` in a transaction (the pool commits on exit), and a response
model. No auth, no event row, no idempotency. Run it as ``python bench/bare_app.py``;
it reads ``BARE_DATABASE_URL`` (libpq form), ``BARE_PORT``, ``BARE_POOL_MIN`` and
``BARE_POOL_MAX`` from the environment, and serves with one uvicorn process (uvloop,
httptools, access log off), like core.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Literal

import uvicorn
from fastapi import FastAPI, Request
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel, Field

TABLE = "public.bare_tasks"

INSERT = f"""
INSERT INTO {TABLE} (
    owner, name, queue, priority, kind, artifact_uri, artifact_sha256, args, env,
    input_path, output_path, cpu, memory_mb, preemptible, max_attempts, backoff_base_s,
    backoff_cap_s, backoff_jitter, poison_after, timeout_s, run_at, idempotency_key,
    labels, state
) VALUES (
    %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,
    COALESCE(%s, now()), %s, %s, 'waiting'
)
RETURNING id, state, run_at, created_at
"""

# A DDL the benchmark runs before starting this app: the same columns as core.tasks
# (what a submission fills in), a primary key and no secondary index.
CREATE_TABLE = f"""
CREATE TABLE {TABLE} (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    queue TEXT NOT NULL,
    priority SMALLINT NOT NULL DEFAULT 0,
    kind TEXT NOT NULL,
    artifact_uri TEXT NOT NULL,
    artifact_sha256 TEXT NOT NULL,
    args JSONB NOT NULL DEFAULT '[]',
    env JSONB NOT NULL DEFAULT '{{}}',
    input_path TEXT,
    output_path TEXT,
    cpu DOUBLE PRECISION NOT NULL,
    memory_mb INTEGER NOT NULL,
    preemptible BOOLEAN NOT NULL DEFAULT false,
    max_attempts INTEGER NOT NULL,
    backoff_base_s DOUBLE PRECISION,
    backoff_cap_s DOUBLE PRECISION NOT NULL,
    backoff_jitter BOOLEAN NOT NULL,
    poison_after INTEGER NOT NULL,
    timeout_s INTEGER,
    run_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    idempotency_key TEXT,
    labels JSONB NOT NULL DEFAULT '{{}}',
    state TEXT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
)
"""

# The alternative (``--bare-table like-core``): a copy of core.tasks with every index,
# CHECK constraint and default, to tell the database's share of a gap from Python's.
CREATE_TABLE_LIKE_CORE = f"CREATE TABLE {TABLE} (LIKE core.tasks INCLUDING ALL)"


class Artifact(BaseModel):
    uri: str = Field(min_length=8, max_length=2048)
    sha256: str = Field(min_length=64, max_length=64)


class Resources(BaseModel):
    cpu: float = Field(default=1.0, gt=0)
    memory_mb: int = Field(default=512, ge=1)


class Retry(BaseModel):
    max_attempts: int = Field(default=5, ge=1)
    base_s: float | None = None
    cap_s: float = 86400.0
    jitter: bool = True
    poison_after: int = Field(default=3, ge=1)


class TaskIn(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    artifact: Artifact
    queue: str = "default"
    priority: int = Field(default=0, ge=-100, le=100)
    kind: Literal["task", "service"] = "task"
    args: list[str] = Field(default_factory=list, max_length=256)
    env: dict[str, str] = Field(default_factory=dict, max_length=128)
    input_path: str | None = None
    output_path: str | None = None
    resources: Resources = Field(default_factory=Resources)
    preemptible: bool = False
    retry: Retry = Field(default_factory=Retry)
    timeout_s: int | None = None
    run_at: datetime | None = None
    idempotency_key: str | None = None
    labels: dict[str, str] = Field(default_factory=dict, max_length=32)


class TaskOut(TaskIn):
    id: int
    owner: str
    state: str
    created_at: datetime


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    pool = AsyncConnectionPool(
        os.environ["BARE_DATABASE_URL"],
        min_size=int(os.environ.get("BARE_POOL_MIN", "10")),
        max_size=int(os.environ.get("BARE_POOL_MAX", "20")),
        timeout=10,
        open=False,
    )
    await pool.open(wait=True)
    app.state.pool = pool
    try:
        yield
    finally:
        await pool.close()


app = FastAPI(title="bare submit", lifespan=lifespan)


@app.post("/v1/tasks", status_code=201)
async def submit(spec: TaskIn, request: Request) -> TaskOut:
    pool: AsyncConnectionPool = request.app.state.pool
    params = (
        "bench",
        spec.name,
        spec.queue,
        spec.priority,
        spec.kind,
        spec.artifact.uri,
        spec.artifact.sha256,
        Jsonb(spec.args),
        Jsonb(spec.env),
        spec.input_path,
        spec.output_path,
        spec.resources.cpu,
        spec.resources.memory_mb,
        spec.preemptible,
        spec.retry.max_attempts,
        spec.retry.base_s,
        spec.retry.cap_s,
        spec.retry.jitter,
        spec.retry.poison_after,
        spec.timeout_s,
        spec.run_at,
        spec.idempotency_key,
        Jsonb(spec.labels),
    )
    async with pool.connection() as conn:
        cur = await conn.execute(INSERT, params)
        row = await cur.fetchone()
    assert row is not None
    task_id, state, run_at, created_at = row
    return TaskOut(
        **spec.model_dump(exclude={"run_at"}),
        run_at=run_at,
        id=task_id,
        owner="bench",
        state=state,
        created_at=created_at,
    )


@app.get("/readyz")
async def readyz(request: Request) -> dict[str, str]:
    pool: AsyncConnectionPool = request.app.state.pool
    async with pool.connection() as conn:
        await conn.execute("SELECT 1")
    return {"status": "ok"}


if __name__ == "__main__":
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(os.environ["BARE_PORT"]),
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )
