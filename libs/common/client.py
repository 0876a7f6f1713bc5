"""The typed HTTP client of core, for the cron and DAG services, the CLI and scripts.

Every error answer is raised as the matching ``libs.common.errors`` class, rebuilt from
its problem+json body; a transport failure is raised as httpx's own ``TransportError``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import quote

import httpx
import orjson
from pydantic import BaseModel, ValidationError

from libs.common import tracing
from libs.common.errors import BY_SLUG, CairnError, InvalidInput, UnreadableAnswer
from libs.common.models import (
    HUNG_SOURCES_MAX,
    WORKER_LEASE_HEADER,
    Answer,
    AnswerList,
    Assignment,
    Attempt,
    AttemptList,
    AuditChainPage,
    AuditPage,
    AuditReport,
    BatchItem,
    BatchResult,
    BulkAction,
    BulkResult,
    ClaimAnswer,
    ClaimRequest,
    Delivery,
    DeliveryList,
    Endpoint,
    EndpointList,
    Event,
    EventList,
    EventPage,
    Heartbeat,
    HeartbeatAnswer,
    KeyStatus,
    LogAck,
    LogBatch,
    LogBatchAnswer,
    LogEnd,
    LogPiece,
    NotificationEvent,
    OwnerList,
    OwnerUsage,
    PrincipalInfo,
    QueueInfo,
    QueueList,
    QueueSettings,
    RekeyRequest,
    RekeyResult,
    ReplicaStatus,
    ReplicaStatusAnswer,
    ReplicaStatuses,
    Report,
    ReportAnswer,
    SecretCreate,
    SecretInfo,
    SecretList,
    SecretUpdate,
    ServiceChange,
    ServiceCreate,
    ServiceInfo,
    ServiceList,
    ShareSettings,
    Starts,
    StartsAnswer,
    Subscription,
    SubscriptionCreate,
    SubscriptionCreated,
    SubscriptionList,
    Task,
    TaskBatchCreate,
    TaskCreate,
    TaskPage,
    Team,
    TeamCreate,
    TeamList,
    TokenCreate,
    TokenCreated,
    TokenInfo,
    TokenList,
    Turn,
    TurnAnswer,
    UsageAccounts,
    UsageReport,
    UsageRow,
    WhoAmI,
    Worker,
    WorkerList,
    WorkerRegister,
    WorkerRegistered,
    first_error,
)
from libs.common.states import TaskState
from libs.common.transport import SAFE, LeanTransport, proxy_applies

DEFAULT_TIMEOUT = httpx.Timeout(5.0, connect=2.0)
_JSON = {"Content-Type": "application/json"}
ON_BEHALF_OF = "X-Cairn-On-Behalf-Of"


def _owner(on_behalf_of: str | None) -> dict[str, str]:
    return {ON_BEHALF_OF: on_behalf_of} if on_behalf_of else {}


_M = TypeVar("_M", bound=BaseModel)


def read_answer(model: type[_M], response: httpx.Response) -> _M:
    """``response``'s body read as ``model``, or an ``UnreadableAnswer`` saying why: a
    gateway's page passed for the service's answer, a service of another version. The
    request may have been applied all the same. A ValidationError here was taken by the
    services' callers for a refusal: cron recorded the fire failed though core may have
    made its task, where a try again under the fire's key finds it."""
    try:
        return model.model_validate_json(response.content)
    except ValidationError as exc:
        try:
            asked = f"{response.request.method} {response.request.url.path}"
        except RuntimeError:  # an answer made without a request
            asked = "a request"
        why = first_error(exc)
        raise UnreadableAnswer(f"the answer to {asked} could not be read: {why}") from exc


def raise_for_problem(response: httpx.Response) -> None:
    """Raise the ``CairnError`` an error answer describes; do nothing on success."""
    if response.is_success:
        return
    try:
        found = response.json()
    except ValueError:
        found = None
    # not a problem document (a proxy's answer, JSON or not): only the status speaks
    body: dict[str, Any] = found if isinstance(found, dict) else {}
    slug = str(body.get("type", "")).rsplit("/", 1)[-1]
    cls = BY_SLUG.get(slug, CairnError)
    extra = {k: v for k, v in body.items() if k not in ("type", "title", "status", "detail")}
    error = cls(str(body.get("detail") or response.reason_phrase), **extra)
    if cls is CairnError:
        error.status = response.status_code  # type: ignore[misc]
    raise error


log = logging.getLogger("cairn.client")
#: the transport errors after which nothing of the request can have reached the server
_NOTHING_SENT = (httpx.ConnectError, httpx.ConnectTimeout)


def _http_client(
    base_url: str,
    headers: dict[str, str],
    timeout: httpx.Timeout,
    transport: httpx.AsyncBaseTransport | None,
) -> httpx.AsyncClient:
    if transport is None and not proxy_applies(base_url):
        # httpx's client on a lean transport of ours (``libs/common/transport.py``);
        # through a proxy the environment names, httpx's own
        transport = LeanTransport()
    client = _Client(base_url=base_url, headers=headers, timeout=timeout, transport=transport)
    client.cookies = None
    return client


class _Cookies(httpx.Cookies):
    """httpx's cookie store, reading an answer's cookies only when it sets any: reading
    them built a ``urllib`` request and response of each answer (about a quarter of
    httpx's client's own work a request, profiled), to find no ``Set-Cookie`` in the
    answers of Cairn's services. What it keeps and sends is httpx's: a cookie jar reads
    nothing but those two headers."""

    def extract_cookies(self, response: httpx.Response) -> None:
        if "set-cookie" in response.headers or "set-cookie2" in response.headers:
            super().extract_cookies(response)


class _Client(httpx.AsyncClient):
    """httpx's client with ``_Cookies`` for its cookies (set as httpx sets its own)."""

    _kept: _Cookies

    @property
    def cookies(self) -> httpx.Cookies:
        return self._kept

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        self._kept = _Cookies(cookies)


@dataclass(frozen=True)
class _Joined:
    """A call's path joined to each replica's base beforehand (its ``urls``, in the
    order of ``ApiClient._clients``): a call that passes to the next replica goes to that
    replica's URL, not to the first one's."""

    urls: tuple[httpx.URL, ...]


CallPath = str | httpx.URL | _Joined

# Deprecated calls are warned of once per client each; a bound, as paths carry ids.
WARNED_MAX = 64


class ApiClient:
    """An async client of one Cairn service's API. Pass ``transport`` to test without a
    server. A call that answers with ``Deprecation`` is logged as a warning, once, with
    its ``Sunset`` (docs/api.md).

    ``base_url`` may name several replicas of the service: a call goes to the one that
    answered last, and passes to the next when that one cannot be reached (its connection
    refused), or, for a safe method (GET), fails before its answer is whole or answers
    5xx; any other answer is final. The last replica's error is the call's; after a
    transport error it does not send the call on for (a POST that timed out or was reset
    may have reached its server), the next call goes first to the next replica.

    A call that carried this client's own token and got a 401 leaves why in
    ``token_refused``, until a call is answered again: a service's readiness says so
    (cron's, dag's: a ``CAIRN_TOKEN`` core refuses failed every fire while they were
    ready)."""

    #: why the server refused this client's token, from its last call that carried it
    token_refused: str | None = None

    def __init__(
        self,
        base_url: str | Sequence[str],
        token: str | None,
        *,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        bases = [base_url] if isinstance(base_url, str) else list(base_url)
        if not bases:
            raise ValueError("no base URL")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._token = bool(token)
        self._clients = [_http_client(base, headers, timeout, transport) for base in bases]
        self._at = 0  # the replica that answered last
        self._warned: set[str] = set()

    @property
    def _http(self) -> httpx.AsyncClient:
        return self._clients[self._at]

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()

    @property
    def is_closed(self) -> bool:
        return all(client.is_closed for client in self._clients)

    async def _call(
        self, method: str, path: CallPath, *, own_token: bool = True, **kwargs: Any
    ) -> httpx.Response:
        """``own_token=False``: the call carries another caller's token (``whoami``), whose
        refusal says nothing of this client's own (``token_refused``). ``path``: one for
        every replica, or a URL joined to each replica's base beforehand (``_Joined``)."""
        if "content" in kwargs:
            kwargs["headers"] = {**kwargs.get("headers", {}), "Content-Type": "application/json"}
        if tracing.enabled():
            kwargs["headers"] = tracing.inject(dict(kwargs.get("headers") or {}))
        response = await self._request(method, path, **kwargs)
        if self._token and own_token:
            self._heard(response)
        if "deprecation" in response.headers:
            self._deprecated(f"{method} {response.request.url.path}", response)
        raise_for_problem(response)
        return response

    async def _request(self, method: str, path: CallPath, **kwargs: Any) -> httpx.Response:
        count, start = len(self._clients), self._at  # another call may move ``_at``
        for step in range(count):
            at = (start + step) % count
            last = step == count - 1
            url = path.urls[at] if isinstance(path, _Joined) else path
            try:
                response = await self._clients[at].request(method, url, **kwargs)
            except httpx.TransportError as exc:
                if last or not (method in SAFE or isinstance(exc, _NOTHING_SENT)):
                    if self._at == at:  # the next call (the caller's retry) to the next
                        self._at = (at + 1) % count
                    raise
                log.info("%s %s: %r; asking the next replica", method, path, exc)
                continue
            if last or response.status_code < 500 or method not in SAFE:
                self._at = at
                return response
            log.info("%s %s: %s; asking the next replica", method, path, response.status_code)
        raise AssertionError("unreachable")

    def _heard(self, response: httpx.Response) -> None:
        """Note whether the server took this client's own token (``token_refused``)."""
        if response.status_code == 401:
            refused = self.token_refused is None
            try:
                detail = str(response.json().get("detail") or response.reason_phrase)
            except (ValueError, AttributeError):
                detail = response.reason_phrase
            self.token_refused = detail[:200]
            if refused:
                # info, not error: the CLI's logger is unconfigured (Python prints warnings
                # and errors to its stderr), and its own answer already says why; a
                # service's readiness says it (``token_refused``)
                log.info("%s refused this client's token (401): %s", self._http.base_url, detail)
        elif response.status_code < 500:
            self.token_refused = None

    def _deprecated(self, call: str, response: httpx.Response) -> None:
        if call in self._warned or len(self._warned) >= WARNED_MAX:
            return
        self._warned.add(call)
        sunset = response.headers.get("sunset", "not announced")
        log.warning("%s is deprecated (sunset: %s)", call, sunset)


#: the fields of a report that a core older than them refuses (422, "Extra inputs are not
#: permitted"), and that a report can go without: they only tell core more (a late log's
#: length; why an attempt was handed back). Unset, they are never sent (``Report``).
OPTIONAL_REPORT_FIELDS = frozenset({"log_bytes", "hand_back_cause"})
#: how long refused report fields stay left out before a request tries them again: core
#: may have been upgraded since (agents upgraded first, against deploy.md's order), and
#: what they tell core is lost while they are left out; one 422 and a resend each time
#: against a core still older
REFUSED_FOR_S = 600.0
#: the heartbeat's field a core older than it refuses (``heartbeat``)
_SEEN = frozenset({"seen"})
#: the audit report's field a core older than it refuses (``report_audit``)
_AUDIT_KEY = frozenset({"idempotency_key"})


def _turn_apart(content: bytes) -> TurnAnswer:
    """A turn's answer with a leased attempt this side refuses (core leases a row stored
    under looser bounds as it is): the other attempts read, that one kept apart by id with
    why (``TurnAnswer._unreadable``), for the agent to fail it alone. An answer whose other
    parts do not read, or an attempt with no id, raises as the whole answer did."""
    body = orjson.loads(content)
    raw = body.get("attempts") if isinstance(body, dict) else None
    if not isinstance(raw, list):
        return TurnAnswer.model_validate_json(content)  # raises what is wrong with it
    answer = TurnAnswer.model_validate({**body, "attempts": []})
    for item in raw:
        try:
            answer.attempts.append(Assignment.model_validate(item))
        except ValidationError as exc:
            attempt_id = item.get("attempt_id") if isinstance(item, dict) else None
            if type(attempt_id) is not int:
                raise
            answer._unreadable.append((attempt_id, first_error(exc)))
    return answer


def _unset_of(body: Turn, refused: frozenset[str]) -> dict[str, Any] | None:
    """The fields of a turn left out of its body: those it does not use, and those of its
    reports that core refused as unknown (``refused``)."""
    unset: dict[str, Any] = {
        name: True for name in ("progress", "holding", "draining") if not getattr(body, name)
    }
    if body.holding == []:
        del unset["holding"]  # an empty list says "I hold nothing", not "not sent"
    if refused and body.reports:
        unset["reports"] = {"__all__": set(refused)}
    return unset or None


def refused_fields(error: InvalidInput, optional: frozenset[str]) -> set[str]:
    """The fields of ``optional`` a 422 refuses as unknown to the core that answered."""
    named = set()
    for item in error.extra.get("errors") or ():
        if not isinstance(item, dict) or "extra" not in str(item.get("reason", "")).lower():
            continue
        name = str(item.get("field", "")).rsplit(".", 1)[-1]
        if name in optional:
            named.add(name)
    return named


class _LeftOut:
    """Optional fields of one kind of request that a core older than them refused as unknown
    (422, before it applied anything): each request goes again at once without them, and
    leaves them out for ``for_s`` from the last refusal; then it tries them again, as core
    may have been upgraded since (0: every request tries them first, for a rare one whose
    field must not be left out a moment longer than needed). Each pass leaves out one field
    more."""

    def __init__(
        self, optional: frozenset[str], what: str, for_s: float = REFUSED_FOR_S, risk: str = ""
    ) -> None:
        self.optional = optional
        self.what = what  # for the log: "report fields", "the heartbeat's fields"...
        self.risk = risk  # for the log: what sending without them costs, if anything
        self.for_s = for_s
        self.refused: frozenset[str] = frozenset()
        self.refused_at = -math.inf  # monotonic

    async def send(
        self,
        send: Callable[[frozenset[str]], Awaitable[httpx.Response]],
        sent: frozenset[str] | None = None,
    ) -> httpx.Response:
        """``send(refused)``'s answer, ``refused`` being the fields to leave out. ``sent``:
        the optional fields this request holds, if not all (a refusal naming another is
        raised as it came)."""
        optional = self.optional if sent is None else self.optional & sent
        if self.refused and time.monotonic() - self.refused_at >= self.for_s:
            self.refused = frozenset()
        while True:
            try:
                return await send(self.refused)
            except InvalidInput as exc:
                new = refused_fields(exc, optional) - self.refused
                if not new:
                    raise
                log.warning(
                    "core refuses %s %s (an older core): sent without%s", self.what, new, self.risk
                )
                self.refused = self.refused | new
                self.refused_at = time.monotonic()


class CoreClient(ApiClient):
    """An async client of core's API. Pass ``transport`` to test without a server."""

    #: the worker whose turns this client sends last, and their URL joined to the base
    _turn_at: tuple[int, _Joined] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: optional fields an older core refused, left out of what follows (``_LeftOut``):
        #: of reports (turns' and alone; ``draining`` is not optional: a core that refuses
        #: it did not hear the drain), of heartbeats, of audit reports
        self.report_fields = _LeftOut(OPTIONAL_REPORT_FIELDS, "report fields")
        self.beat_fields = _LeftOut(_SEEN, "the heartbeat's fields")
        # Tried on every report: a report sent again without its key may be recorded twice.
        self.audit_fields = _LeftOut(
            _AUDIT_KEY,
            "the audit report's fields",
            for_s=0.0,
            risk="; a report sent again may be recorded twice until core is upgraded",
        )

    async def whoami(self, token: str | None = None) -> WhoAmI:
        """The principal this client's token stands for, or ``token`` if given (one
        client then checks many callers' tokens over its pooled connections)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        response = await self._call("GET", "/v1/whoami", own_token=not token, headers=headers)
        return read_answer(WhoAmI, response)

    async def submit(
        self, spec: TaskCreate, *, on_behalf_of: str | None = None
    ) -> tuple[Task, bool]:
        """Submit one task; return it and whether this call created it. A service token
        may submit ``on_behalf_of`` another owner."""
        response = await self._call(
            "POST", "/v1/tasks", content=spec.model_dump_json(), headers=_owner(on_behalf_of)
        )
        return read_answer(Task, response), response.status_code == 201

    async def submit_batch(
        self, specs: Sequence[TaskCreate], *, on_behalf_of: str | None = None
    ) -> list[BatchItem]:
        body = TaskBatchCreate(tasks=list(specs)).model_dump_json()
        response = await self._call(
            "POST", "/v1/tasks/batch", content=body, headers=_owner(on_behalf_of)
        )
        return read_answer(BatchResult, response).tasks

    async def submit_batch_json(
        self,
        tasks: Sequence[Mapping[str, Any]],
        *,
        owners: Sequence[str] | None = None,
        on_behalf_of: str | None = None,
    ) -> list[BatchItem]:
        """``submit_batch`` for task bodies that are already plain JSON data (validated
        when they were stored), which saves building a model per task. A service token
        may give each task's owner in ``owners``."""
        doc: dict[str, Any] = {"tasks": tasks}
        if owners is not None:
            doc["owners"] = owners
        response = await self._call(
            "POST", "/v1/tasks/batch", content=orjson.dumps(doc), headers=_owner(on_behalf_of)
        )
        return read_answer(BatchResult, response).tasks

    async def get_task(self, task_id: int) -> Task:
        response = await self._call("GET", f"/v1/tasks/{task_id}")
        return read_answer(Task, response)

    async def list_tasks(
        self,
        *,
        state: TaskState | None = None,
        queue: str | None = None,
        owner: str | None = None,
        labels: dict[str, str] | None = None,
        idempotency_keys: Sequence[str] = (),
        limit: int = 100,
        cursor: str | None = None,
    ) -> TaskPage:
        params: dict[str, Any] = {"limit": limit}
        if idempotency_keys:
            params["idempotency_key"] = list(idempotency_keys)
        for key, value in (
            ("state", state),
            ("queue", queue),
            ("owner", owner),
            ("cursor", cursor),
        ):
            if value is not None:
                params[key] = str(value)
        if labels:
            params["label"] = [f"{k}={v}" for k, v in labels.items()]
        response = await self._call("GET", "/v1/tasks", params=params)
        return read_answer(TaskPage, response)

    async def cancel(self, task_id: int) -> Task:
        response = await self._call("POST", f"/v1/tasks/{task_id}/cancel")
        return read_answer(Task, response)

    async def retry(self, task_id: int) -> Task:
        response = await self._call("POST", f"/v1/tasks/{task_id}/retry")
        return read_answer(Task, response)

    async def retry_where(self, action: BulkAction) -> BulkResult:
        """Retry the tasks ``action.filter`` selects (at most ``action.limit``)."""
        response = await self._call(
            "POST", "/v1/tasks/retry", content=action.model_dump_json(exclude_defaults=True)
        )
        return read_answer(BulkResult, response)

    async def cancel_where(self, action: BulkAction) -> BulkResult:
        """Cancel the tasks ``action.filter`` selects (at most ``action.limit``)."""
        response = await self._call(
            "POST", "/v1/tasks/cancel", content=action.model_dump_json(exclude_defaults=True)
        )
        return read_answer(BulkResult, response)

    async def attempts(self, task_id: int) -> list[Attempt]:
        response = await self._call("GET", f"/v1/tasks/{task_id}/attempts")
        return read_answer(AttemptList, response).items

    async def task_events(self, task_id: int) -> list[Event]:
        response = await self._call("GET", f"/v1/tasks/{task_id}/events")
        return read_answer(EventList, response).items

    async def events(
        self, after: str = "0.0", limit: int = 100, wait: float = 0, hold: float = 0
    ) -> EventPage:
        """One page of the feed; with ``wait`` the call is held until events arrive, and
        with ``hold`` too, up to that much longer until one of them ends a task."""
        params = {"after": after, "limit": limit, "wait": wait, "hold": hold}
        timeout = httpx.Timeout(5.0 + wait, connect=2.0)
        response = await self._call("GET", "/v1/events", params=params, timeout=timeout)
        return read_answer(EventPage, response)

    # --- the worker agent's calls ---

    async def register_worker(self, offer: WorkerRegister) -> WorkerRegistered:
        """Register a worker; this client then sends its lease secret on every call."""
        response = await self._call("POST", "/v1/workers", content=offer.model_dump_json())
        registered = read_answer(WorkerRegistered, response)
        self.use_lease(registered.lease)
        return registered

    def use_lease(self, lease: str) -> None:
        """Act for the worker whose lease secret this is."""
        for client in self._clients:
            client.headers[WORKER_LEASE_HEADER] = lease

    async def heartbeat(
        self,
        worker_id: int,
        alive: Sequence[int],
        hung_s: float | None = None,
        hung: tuple[int, int] = (0, 0),
        seen: int | None = None,
    ) -> HeartbeatAnswer:
        """``hung``: the agent's threads and its spawn helpers' checkers that hang on
        sources that did not answer (sent only when some do; at most
        ``HUNG_SOURCES_MAX`` each, so a beat never fails for its count). ``seen``: the
        highest attempt id the agent had been handed when ``alive`` was read
        (``Heartbeat.seen``)."""
        threads, checkers = (min(max(0, n), HUNG_SOURCES_MAX) for n in hung)
        beat = Heartbeat(
            attempts=list(alive),
            seen=seen,
            hung_s=hung_s,
            hung_source_threads=threads,
            hung_source_checkers=checkers,
        )
        path = f"/v1/workers/{worker_id}/heartbeat"
        # Without ``seen``, an older core judges every open attempt by the list alone.
        response = await self.beat_fields.send(
            lambda refused: self._call(
                "POST",
                path,
                content=beat.model_dump_json(exclude_defaults=True, exclude=set(refused)),
            ),
            sent=_SEEN if seen is not None else frozenset(),
        )
        return read_answer(HeartbeatAnswer, response)

    async def claim(self, worker_id: int, room: ClaimRequest) -> list[Assignment]:
        timeout = httpx.Timeout(5.0 + room.wait, connect=2.0)
        response = await self._call(
            "POST",
            f"/v1/workers/{worker_id}/claim",
            content=room.model_dump_json(),
            timeout=timeout,
        )
        return read_answer(ClaimAnswer, response).attempts

    async def turn(self, worker_id: int, body: Turn) -> TurnAnswer:
        """One round trip of a worker: its reports (each answered with a verdict: a stale
        one is refused alone), its start acknowledgements and its claim."""
        wait = body.claim.wait if body.claim is not None else 0.0
        if self._turn_at is None or self._turn_at[0] != worker_id:
            # Joined once: each turn's own join to the base and parse of the result cost
            # about as much as encoding its body.
            path = f"/v1/workers/{worker_id}/turn"
            urls = tuple(client.build_request("POST", path).url for client in self._clients)
            self._turn_at = (worker_id, _Joined(urls))
        at = self._turn_at[1]
        response = await self.report_fields.send(
            lambda refused: self._call(
                "POST",
                at,
                # Without progress, holding or draining when it has none, as a core that
                # knows none of them takes it.
                content=body.model_dump_json(exclude=_unset_of(body, refused)),
                timeout=httpx.Timeout(10.0 + wait, connect=2.0),
            )
        )
        try:
            return TurnAnswer.model_validate_json(response.content)
        except ValidationError:
            return _turn_apart(response.content)

    async def start_attempt(self, worker_id: int, attempt_id: int) -> ReportAnswer:
        """Ask core whether it still holds the attempt before starting it; raises
        ``StaleAttempt`` when it does not."""
        response = await self._call("POST", f"/v1/workers/{worker_id}/attempts/{attempt_id}/start")
        return read_answer(ReportAnswer, response)

    async def report_replicas(
        self, worker_id: int, items: list[ReplicaStatus]
    ) -> ReplicaStatusAnswer:
        """Tell core whether the services' replicas this worker runs are ready, and where
        they listen (docs/services.md)."""
        body = ReplicaStatuses(items=items).model_dump_json()
        response = await self._call("POST", f"/v1/workers/{worker_id}/replicas", content=body)
        return read_answer(ReplicaStatusAnswer, response)

    async def start_attempts(self, worker_id: int, attempt_ids: list[int]) -> StartsAnswer:
        """Ask core which of these attempts leased ahead it still holds, before starting
        them at their ``start_at``."""
        body = Starts(attempts=attempt_ids).model_dump_json()
        response = await self._call("POST", f"/v1/workers/{worker_id}/starts", content=body)
        return read_answer(StartsAnswer, response)

    async def report(self, worker_id: int, attempt_id: int, outcome: Report) -> ReportAnswer:
        path = f"/v1/workers/{worker_id}/attempts/{attempt_id}/report"
        response = await self.report_fields.send(
            lambda refused: self._call(
                "POST", path, content=outcome.model_dump_json(exclude=set(refused))
            )
        )
        return read_answer(ReportAnswer, response)

    async def ship_logs(self, worker_id: int, batch: LogBatch) -> list[LogAck]:
        """Chunks of running attempts' logs; each answered on its own (docs/logs.md)."""
        path = f"/v1/workers/{worker_id}/logs"
        response = await self._call("POST", path, content=batch.model_dump_json())
        return read_answer(LogBatchAnswer, response).items

    async def log(self, task_id: int, attempt_id: int | None = None) -> str:
        params = {"attempt_id": attempt_id} if attempt_id else {}
        response = await self._call("GET", f"/v1/tasks/{task_id}/logs", params=params)
        return response.text

    async def follow_log(
        self, task_id: int, attempt_id: int | None = None, offset: int = 0
    ) -> AsyncIterator[LogPiece | LogEnd]:
        """The log as it is written: pieces, then its end (the attempt ended)."""
        params: dict[str, Any] = {"follow": "true", "offset": offset}
        if attempt_id is not None:
            params["attempt_id"] = attempt_id
        # Core sends a keep-alive every 15 s, so a silent minute means the line is gone.
        timeout = httpx.Timeout(60.0, connect=2.0)
        path = f"/v1/tasks/{task_id}/logs"
        async with self._http.stream("GET", path, params=params, timeout=timeout) as response:
            if not response.is_success:
                await response.aread()
                raise_for_problem(response)
            event = ""
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:") and event == "log":
                    yield LogPiece.model_validate_json(line[5:])
                elif line.startswith("data:") and event == "end":
                    yield LogEnd.model_validate_json(line[5:])
                    return

    async def leave(self, worker_id: int) -> Worker:
        response = await self._call("POST", f"/v1/workers/{worker_id}/leave")
        return read_answer(Worker, response)

    async def usage(self, owner: str | None = None, name: str | None = None) -> list[UsageRow]:
        """Requested against measured use per owner and task name, with suggestions."""
        params = {k: v for k, v in (("owner", owner), ("name", name)) if v}
        response = await self._call("GET", "/v1/usage", params=params)
        return read_answer(UsageReport, response).items

    async def usage_accounts(
        self, month: str | None = None, by: str = "owner", limit: int = 100
    ) -> UsageAccounts:
        """What a month's attempts used, summed by owner, team or queue."""
        params: dict[str, Any] = {"by": by, "limit": limit}
        if month:
            params["month"] = month
        response = await self._call("GET", "/v1/usage/accounts", params=params)
        return read_answer(UsageAccounts, response)

    async def workers(self, state: str | None = None) -> list[Worker]:
        """Every worker the caller may see (newest first, all pages), with capacity, use
        and last heartbeat."""
        found: list[Worker] = []
        params: dict[str, Any] = {"limit": 1000}
        if state is not None:
            params["state"] = state
        while True:
            response = await self._call("GET", "/v1/workers", params=params)
            page = read_answer(WorkerList, response)
            found += page.items
            if page.next_cursor is None:
                return found
            params["cursor"] = page.next_cursor

    async def queues(self) -> list[QueueInfo]:
        response = await self._call("GET", "/v1/queues")
        return read_answer(QueueList, response).items

    async def set_queue(self, queue: str, change: QueueSettings) -> QueueInfo:
        """Set a queue's placement settings and time limits (admin); a field left out
        keeps its value, one set to None restores the default."""
        body = change.model_dump(mode="json", exclude_unset=True)
        response = await self._call("PATCH", f"/v1/queues/{queue}", json=body)
        return read_answer(QueueInfo, response)

    async def pause(self, queue: str) -> QueueInfo:
        response = await self._call("POST", f"/v1/queues/{queue}/pause")
        return read_answer(QueueInfo, response)

    async def resume(self, queue: str) -> QueueInfo:
        response = await self._call("POST", f"/v1/queues/{queue}/resume")
        return read_answer(QueueInfo, response)

    # --- identity ---------------------------------------------------------------------

    async def create_token(self, body: TokenCreate) -> TokenCreated:
        """A new token (the caller's own, or with ``principal`` another's, admins only)."""
        response = await self._call("POST", "/v1/tokens", content=body.model_dump_json())
        return read_answer(TokenCreated, response)

    async def tokens(
        self, principal: str | None = None, include_revoked: bool = False
    ) -> list[TokenInfo]:
        params: dict[str, Any] = {"include_revoked": include_revoked, "limit": 1000}
        if principal:
            params["principal"] = principal
        response = await self._call("GET", "/v1/tokens", params=params)
        return read_answer(TokenList, response).items

    async def revoke_token(self, token_id: int) -> None:
        await self._call("DELETE", f"/v1/tokens/{token_id}")

    async def principal(self, name: str) -> PrincipalInfo:
        """A principal's role and whether it is disabled (admins)."""
        response = await self._call("GET", f"/v1/principals/{quote(name, safe='')}")
        return read_answer(PrincipalInfo, response)

    async def disable_principal(self, name: str) -> PrincipalInfo:
        """Disable a principal, someone who left (admins; idempotent)."""
        response = await self._call("POST", f"/v1/principals/{quote(name, safe='')}/disable")
        return read_answer(PrincipalInfo, response)

    async def enable_principal(self, name: str) -> PrincipalInfo:
        """Enable a disabled principal again (admins; idempotent)."""
        response = await self._call("POST", f"/v1/principals/{quote(name, safe='')}/enable")
        return read_answer(PrincipalInfo, response)

    async def create_team(self, name: str, reuse_name: bool = False) -> Team:
        body = TeamCreate(name=name, reuse_name=reuse_name).model_dump_json()
        response = await self._call("POST", "/v1/teams", content=body)
        return read_answer(Team, response)

    async def teams(self) -> list[Team]:
        response = await self._call("GET", "/v1/teams")
        return read_answer(TeamList, response).items

    async def team(self, name: str) -> Team:
        response = await self._call("GET", f"/v1/teams/{name}")
        return read_answer(Team, response)

    async def delete_team(self, name: str) -> None:
        await self._call("DELETE", f"/v1/teams/{name}")

    async def add_member(self, team: str, member: str) -> Team:
        response = await self._call("PUT", f"/v1/teams/{team}/members/{member}")
        return read_answer(Team, response)

    async def remove_member(self, team: str, member: str) -> Team:
        response = await self._call("DELETE", f"/v1/teams/{team}/members/{member}")
        return read_answer(Team, response)

    async def put_secret(self, name: str, value: str, team: str | None = None) -> SecretInfo:
        """Create the secret, or give an existing one a new value."""
        body = SecretCreate(name=name, value=value, team=team).model_dump_json()
        response = await self._http.post("/v1/secrets", content=body, headers=_JSON)
        if response.status_code == 409:
            update = SecretUpdate(value=value).model_dump_json()
            params = {"team": team} if team else {}
            response = await self._http.put(
                f"/v1/secrets/{name}", content=update, params=params, headers=_JSON
            )
        raise_for_problem(response)
        return read_answer(SecretInfo, response)

    async def secrets(self) -> list[SecretInfo]:
        response = await self._call("GET", "/v1/secrets")
        return read_answer(SecretList, response).items

    async def delete_secret(self, name: str, team: str | None = None) -> None:
        await self._call("DELETE", f"/v1/secrets/{name}", params={"team": team} if team else {})

    async def key_status(self) -> KeyStatus:
        """Which secrets keys seal how many values (admins)."""
        response = await self._call("GET", "/v1/secrets/keys")
        return read_answer(KeyStatus, response)

    async def rekey(self, limit: int = 1000, after: str | None = None) -> RekeyResult:
        """Seal up to ``limit`` values anew under core's current key (admins), going on
        from ``after`` (the last answer's ``next``)."""
        body = RekeyRequest(limit=limit, after=after).model_dump_json()
        response = await self._call("POST", "/v1/secrets/rekey", content=body, headers=_JSON)
        return read_answer(RekeyResult, response)

    async def audit(self, **filters: Any) -> AuditPage:
        """A page of the audit trail (admins): ``actor``, ``action``, ``target``, ``since``,
        ``until``, ``before``, ``limit``."""
        params = {k: str(v) for k, v in filters.items() if v is not None}
        response = await self._call("GET", "/v1/audit", params=params)
        return read_answer(AuditPage, response)

    async def audit_chain(self, after: int = 0, limit: int = 1000) -> AuditChainPage:
        """The chained trail after ``after``, oldest first (admins): what an export holds."""
        params = {"after": str(after), "limit": str(limit)}
        response = await self._call("GET", "/v1/audit/export", params=params)
        return read_answer(AuditChainPage, response)

    async def report_audit(self, report: AuditReport) -> None:
        """For services: record an action a person took through this service in core's
        audit trail. A core older than the report's ``idempotency_key`` refuses it (422,
        unknown field) before it records anything: the report goes again without it, so
        the action is recorded (once, unless it is reported again) rather than lost to a
        refusal (deploy.md upgrades core first; a DAG service upgraded before it)."""
        await self.audit_fields.send(
            lambda refused: self._call(
                "POST",
                "/v1/audit/reports",
                content=report.model_dump_json(exclude_none=True, exclude=set(refused)),
                headers=_JSON,
            ),
            sent=_AUDIT_KEY if report.idempotency_key is not None else frozenset(),
        )

    # --- services kept at N replicas (docs/services.md) ---

    async def create_service(self, spec: ServiceCreate) -> ServiceInfo:
        """A service of the caller's, kept at ``replicas`` tasks of its template."""
        body = spec.model_dump_json(exclude_unset=True)
        response = await self._call("POST", "/v1/services", content=body)
        return read_answer(ServiceInfo, response)

    async def services(self) -> list[ServiceInfo]:
        """The caller's services (without their steps)."""
        response = await self._call("GET", "/v1/services")
        return read_answer(ServiceList, response).items

    async def service(self, name: str) -> ServiceInfo:
        """The caller's service with the controller's last steps."""
        response = await self._call("GET", f"/v1/services/{quote(name, safe='')}")
        return read_answer(ServiceInfo, response)

    async def change_service(self, name: str, change: ServiceChange) -> ServiceInfo:
        """Change a service's count, rollout policy or template (a rollout)."""
        body = change.model_dump_json(exclude_unset=True)
        response = await self._call("PATCH", f"/v1/services/{quote(name, safe='')}", content=body)
        return read_answer(ServiceInfo, response)

    async def delete_service(self, name: str) -> None:
        await self._call("DELETE", f"/v1/services/{quote(name, safe='')}")

    async def endpoints(self, name: str, *, only_ready: bool = True) -> list[Endpoint]:
        """The running replicas of the services called ``name`` the caller may see (the
        ready ones, or with ``only_ready`` false all), and where they listen."""
        params = {} if only_ready else {"all": "true"}
        path = f"/v1/services/{quote(name, safe='')}/endpoints"
        response = await self._call("GET", path, params=params)
        return read_answer(EndpointList, response).items

    # --- notifications (docs/notifications.md) ---

    async def create_subscription(
        self, spec: SubscriptionCreate, *, on_behalf_of: str | None = None
    ) -> SubscriptionCreated:
        """Subscribe a webhook; the answer's ``secret`` is shown only this once."""
        response = await self._call(
            "POST",
            "/v1/subscriptions",
            content=spec.model_dump_json(),
            headers=_owner(on_behalf_of),
        )
        return read_answer(SubscriptionCreated, response)

    async def subscriptions(self) -> list[Subscription]:
        response = await self._call("GET", "/v1/subscriptions")
        return read_answer(SubscriptionList, response).items

    async def subscription(self, subscription_id: int) -> Subscription:
        response = await self._call("GET", f"/v1/subscriptions/{subscription_id}")
        return read_answer(Subscription, response)

    async def delete_subscription(self, subscription_id: int) -> None:
        await self._call("DELETE", f"/v1/subscriptions/{subscription_id}")

    async def test_subscription(self, subscription_id: int) -> Delivery:
        """Queue a ``test`` delivery to the webhook."""
        response = await self._call("POST", f"/v1/subscriptions/{subscription_id}/test")
        return read_answer(Delivery, response)

    async def enable_subscription(self, subscription_id: int) -> Subscription:
        response = await self._call("POST", f"/v1/subscriptions/{subscription_id}/enable")
        return read_answer(Subscription, response)

    async def deliveries(self, subscription_id: int, limit: int = 50) -> list[Delivery]:
        path = f"/v1/subscriptions/{subscription_id}/deliveries"
        response = await self._call("GET", path, params={"limit": limit})
        return read_answer(DeliveryList, response).items

    async def answers(self, subscription_id: int, limit: int = 50) -> list[Answer]:
        """The webhook's newest answers, one per try."""
        path = f"/v1/subscriptions/{subscription_id}/answers"
        response = await self._call("GET", path, params={"limit": limit})
        return read_answer(AnswerList, response).items

    async def notify(self, event: NotificationEvent) -> int:
        """For services: post an owner's event; return the deliveries it queued."""
        response = await self._call(
            "POST", "/v1/notifications/events", content=event.model_dump_json(exclude_none=True)
        )
        queued: int = response.json()["queued"]
        return queued

    async def owner_usage(self, name: str) -> OwnerUsage:
        """The owner's share, running use, waiting count and quotas."""
        response = await self._call("GET", f"/v1/owners/{name}/usage")
        return read_answer(OwnerUsage, response)

    async def team_usage(self, name: str) -> OwnerUsage:
        """The team's share, the running use and waiting count of its tasks, its quotas."""
        response = await self._call("GET", f"/v1/teams/{name}/usage")
        return read_answer(OwnerUsage, response)

    async def set_team_share(self, name: str, change: ShareSettings) -> OwnerUsage:
        """Set a team's weight and quotas (admin); fields left unset keep their value."""
        body = change.model_dump_json(exclude_unset=True)
        response = await self._call("PATCH", f"/v1/teams/{name}/share", content=body)
        return read_answer(OwnerUsage, response)

    async def top_owners(self, limit: int = 10) -> list[OwnerUsage]:
        response = await self._call("GET", "/v1/owners", params={"limit": limit})
        return read_answer(OwnerList, response).items

    async def set_share(self, name: str, change: ShareSettings) -> OwnerUsage:
        """Set an owner's weight and quotas (admin); fields left unset keep their value."""
        body = change.model_dump_json(exclude_unset=True)
        response = await self._call("PATCH", f"/v1/owners/{name}/share", content=body)
        return read_answer(OwnerUsage, response)
