"""A route marked deprecated answers with Deprecation (RFC 9745) and Sunset (RFC 8594),
errors included; the others answer without them. No route of core, cron or dag is
deprecated yet, so a service app of the tests' own carries one."""

from __future__ import annotations

import asyncio
from datetime import date
from email.utils import parsedate_to_datetime

import httpx
import pytest

from libs.common import cors, pages, problems
from libs.common.deprecation import deprecated
from libs.common.errors import NotFound

SINCE, SUNSET = date(2026, 12, 1), date(2027, 6, 30)


def _app() -> object:
    app = pages.service_app(title="t", version="1.0.0")
    problems.install(app)

    @app.get("/v1/old", **deprecated(SINCE, SUNSET, link="https://cairn.example/docs/api"))
    async def old(missing: bool = False) -> dict[str, str]:
        if missing:
            raise NotFound("no such thing")
        return {"use": "/v1/new"}

    @app.get("/v1/new")
    async def new() -> dict[str, str]:
        return {}

    return app


def _get(path: str, app: object = None, **headers: str) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app or _app())  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as http:
            return await http.get(path, headers=headers)

    return asyncio.run(go())


def test_a_deprecated_route_answers_with_deprecation_and_sunset() -> None:
    answer = _get("/v1/old")
    assert answer.status_code == 200
    assert answer.headers["deprecation"] == "@1796083200"  # 2026-12-01T00:00:00Z
    assert answer.headers["sunset"] == "Wed, 30 Jun 2027 00:00:00 GMT"
    assert parsedate_to_datetime(answer.headers["sunset"]).date() == SUNSET
    assert answer.headers["link"] == '<https://cairn.example/docs/api>; rel="deprecation"'


def test_its_errors_carry_the_headers_too() -> None:
    answer = _get("/v1/old?missing=true")
    assert answer.status_code == 404
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert answer.headers["sunset"] == "Wed, 30 Jun 2027 00:00:00 GMT"


def test_the_dashboard_may_read_them_across_origins() -> None:
    # cron's and dag's APIs are called from core's /ui: a page may read only the
    # response headers CORS exposes.
    app = _app()
    cors.allow_dashboard(app, "http://core.test")  # type: ignore[arg-type]
    answer = _get("/v1/old", app, origin="http://core.test")
    exposed = {
        h.strip().lower() for h in answer.headers["access-control-expose-headers"].split(",")
    }
    assert {"deprecation", "sunset", "link"} <= exposed


def test_a_route_not_deprecated_answers_without_them() -> None:
    answer = _get("/v1/new")
    assert answer.status_code == 200
    assert "deprecation" not in answer.headers
    assert "sunset" not in answer.headers


def test_the_document_marks_the_route_with_its_dates() -> None:
    document = _app().openapi()  # type: ignore[attr-defined]
    operation = document["paths"]["/v1/old"]["get"]
    assert operation["deprecated"] is True
    assert (operation["x-deprecated"], operation["x-sunset"]) == ("2026-12-01", "2027-06-30")
    assert "deprecated" not in document["paths"]["/v1/new"]["get"]


def test_a_sunset_before_the_deprecation_is_refused() -> None:
    with pytest.raises(ValueError, match="not after"):
        deprecated(SUNSET, SINCE)
