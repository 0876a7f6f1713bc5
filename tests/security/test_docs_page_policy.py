"""A real core's /docs: Swagger UI from core's own origin under a strict policy, never a
third party's script on the origin where the dashboard keeps its token (the browser's
view of the same page, and cron's and dag's, is tests/browser/test_api_docs.py)."""

from __future__ import annotations

import re

import httpx

from tests.support import Core

# Where a page can name something to load.
_REFERENCE = re.compile(r"""(?:src|href|data-openapi)="([^"]*)\"""")


def test_docs_reference_only_core_own_files_under_a_strict_policy(core: Core) -> None:
    with httpx.Client(base_url=core.url, timeout=30) as http:
        page = http.get("/docs")
        assert page.status_code == 200
        policy = page.headers["content-security-policy"]
        for rule in ("default-src 'none'", "script-src 'self';", "frame-ancestors 'none'"):
            assert rule in policy
        assert "unsafe" not in policy
        assert "http" not in page.text.replace('xmlns="http', "")
        scripts = re.findall(r"<script([^>]*)>(.*?)</script>", page.text, re.S)
        assert scripts and all("src=" in attrs and not body.strip() for attrs, body in scripts)
        references = _REFERENCE.findall(page.text)
        assert len(references) == 5, references
        for reference in references:
            assert reference.startswith("/") and not reference.startswith("//"), reference
            asset = http.get(reference)
            assert asset.status_code == 200, reference
            if reference == "/openapi.json":
                continue
            again = http.get(reference, headers={"If-None-Match": asset.headers["etag"]})
            assert again.status_code == 304 and not again.content
        bundle = http.get("/docs/static/swagger-ui-bundle.js")
        assert bundle.headers["content-type"].startswith("text/javascript")
        assert b"SwaggerUIBundle" in bundle.content
        # The pages FastAPI would serve from a CDN, or with an inline script, are gone.
        assert http.get("/redoc").status_code == 404
        assert http.get("/docs/oauth2-redirect").status_code == 404
        assert http.get("/docs/static/redoc.standalone.js").status_code == 422
