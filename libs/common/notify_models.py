"""Notifications' wire models: subscriptions, deliveries and their answers, and the events
the cron and DAG services post (docs/notifications.md)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal
from urllib.parse import urlsplit
from uuid import UUID

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
)

from libs.common.models import LabelKey, LabelValue, Name, QueueName, _storable_time

#: what a subscription may ask to hear about
EventName = Literal["task.dead", "task.deadline_missed", "run.failed", "fire.missed", "fire.failed"]
#: the events cron and DAG post (the others core sees itself)
PostedEvent = Literal["run.failed", "fire.missed", "fire.failed"]
DeliveryState = Literal["pending", "delivered", "failed"]
MAX_SUBSCRIPTIONS = 100
Text = Annotated[str, StringConstraints(max_length=1000, pattern=r"^[^\x00]*$")]
Key = Annotated[
    str, StringConstraints(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")
]


def _webhook_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https"):
        raise ValueError("must be an http:// or https:// URL")
    if not parts.hostname:
        raise ValueError("must name a host")
    if parts.username or parts.password:
        raise ValueError("must not carry credentials; the signature authenticates Cairn")
    return value


WebhookUrl = Annotated[
    str,
    StringConstraints(min_length=8, max_length=2048, pattern=r"^[^\s\x00-\x1f\x7f]+$"),
    AfterValidator(_webhook_url),
]


class _Input(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Output(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SubscriptionFilter(_Input):
    """Only events of tasks in this queue and carrying all these labels (task events;
    posted events match on the queue and labels they name)."""

    queue: QueueName | None = None
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32)


class SubscriptionCreate(_Input):
    """A webhook to call when one of ``events`` happens to the caller's work."""

    name: Name
    events: list[EventName] = Field(min_length=1, max_length=5)
    filter: SubscriptionFilter = Field(default_factory=SubscriptionFilter)
    url: WebhookUrl


class Subscription(_Output):
    id: int
    owner: str
    name: str
    events: list[EventName]
    filter: SubscriptionFilter
    url: str
    enabled: bool
    #: why deliveries stopped (set when ``enabled`` is false)
    disabled_reason: str | None
    #: failed deliveries in a row; at the limit the subscription is disabled
    failures: int
    created_at: datetime
    updated_at: datetime


class SubscriptionCreated(Subscription):
    """The new subscription with its signing secret, which is shown only this once."""

    secret: str


class SubscriptionList(_Output):
    items: list[Subscription]


class Answer(_Output):
    """One try of one delivery: the webhook's status, or the error instead."""

    delivery_id: UUID
    event: str
    try_: int = Field(alias="try")
    at: datetime
    status: int | None
    error: str | None
    duration_ms: float


class AnswerList(_Output):
    items: list[Answer]


class Delivery(_Output):
    """A notification in the outbox and where its delivery stands."""

    delivery_id: UUID
    subscription_id: int
    event: str
    state: DeliveryState
    tries: int
    next_at: datetime
    created_at: datetime
    finished_at: datetime | None
    last_status: int | None
    last_error: str | None
    last_at: datetime | None


class DeliveryList(_Output):
    items: list[Delivery]


class NotificationEvent(_Input):
    """An event cron or DAG saw, posted for ``owner``'s subscriptions. ``key`` names the
    occurrence (a schedule and fire time, a run): posting it again notifies nobody twice."""

    event: PostedEvent
    owner: Name
    key: Key
    summary: Text = ""
    queue: QueueName | None = None
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32)
    subject: dict[Key, Text] = Field(default_factory=dict, max_length=32)
    at: Annotated[AwareDatetime, AfterValidator(_storable_time)] | None = None


class NotificationAccepted(_Output):
    """How many subscriptions got a delivery queued for the event (0: none match, or all
    already had it)."""

    queued: int
