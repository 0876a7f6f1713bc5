"""Cross-origin reads for the dashboard: core serves ``/ui``, and its pages call cron's
and dag's APIs from the browser with the user's token. Only core's own origin (and those
named in ``CAIRN_UI_ORIGINS``) may; no cookies are involved, so no credentials mode."""

from __future__ import annotations

from urllib.parse import urlsplit

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware


def origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def allow_dashboard(app: FastAPI, core_url: str, extra: str = "") -> None:
    origins = [origin(core_url), *(origin(o.strip()) for o in extra.split(",") if o.strip())]
    app.add_middleware(
        CORSMiddleware,
        allow_origins=origins,
        allow_methods=["GET", "POST", "PATCH", "DELETE"],
        allow_headers=["Authorization", "Content-Type"],
        expose_headers=["Deprecation", "Sunset", "Link"],  # docs/api.md
        max_age=600,
    )
