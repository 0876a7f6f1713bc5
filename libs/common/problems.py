"""The one place where errors become problem+json answers (RFC 9457)."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DataError, DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from libs.common.errors import (
    DATABASE_UNAVAILABLE,
    CairnError,
    Forbidden,
    HttpStatusError,
    InvalidInput,
    NotFound,
    PayloadTooLarge,
    QuotaExceeded,
    Unauthorized,
    Unavailable,
)
from libs.common.models import Problem

log = logging.getLogger("cairn.problems")

PROBLEM_JSON = "application/problem+json"

# The error answers an endpoint may give, as OpenAPI shows them.
PROBLEMS: dict[int | str, dict[str, object]] = {
    code: {
        "model": Problem,
        "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}},
    }
    for code in (401, 403, 404, 409, 413, 422, 429, 503)
}

_BY_STATUS: dict[int, type[CairnError]] = {
    400: InvalidInput,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    413: PayloadTooLarge,
    422: InvalidInput,
}


def problem_response(error: CairnError, request: Request) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(error, Unauthorized) else None
    if isinstance(error, QuotaExceeded):
        headers = {"Retry-After": str(error.retry_after_s)}
    return JSONResponse(
        error.problem(instance=request.url.path),
        status_code=error.status,
        media_type=PROBLEM_JSON,
        headers=headers,
    )


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(str(part) for part in loc)


def _validation_problem(exc: RequestValidationError) -> InvalidInput:
    errors = [
        {"field": _field(err.get("loc", ())), "reason": str(err.get("msg", "invalid"))}
        for err in exc.errors()[:50]
    ]
    first = errors[0] if errors else {"field": "request", "reason": "invalid"}
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return InvalidInput(f"{first['field']}: {first['reason']}{more}", errors=errors)


def install(app: FastAPI) -> None:
    """Register the handlers that turn every error into problem+json."""

    @app.exception_handler(CairnError)
    async def _cairn(request: Request, exc: CairnError) -> JSONResponse:
        return problem_response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return problem_response(_validation_problem(exc), request)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        cls = _BY_STATUS.get(exc.status_code)
        if cls is None:
            error: CairnError = HttpStatusError(exc.status_code, str(exc.detail or ""))
        else:
            error = cls(str(exc.detail) if exc.detail else None)
        response = problem_response(error, request)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        # The caller went before its body was whole (a killed agent or cron leader, a cut
        # network), wherever the body is read (``deps.PlainRoute``, an endpoint reading it
        # itself): nothing was done and nobody is there to answer; uvicorn would log it
        # as an exception in the application. FastAPI's own body handling answers 400.
        return Response(status_code=400)

    @app.exception_handler(PoolTimeout)
    async def _pool_exhausted(request: Request, exc: PoolTimeout) -> JSONResponse:
        log.warning("no database connection free: %s", exc)
        return problem_response(Unavailable(DATABASE_UNAVAILABLE), request)

    @app.exception_handler(OperationalError)
    async def _db_down(request: Request, exc: OperationalError) -> JSONResponse:
        log.warning("database unavailable: %s", exc.orig)
        return problem_response(Unavailable(DATABASE_UNAVAILABLE), request)

    @app.exception_handler(DBAPIError)
    async def _db_error(request: Request, exc: DBAPIError) -> JSONResponse:
        return _database_error(exc, request)

    @app.exception_handler(psycopg.Error)
    async def _driver_error(request: Request, exc: psycopg.Error) -> JSONResponse:
        return _driver_error_response(exc, request)


def _driver_error_response(exc: psycopg.Error, request: Request) -> JSONResponse:
    """The driver's own error, not wrapped in a DBAPIError: the statements sent together
    (``libs.common.pipeline``, the worker's turn among them) run on it directly."""
    if _replanned(exc):
        return _replanned_response(exc, request)
    if isinstance(exc, psycopg.OperationalError):  # as ``_db_down``: out of reach
        log.warning("database unavailable: %s", exc)
        return problem_response(Unavailable(DATABASE_UNAVAILABLE), request)
    log.exception("database error")
    return problem_response(CairnError("internal database error"), request)


def _database_error(exc: DBAPIError, request: Request) -> JSONResponse:
    """The answer to a request that met ``exc`` from the database."""
    if exc.connection_invalidated:
        return problem_response(Unavailable(DATABASE_UNAVAILABLE), request)
    if isinstance(exc, DataError):
        # A value the models let through but PostgreSQL cannot hold: still the
        # caller's input, so a 422, never a 500.
        log.warning("database refused a value: %s", exc.orig)
        return problem_response(InvalidInput("a value is outside what can be stored"), request)
    if _replanned(exc.orig):
        return _replanned_response(exc.orig, request)
    log.exception("database error")
    return problem_response(CairnError("internal database error"), request)


_REPLANNED = "a table changed under this request (an upgrade in progress); retry it"


def _replanned_response(orig: BaseException | None, request: Request) -> JSONResponse:
    """Prepared afresh at its next run (the pool's connection forgot it with the failed
    transaction's rollback), so an answer the caller may retry at once."""
    log.warning("a table changed under a prepared statement: %s", orig)
    response = problem_response(Unavailable(_REPLANNED), request)
    response.headers["Retry-After"] = "0"
    return response


def _replanned(orig: BaseException | None) -> bool:
    """Whether ``orig`` (the driver's error) is PostgreSQL refusing a prepared statement whose result's columns
    changed under it (SQLSTATE 0A000, "cached plan must not change result type"): a
    statement reading ``t.*`` after a rolling upgrade's migration added a column to ``t``.
    The transaction changed nothing, and the pool's connection forgot its statements with
    the failed transaction's rollback, so the retry prepares them afresh."""
    return getattr(orig, "sqlstate", None) == "0A000" and "cached plan" in str(orig)
