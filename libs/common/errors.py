"""Cairn's errors, shared by the services (which raise them) and the client (which re-raises
them from problem+json answers). Each maps to one HTTP status and problem type.

    CairnError
    ├── InvalidInput          422  a field is missing, malformed or out of bounds
    ├── PayloadTooLarge       413  the request body is over the limit
    ├── Unauthorized          401  no token, or an unknown or revoked one
    ├── Forbidden             403  the role may not call this endpoint
    ├── NotFound              404  no such object (or not yours: the same answer)
    ├── Conflict              409  the object is not in a state that allows this
    │   ├── IllegalTransition       the state machine refuses the move
    │   ├── StaleAttempt            a report from an attempt that is no longer current
    │   └── IdempotencyMismatch     the key was used before with a different request
    ├── QuotaExceeded         429  an owner's waiting or submission-rate quota is full
    └── Unavailable           503  something the request needs (the database, core, an
                                   identity provider) is unavailable right now
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, ClassVar


class CairnError(Exception):
    """Something went wrong."""

    status: ClassVar[int] = 500
    slug: ClassVar[str] = "internal"

    def __init__(self, detail: str | None = None, **extra: Any) -> None:
        self.detail = detail or (self.__doc__ or "").strip()
        self.extra = extra
        super().__init__(self.detail)

    @property
    def type_uri(self) -> str:
        return f"https://cairn.dev/problems/{self.slug}"

    @property
    def title(self) -> str:
        return (type(self).__doc__ or "").strip()

    def problem(self, instance: str | None = None) -> dict[str, Any]:
        """This error as an RFC 9457 problem document."""
        body: dict[str, Any] = {
            "type": self.type_uri,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        if instance:
            body["instance"] = instance
        body.update(self.extra)
        return body


class InvalidInput(CairnError):
    """The request is invalid."""

    status = 422
    slug = "invalid-input"


class PayloadTooLarge(CairnError):
    """The request body is too large."""

    status = 413
    slug = "payload-too-large"


class Unauthorized(CairnError):
    """A valid bearer token is required."""

    status = 401
    slug = "unauthorized"


class Forbidden(CairnError):
    """Your role may not do this."""

    status = 403
    slug = "forbidden"


class NotFound(CairnError):
    """No such object."""

    status = 404
    slug = "not-found"


class Conflict(CairnError):
    """The object is not in a state that allows this."""

    status = 409
    slug = "conflict"


class IllegalTransition(Conflict):
    """The task's state does not allow this."""

    slug = "illegal-transition"


class StaleAttempt(Conflict):
    """This attempt is no longer the task's current one."""

    slug = "stale-attempt"


class IdempotencyMismatch(Conflict):
    """This idempotency key was used before with a different request."""

    slug = "idempotency-mismatch"


class QuotaExceeded(CairnError):
    """A quota is full; nothing was stored. Try again after Retry-After seconds."""

    status = 429
    slug = "quota-exceeded"

    def __init__(
        self, detail: str | None = None, quota: str = "", retry_after_s: int = 1, **extra: Any
    ) -> None:
        super().__init__(detail, quota=quota, retry_after_s=retry_after_s, **extra)
        self.retry_after_s = max(1, int(retry_after_s))


class Unavailable(CairnError):
    """Something this request needs is unavailable right now; try again."""

    status = 503
    slug = "unavailable"


class UnreadableAnswer(CairnError):
    """The service's answer could not be read."""

    # a 502's: not a refusal (``is_refusal``), so a caller that records refusals as final
    # (cron's fires, the DAG's releases) tries again, its request's key making it safe
    status = 502
    slug = "unreadable-answer"


class HttpStatusError(CairnError):
    """An HTTP error of a status with no problem type of Cairn's own (405 for a method the
    path does not take, 406, 415, ...): RFC 9457's ``about:blank``, titled by the
    status's phrase. It was the ``internal`` type, "Something went wrong."."""

    def __init__(self, status: int, detail: str | None = None, **extra: Any) -> None:
        self.status = status  # type: ignore[misc]
        super().__init__(detail or self.title, **extra)

    @property
    def type_uri(self) -> str:
        return "about:blank"

    @property
    def title(self) -> str:
        try:
            return HTTPStatus(self.status).phrase
        except ValueError:
            return "HTTP error"


#: the detail of an ``Unavailable`` raised because the database is out of reach (the
#: title says only that something the request needs is: core, a provider, ...)
DATABASE_UNAVAILABLE = "The database cannot be reached right now; try again."


BY_SLUG: dict[str, type[CairnError]] = {
    cls.slug: cls
    for cls in (
        CairnError,
        InvalidInput,
        PayloadTooLarge,
        Unauthorized,
        Forbidden,
        NotFound,
        Conflict,
        IllegalTransition,
        StaleAttempt,
        IdempotencyMismatch,
        QuotaExceeded,
        Unavailable,
    )
}


def is_refusal(exc: CairnError) -> bool:
    """Whether a service refused the request itself (a 4xx: invalid, too large, forbidden,
    not found, a conflicting key), as opposed to not taking it now (401: a token being
    rotated; 429: a quota, try again after Retry-After; a 5xx): what a caller of another
    service records as failed rather than tries again."""
    return 400 <= exc.status < 500 and exc.status not in (401, 429)
