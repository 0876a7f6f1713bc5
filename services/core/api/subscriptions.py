"""Notifications: an owner's webhook subscriptions, their deliveries and answers, and the
events cron and DAG post. Requests only write the outbox; loops deliver."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, Path, Query, Request, Response, status

from libs.common import egress
from libs.common.errors import InvalidInput
from libs.common.models import (
    AnswerList,
    Delivery,
    DeliveryList,
    NotificationAccepted,
    NotificationEvent,
    Subscription,
    SubscriptionCreate,
    SubscriptionCreated,
    SubscriptionList,
)
from libs.common.problems import PROBLEMS
from services.core.api.deps import Box, Engine, Reader, SubmittingOwner, require
from services.core.db import notifications
from services.core.domain.notify import new_secret
from services.core.domain.principals import Principal
from services.core.ops import subscriptions as subscriptions_ops
from services.core.ops.notify import Webhooks
from services.core.settings import CoreSettings

router = APIRouter(prefix="/v1/subscriptions", tags=["notifications"])
events_router = APIRouter(prefix="/v1/notifications", tags=["notifications"])

SubscriptionId = Annotated[int, Path(ge=1, le=2**63 - 1, description="The subscription's id.")]
Limit = Annotated[int, Query(ge=1, le=1000)]
Poster = Annotated[Principal, Depends(require("service", "admin"))]
RESOLVE_S = 2.0  # how long a create waits on the resolver before leaving it to delivery


def _bad_url(reason: str) -> InvalidInput:
    return InvalidInput(f"body.url: {reason}", errors=[{"field": "body.url", "reason": reason}])


async def _check_url(url: str, settings: CoreSettings, webhooks: Webhooks) -> None:
    """https in production (unless allowed), and a host that does not resolve to a
    refused address now (each delivery checks again, on the address it connects to)."""
    plain = urlsplit(url).scheme != "https"
    if plain and settings.env == "production" and not settings.notify_allow_http:
        raise _bad_url("must be https:// in production (CAIRN_NOTIFY_ALLOW_HTTP=true allows http)")
    try:
        async with asyncio.timeout(RESOLVE_S):
            refused = await egress.refused(url, webhooks.egress)
    except TimeoutError:
        return
    if refused:
        raise _bad_url(f"{egress.REFUSED}; CAIRN_NOTIFY_ALLOW_CIDRS opens a range to webhooks")


async def _owned(engine: Engine, subscription_id: int, principal: Principal) -> Subscription:
    async with engine.connect() as conn:
        return await notifications.get_subscription(conn, subscription_id, principal.owner_filter)


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=SubscriptionCreated,
    responses=PROBLEMS,
)
async def create_subscription(
    spec: SubscriptionCreate, owner: SubmittingOwner, engine: Engine, request: Request, box: Box
) -> SubscriptionCreated:
    """Subscribe a webhook to events of the caller's work. The answer holds the signing
    secret; it is not shown again (it is stored sealed)."""
    state = request.app.state
    await _check_url(spec.url, state.settings, state.webhooks)
    secret = new_secret()
    made = await subscriptions_ops.create(engine, box, owner, spec, secret)
    return SubscriptionCreated(**made.model_dump(), secret=secret)


@router.get("", response_model=SubscriptionList, responses=PROBLEMS)
async def list_subscriptions(principal: Reader, engine: Engine) -> SubscriptionList:
    """Your subscriptions (every owner's for admins and services)."""
    async with engine.connect() as conn:
        items = await notifications.list_subscriptions(conn, principal.owner_filter)
    return SubscriptionList(items=items)


@router.get("/{subscription_id}", response_model=Subscription, responses=PROBLEMS)
async def get_subscription(
    subscription_id: SubscriptionId, principal: Reader, engine: Engine
) -> Subscription:
    return await _owned(engine, subscription_id, principal)


@router.delete("/{subscription_id}", status_code=status.HTTP_204_NO_CONTENT, responses=PROBLEMS)
async def delete_subscription(
    subscription_id: SubscriptionId, principal: Reader, engine: Engine
) -> Response:
    """Delete it, with its pending deliveries and its log."""
    await subscriptions_ops.delete(engine, subscription_id, principal.owner_filter)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post(
    "/{subscription_id}/test",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=Delivery,
    responses=PROBLEMS,
)
async def test_subscription(
    subscription_id: SubscriptionId, principal: Reader, engine: Engine, request: Request
) -> Delivery:
    """Queue a ``test`` event for the webhook (delivered even while disabled, tried once);
    follow it in the deliveries and answers. One per ``CAIRN_NOTIFY_TEST_INTERVAL_S``
    a subscription: sooner is a 429 with Retry-After."""
    interval_s = request.app.state.settings.notify_test_interval_s
    return await subscriptions_ops.test(engine, subscription_id, principal.owner_filter, interval_s)


@router.post("/{subscription_id}/enable", response_model=Subscription, responses=PROBLEMS)
async def enable_subscription(
    subscription_id: SubscriptionId, principal: Reader, engine: Engine
) -> Subscription:
    """Deliver again after the subscription was disabled: its failures count from 0."""
    return await subscriptions_ops.enable(engine, subscription_id, principal.owner_filter)


@router.get("/{subscription_id}/deliveries", response_model=DeliveryList, responses=PROBLEMS)
async def list_deliveries(
    subscription_id: SubscriptionId, principal: Reader, engine: Engine, limit: Limit = 50
) -> DeliveryList:
    """The newest deliveries: pending, delivered or given up, with their last answer."""
    await _owned(engine, subscription_id, principal)
    async with engine.connect() as conn:
        return DeliveryList(items=await notifications.deliveries(conn, subscription_id, limit))


@router.get("/{subscription_id}/answers", response_model=AnswerList, responses=PROBLEMS)
async def list_answers(
    subscription_id: SubscriptionId, principal: Reader, engine: Engine, limit: Limit = 50
) -> AnswerList:
    """The delivery log: the webhook's newest answers (status, error, time), one per try."""
    await _owned(engine, subscription_id, principal)
    async with engine.connect() as conn:
        return AnswerList(items=await notifications.answers(conn, subscription_id, limit))


@events_router.post(
    "/events",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=NotificationAccepted,
    responses=PROBLEMS,
)
async def post_event(
    event: NotificationEvent, principal: Poster, engine: Engine
) -> NotificationAccepted:
    """For the cron and DAG services: an event of ``owner``'s schedules or runs, queued
    for that owner's matching subscriptions. The same ``key`` twice queues nothing new."""
    at = event.at or datetime.now(UTC)
    queued = await subscriptions_ops.post(engine, event, at)
    return NotificationAccepted(queued=queued)
