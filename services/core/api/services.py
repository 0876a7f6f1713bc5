"""Services (docs/services.md): where the replicas of a service listen."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from libs.common.models import EndpointList
from libs.common.problems import PROBLEMS
from services.core.api.deps import Engine, Reader
from services.core.db import services as services_db

router = APIRouter(prefix="/v1/services", tags=["services"])

ServiceName = Annotated[str, Path(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")]


@router.get("/{name}/endpoints", response_model=EndpointList, responses=PROBLEMS)
async def service_endpoints(
    name: ServiceName,
    principal: Reader,
    engine: Engine,
    all: Annotated[bool, Query(description="Unready replicas too.")] = False,
) -> EndpointList:
    """The running replicas of the services called ``name`` that the caller may see (its
    own and its teams'; an admin sees every owner's): by default the ready ones, each
    with its host's address and ``address:port`` per declared port name."""
    async with engine.connect() as conn:
        found = await services_db.replicas(conn, name, principal.visibility, not all)
    return EndpointList(name=name, items=found)
