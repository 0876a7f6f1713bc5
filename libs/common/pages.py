"""Cairn's own web pages: the Content-Security-Policy each carries, and every service's
API documentation at ``/docs``.

FastAPI's own ``/docs`` loads Swagger UI from a CDN, unpinned and unchecked, onto the
origin where core's dashboard keeps its token in session storage: whoever could change
that script could read the token. Here Swagger UI comes from the installed package
``fastapi-offline`` (which ships swagger-ui's dist files), started by a script file of
ours (no inline script), under a policy that lets the page load nothing from elsewhere.
ReDoc and the OAuth2 redirect page are not served."""

from __future__ import annotations

import hashlib
import html
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request, Response

from libs.common.deprecation import DeprecationHeaders
from libs.common.errors import Unavailable

log = logging.getLogger("cairn.pages")

DocsAsset = Literal["swagger-ui-bundle.js", "swagger-ui.css", "favicon.png", "docs.js"]

_TYPES = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon.png": "image/png",
    "docs.js": "text/javascript",
}

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<link rel="icon" href="{root}/docs/static/favicon.png">
<link rel="stylesheet" href="{root}/docs/static/swagger-ui.css">
</head>
<body>
<div id="swagger-ui" data-openapi="{openapi}"></div>
<script src="{root}/docs/static/swagger-ui-bundle.js"></script>
<script src="{root}/docs/static/docs.js"></script>
</body>
</html>
"""


def policy(connect: Iterable[str] = ()) -> str:
    """The Content-Security-Policy of a Cairn page: scripts, styles and images of its own
    origin only (no inline script), requests to its origin and to ``connect``."""
    others = "".join(f" {o}" for o in sorted(set(connect)))
    return (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        f"connect-src 'self'{others}; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )


@dataclass(frozen=True)
class _Asset:
    body: bytes
    etag: str


#: The sha-256 of each file taken from ``fastapi-offline`` (pinned in pyproject.toml):
#: script that runs in a service's own origin is served only as it was reviewed, so a
#: changed package (an upgrade, a tampered mirror) is a refusal, not a new script.
VENDORED = {
    "swagger-ui-bundle.js": "4b5a9b35a1adf37f00d39c0bae23cdb37007e2946240ef035137cc85b4d55349",
    "swagger-ui.css": "ca238f7d7c2cf4480c1e77a9c3b9da915ab216e96ffd354e69076560c650c6de",
    "favicon.png": "d16f72cf5a2773eba499cc7f3db1923c6f5f73de990f739e3a05806aafec15b7",
}


class Unreviewed(Exception):
    """A vendored file is not the one whose digest is recorded."""


@cache
def _asset(name: DocsAsset) -> _Asset:
    if name == "docs.js":
        body = resources.files(__package__).joinpath("static", "docs.js").read_bytes()
    else:
        body = resources.files("fastapi_offline").joinpath("static", name).read_bytes()
    digest = hashlib.sha256(body).hexdigest()
    if name in VENDORED and digest != VENDORED[name]:
        raise Unreviewed(f"{name} has sha-256 {digest}, not the reviewed {VENDORED[name]}")
    return _Asset(body, '"' + digest[:32] + '"')


router = APIRouter(include_in_schema=False)


@router.get("/docs")
async def docs_page(request: Request) -> Response:
    """Swagger UI over this service's OpenAPI document."""
    app: FastAPI = request.app
    root = html.escape(request.scope.get("root_path", "").rstrip("/"))
    page = _PAGE.format(
        title=html.escape(f"{app.title} API"),
        root=root,
        openapi=root + html.escape(app.openapi_url or "/openapi.json"),
    )
    headers = {"Content-Security-Policy": policy(), "Cache-Control": "no-store"}
    return Response(page, media_type="text/html; charset=utf-8", headers=headers)


@router.get("/docs/static/{name}")
async def docs_asset(name: DocsAsset, request: Request) -> Response:
    """Swagger UI's files, revalidated by their digest (the bundle is 1.5 MB)."""
    try:
        found = _asset(name)
    except Unreviewed as exc:
        log.error("the API docs are not served: %s", exc)
        raise Unavailable(f"{name} is not the reviewed file: see the service's log") from None
    headers = {
        "ETag": found.etag,
        "Cache-Control": "no-cache",
        "X-Content-Type-Options": "nosniff",
    }
    if request.headers.get("if-none-match") == found.etag:
        return Response(status_code=304, headers=headers)
    return Response(found.body, media_type=_TYPES[name], headers=headers)


def add_routes(app: FastAPI, *routers: APIRouter) -> None:
    """Each router's routes joined to ``app`` as they are, built once as their module was
    imported. FastAPI's ``include_router`` wraps a router instead and builds each of its
    routes again for every application, at its first request: about 80 ms of CPU for
    core's, paid at every start (a test suite starts over a thousand). The same routes
    either way, as long as an include would add nothing to them: none of these routers is
    included with a prefix, tags, dependencies or a response class of the include's own."""
    for router in routers:
        app.router.routes.extend(router.routes)


def service_app(**options: Any) -> FastAPI:
    """A service's FastAPI application, its ``/docs`` served from the package as above and
    its deprecated routes answered with Deprecation/Sunset headers (``options`` go to
    ``FastAPI``)."""
    app = FastAPI(docs_url=None, redoc_url=None, swagger_ui_oauth2_redirect_url=None, **options)
    add_routes(app, router)
    app.add_middleware(DeprecationHeaders)
    return app
