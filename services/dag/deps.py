"""Request dependencies of the DAG service. Who may call is stated by ``Person`` (users,
admins, services) and ``ActingOwner`` (libs.common.auth); a run loaded by id is filtered
by owner, so another owner's run is a 404 exactly like a missing one."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request
from sqlalchemy.ext.asyncio import AsyncEngine

from services.dag.engine import Engine, Graphs

RunIdPath = Annotated[int, Path(ge=1, le=2**63 - 1, description="The run's id.")]


async def get_engine(request: Request) -> AsyncEngine:
    engine: AsyncEngine = request.app.state.engine
    return engine


async def get_loop(request: Request) -> Engine:
    loop: Engine = request.app.state.loop
    return loop


async def get_graphs(request: Request) -> Graphs:
    graphs: Graphs = request.app.state.graphs
    return graphs


Db = Annotated[AsyncEngine, Depends(get_engine)]
Loop = Annotated[Engine, Depends(get_loop)]
GraphCache = Annotated[Graphs, Depends(get_graphs)]
