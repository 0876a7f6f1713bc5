"""Services (docs/services.md): services kept at N replicas with rolling updates, and
where the replicas of a service listen."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response, status

from libs.common.models import (
    EndpointList,
    ServiceChange,
    ServiceCreate,
    ServiceInfo,
    ServiceList,
)
from libs.common.problems import PROBLEMS
from services.core.api.deps import Announcer, Audit, Engine, Reader, Submitter
from services.core.db import services as services_db
from services.core.ops import services as services_ops

router = APIRouter(prefix="/v1/services", tags=["services"])

ServiceName = Annotated[str, Path(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")]


@router.post(
    "", status_code=status.HTTP_201_CREATED, response_model=ServiceInfo, responses=PROBLEMS
)
async def create_service(
    body: ServiceCreate, principal: Submitter, engine: Engine, record: Audit, request: Request
) -> ServiceInfo:
    """A service of the caller's, kept at ``replicas`` running tasks of ``template`` by
    the controller; 409 when the caller has one of that name."""
    book = await request.app.state.sharing.fresh(engine)
    services_ops.check(book, principal, principal.name, body.template)
    return await services_ops.create(engine, record, principal, principal.name, body)


@router.get("", response_model=ServiceList, responses=PROBLEMS)
async def list_services(principal: Reader, engine: Engine) -> ServiceList:
    """The caller's services (at most 200), by name."""
    async with engine.connect() as conn:
        return ServiceList(items=await services_ops.list_of(conn, principal.name))


@router.get("/{name}", response_model=ServiceInfo, responses=PROBLEMS)
async def get_service(name: ServiceName, principal: Reader, engine: Engine) -> ServiceInfo:
    """The caller's service: its revision, rollout, replicas and the controller's last
    steps."""
    async with engine.connect() as conn:
        return await services_ops.read(conn, principal.name, name)


@router.patch("/{name}", response_model=ServiceInfo, responses=PROBLEMS)
async def change_service(
    name: ServiceName,
    body: ServiceChange,
    principal: Submitter,
    engine: Engine,
    record: Audit,
    request: Request,
) -> ServiceInfo:
    """Change the count, the rollout policy or the template; a new template is rolled
    out (``max_surge``, ``max_unavailable``) and rolled back if its replicas are not all
    ready within ``deadline_s``, or at once when they have failed ``max_failures`` times."""
    if body.template is not None:
        book = await request.app.state.sharing.fresh(engine)
        services_ops.check(book, principal, principal.name, body.template)
    return await services_ops.change(engine, record, principal, principal.name, name, body)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, responses=PROBLEMS)
async def delete_service(
    name: ServiceName, principal: Submitter, engine: Engine, record: Audit, notifier: Announcer
) -> Response:
    """Remove the service; its live tasks are cancelled."""
    await services_ops.delete(engine, notifier, record, principal.name, name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


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
