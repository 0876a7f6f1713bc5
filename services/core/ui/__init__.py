"""The web dashboard at ``/ui``: one page and its script, served by core. The page holds
the user's token (in the tab's sessionStorage) and reads core's, cron's and dag's public
APIs with it, so it shows exactly what that token may see. No build step, no CDN."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Literal

from fastapi import APIRouter, Request, Response

from libs.common.cors import origin
from libs.common.pages import policy
from services.core.settings import CoreSettings

router = APIRouter(prefix="/ui", include_in_schema=False)

_TYPES = {"app.js": "text/javascript", "app.css": "text/css", "favicon.svg": "image/svg+xml"}
Asset = Literal["app.js", "app.css", "favicon.svg"]


@cache
def _asset(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


def _policy(settings: CoreSettings) -> str:
    return policy((origin(settings.cron_url), origin(settings.dag_url)))


@router.get("")
async def page(request: Request) -> Response:
    settings: CoreSettings = request.app.state.settings
    config = json.dumps({"cron": settings.cron_url, "dag": settings.dag_url})
    html = _asset("index.html").decode().replace("{{CONFIG}}", config.replace("<", "\\u003c"))
    headers = {"Content-Security-Policy": _policy(settings), "Cache-Control": "no-store"}
    return Response(html, media_type="text/html; charset=utf-8", headers=headers)


@router.get("/static/{name}")
async def asset(name: Asset) -> Response:
    return Response(_asset(name), media_type=_TYPES[name], headers={"Cache-Control": "no-cache"})
