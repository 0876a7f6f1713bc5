"""Deprecated routes answer with ``Deprecation`` (RFC 9745) and ``Sunset`` (RFC 8594).

Mark a route with ``**deprecated(since=..., sunset=...)`` in its decorator: FastAPI lists
it as deprecated in the OpenAPI document, with the two dates as ``x-deprecated`` and
``x-sunset``; :class:`DeprecationHeaders` adds the headers to every answer of it, errors
included (docs/api.md).
"""

from __future__ import annotations

import calendar
from datetime import UTC, date, datetime
from email.utils import format_datetime
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

SINCE = "x-deprecated"
SUNSET = "x-sunset"


def deprecated(since: date, sunset: date, link: str | None = None) -> dict[str, Any]:
    """The route options that deprecate it from ``since`` and withdraw it at ``sunset``;
    ``link`` names the page that says what to use instead."""
    if sunset <= since:
        raise ValueError(f"the sunset {sunset} is not after the deprecation {since}")
    extra: dict[str, Any] = {SINCE: since.isoformat(), SUNSET: sunset.isoformat()}
    if link is not None:
        extra["x-deprecation-link"] = link
    return {"deprecated": True, "openapi_extra": extra}


def headers(extra: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    """The answer's headers for a route's ``openapi_extra``: ``Deprecation: @<epoch>``,
    ``Sunset: <HTTP-date>`` and a ``Link`` with ``rel="deprecation"`` when given."""
    found = []
    if SINCE in extra:
        epoch = calendar.timegm(date.fromisoformat(extra[SINCE]).timetuple())
        found.append((b"deprecation", f"@{epoch}".encode()))
    if SUNSET in extra:
        day = date.fromisoformat(extra[SUNSET])
        moment = datetime(day.year, day.month, day.day, tzinfo=UTC)
        found.append((b"sunset", format_datetime(moment, usegmt=True).encode()))
    if "x-deprecation-link" in extra:
        found.append((b"link", f'<{extra["x-deprecation-link"]}>; rel="deprecation"'.encode()))
    return found


class DeprecationHeaders:
    """Add the deprecation headers to every answer of a route marked with
    :func:`deprecated` (the route is known once the router has matched it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                extra = getattr(route, "openapi_extra", None)
                if getattr(route, "deprecated", False) and extra:
                    message["headers"] = [*message.get("headers", []), *headers(extra)]
            await send(message)

        await self.app(scope, receive, marked)
